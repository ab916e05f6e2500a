"""One harness for every benchmark's result: the figures with the command, commit, machine and versions
they were measured with, written as one JSON file that the docs' results pages and the README's results
table are generated from (scripts/gen_results.py; tests/test_results.py fails when a page disagrees with its
JSON).

What every result records, whatever the benchmark: the exact command (and the thread variables in force),
the commit and whether the tree had local changes, the date, the machine (CPU model, cores this process may
use, the load before and after, torch / faiss / numpy versions, torch's threads, default dtype and the CPU
GEMM in force), the wall time of the whole command (from the process's start: imports, model loading and any
auxiliary structure it builds included), the peak resident memory of the process and of its waited-for
children, and whether the figures come from a random model or random data (`synthetic`, said in the output
too). A benchmark adds its figures, its rows, the build time of each auxiliary structure (`build`), the checks
its claims rest on (`check`: a failed one makes the command exit 1 and no result is written), the knobs it
chose on a tuning split and measured once on held-out text (`tuned`), and the figures it offers to the
README's results table (`headline`).

Where results land: `docs/results/data/<name>.json` (checked in), or the folder of `--results DIR` or of the
environment variable MEMLM_RESULTS_DIR (smoke runs and tests write there).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (put on sys.path, so that `import memlm` finds this tree)."""
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "docs" / "results" / "data"
"""Where results land by default: one `<name>.json` per benchmark, checked in."""
RESULTS_ENV = "MEMLM_RESULTS_DIR"
"""The environment variable that moves results elsewhere (smoke runs, tests)."""
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
"""Environment variables that change what a figure measures; those set are recorded with the command."""
SYNTHETIC_NOTE = "SYNTHETIC RUN: random weights and/or random data; speed only, not SmolLM2's figures"
"""What a result made on a random model or random tokens says, in its output and its JSON."""


def results_dir() -> Path:
    """MEMLM_RESULTS_DIR when set, else docs/results/data."""
    env = os.environ.get(RESULTS_ENV)
    return Path(env) if env else RESULTS


def add_options(parser: argparse.ArgumentParser, name: str) -> None:
    """--results DIR (default: MEMLM_RESULTS_DIR or docs/results/data) and --result-name NAME (default `name`;
    another name keeps the result of the same benchmark in another setting beside the default one)."""
    parser.add_argument("--results", type=Path, default=None, metavar="DIR",
                        help=f"folder of the JSON result (default ${RESULTS_ENV} or docs/results/data)")
    parser.add_argument("--result-name", default=name, metavar="NAME",
                        help=f"the result's name: writes DIR/NAME.json (default {name})")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in ("torch", "faiss", "numpy"):
        module = sys.modules.get(name)
        if module is None:
            try:
                module = __import__(name)
            except ImportError:
                continue
        found[name] = str(getattr(module, "__version__", "unknown"))
    return found


def load() -> float | None:
    """The machine's 1-minute load average (None where the OS has none)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def command() -> str:
    """The command as run: `python` and this process's arguments, shell-quoted."""
    return " ".join(shlex.quote(a) for a in ["python", *sys.argv])


def environment() -> dict[str, str]:
    """The THREAD_VARIABLES that are set."""
    return {k: os.environ[k] for k in THREAD_VARIABLES if k in os.environ}


def _torch_state() -> dict[str, Any]:
    """torch's threads, default dtype and the CPU float32 GEMM in force (memlm.model.cpu_gemm), where loaded."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    state: dict[str, Any] = {"threads": torch.get_num_threads(),
                             "default_dtype": str(torch.get_default_dtype()).removeprefix("torch.")}
    gemm = sys.modules.get("memlm.model.cpu_gemm")
    if gemm is not None:
        state["cpu_gemm"] = getattr(gemm, "_cpu_gemm", None)
    return state


def machine() -> dict[str, Any]:
    """The machine a figure was measured on: CPU model, cores this process may use, load, GPU, versions, and
    torch's threads / default dtype / CPU GEMM in force."""
    torch = sys.modules.get("torch")
    return {
        "cpu": _cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_1min": load(),
        "gpu": torch.cuda.get_device_name(0) if torch is not None and torch.cuda.is_available() else None,
        "versions": _versions(),
        "torch": _torch_state(),
    }


def process_seconds() -> float:
    """Seconds since this process started (Linux: /proc/self/stat), so that a whole command's wall time
    includes its imports; elsewhere, since this module was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()


def peak_memory_mib(children: bool = False) -> dict[str, float]:
    """Peak resident memory (ru_maxrss) of this process, and with `children` of the largest of its waited-for
    children, MiB. (A child forked from a large process counts that process's pages until it execs: the children's
    figure means something only for a benchmark whose children are its servers or workers.)"""
    scale = 1024 * 1024 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    peak = {"process": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale, 1)}
    if children:
        peak["children"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / scale, 1)
    return peak


def stats(samples: Sequence[float]) -> dict[str, float]:
    """median, min, max, n and spread ((max - min) / median) of repeated measurements."""
    values = [float(s) for s in samples]
    if not values:
        return {"n": 0}
    median = statistics.median(values)
    return {"median": median, "min": min(values), "max": max(values), "n": len(values),
            "spread": (max(values) - min(values)) / median if median else 0.0}


def rounded(value: Any, digits: int = 6) -> Any:
    """Floats to `digits` significant digits, recursively (a result's JSON stays readable)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if value == value and abs(value) != float("inf") else str(value)
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    return value


def fingerprints(data: str, split: str | None, tokenizer: Any = None, max_tokens: int | None = None) -> list[str]:
    """The fingerprints (memlm.data.documents.document_fingerprint) of the documents of `split` of corpus `data`
    that a run reads: with `tokenizer` and `max_tokens`, only those that give one of its first max_tokens tokens
    (memlm.data.documents.load_tokenized, as `memlm eval` counts them); else every document of the split."""
    from memlm.data.documents import document_fingerprint, load_documents, load_tokenized

    if tokenizer is not None and max_tokens is not None:
        return list(load_tokenized(data, split, tokenizer, max_tokens).fingerprints)
    return [document_fingerprint(d) for d in load_documents(data, split)]


def refuse_overlap(data: str, tune_split: str | None, eval_split: str | None, *, tokenizer: Any = None,
                   tune_tokens: int | None = None, eval_tokens: int | None = None, what: str = "tuning") -> int:
    """Exit when the tuning text shares a document with the evaluation text (`memlm eval`'s rule for its tuning
    split, memlm.cli.fewer_searches.shared_documents): a knob chosen on the text it is then measured on says
    nothing about held-out text. The token limits, with `tokenizer`, narrow each side to the documents it reads.
    Returns the number of evaluation documents checked."""
    from memlm.cli.fewer_searches import shared_documents
    from memlm.data.documents import TokenizedCorpus

    tune = fingerprints(data, tune_split, tokenizer, tune_tokens)
    evaluated = fingerprints(data, eval_split, tokenizer, eval_tokens)
    shared = shared_documents(tune, TokenizedCorpus([], evaluated))
    if shared or not tune:
        raise SystemExit(f"the {what} split {tune_split!r} of {data} "
                         + (f"shares {len(shared)} document(s) with the evaluation split {eval_split!r}: knobs "
                            "must be chosen on text that is not evaluated" if shared else "holds no document"))
    return len(evaluated)


class Result:
    """A benchmark's result as it runs: made at the start (the load before), `write()` at the end.

    figures: name -> value (numbers or short strings); rows: a list of dicts, one per setting, for tables.
    settings: the settings the figures depend on (weights, dtype, GEMM, datastore, flags).
    """

    def __init__(self, name: str, *, settings: dict[str, Any] | None = None, out: Path | None = None) -> None:
        self.name = name
        self.out = out
        self.settings = dict(settings or {})
        self.figures: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []
        self.builds: dict[str, float] = {}
        self.checks: list[dict[str, Any]] = []
        self.headlines: list[dict[str, str]] = []
        self.tuning: dict[str, Any] | None = None
        self.synthetic = False
        self.synthetic_note: str | None = None
        self.children = False
        """Set by a benchmark whose servers or workers run in child processes: their peak memory is recorded too."""
        self.load_before = load()
        self.started = datetime.datetime.now(datetime.timezone.utc)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **kwargs: Any) -> Result:
        """A Result named and placed by add_options' --result-name and --results."""
        return cls(args.result_name, out=args.results, **kwargs)

    def set_synthetic(self, synthetic: bool, note: str = SYNTHETIC_NOTE) -> None:
        """Mark the result as made on a random model or random data (and print `note` first, so that no reader
        takes the figures that follow for the real model's)."""
        if synthetic:
            self.synthetic, self.synthetic_note = True, note
            print(f"# {note}", flush=True)

    @contextlib.contextmanager
    def build(self, what: str) -> Iterator[None]:
        """Time the building of an auxiliary structure (an index, k-means, a sketch, a gate, a datastore) into
        `builds[what]` (seconds, summed over uses): a figure's wall time either includes it or reports it beside."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.builds[what] = self.builds.get(what, 0.0) + time.perf_counter() - t0

    def check(self, what: str, ok: bool, detail: str = "") -> bool:
        """Record a check a claim rests on (e.g. "tokens identical, round 2"); a failed one is printed at once and
        makes write() exit 1 without writing. Returns ok."""
        self.checks.append({"check": what, "ok": bool(ok), **({"detail": detail} if detail else {})})
        if not ok:
            print(f"CHECK FAILED: {what}" + (f" ({detail})" if detail else ""), file=sys.stderr, flush=True)
        return bool(ok)

    @property
    def passed(self) -> bool:
        return all(c["ok"] for c in self.checks)

    def headline(self, key: str, value: str) -> None:
        """Offer `value` (as printed, e.g. "2.15x") to the README's results table row `key`
        (scripts/gen_results.py's HEADLINES)."""
        self.headlines.append({"key": key, "value": value})

    def tuned(self, *, data: str, split: str, evaluation: str, rule: str, chosen: Any,
              sweep: list[dict[str, Any]]) -> None:
        """Record a sweep: it ran on `split` of `data` (checked disjoint from `evaluation` by refuse_overlap),
        `rule` chose `chosen` there, and the figures / rows of this result are that choice measured once on the
        evaluation split."""
        self.tuning = {"data": data, "split": split, "evaluation": evaluation, "rule": rule, "chosen": chosen,
                       "sweep": sweep}

    def record(self) -> dict[str, Any]:
        peak = peak_memory_mib(self.children)  # before git's children below
        return {
            "name": self.name,
            "command": command(),
            "env": environment(),
            "commit": _git("rev-parse", "HEAD"),
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "date": self.started.isoformat(timespec="seconds"),
            "wall_s": round(process_seconds(), 2),
            "peak_memory_mib": peak,
            "machine": machine() | {"load_1min_before": self.load_before},
            "synthetic": self.synthetic,
            **({"synthetic_note": self.synthetic_note} if self.synthetic else {}),
            "settings": rounded(self.settings),
            "figures": rounded(self.figures),
            "rows": rounded(self.rows),
            **({"build_s": rounded(self.builds)} if self.builds else {}),
            **({"tuning": rounded(self.tuning)} if self.tuning is not None else {}),
            **({"checks": self.checks} if self.checks else {}),
            **({"headlines": self.headlines} if self.headlines else {}),
        }

    def write(self, out_dir: Path | None = None) -> Path:
        """Write `<out_dir>/<name>.json` (out_dir: the argument, else the Result's `out`, else results_dir())
        and return its path; print where, the whole command's wall time and its peak memory. Exits 1 instead,
        writing nothing, when a check failed; refuses to replace a result of the real model with a synthetic
        one."""
        record = self.record()
        if not self.passed:
            failed = [c for c in self.checks if not c["ok"]]
            print(json.dumps(record, indent=2), file=sys.stderr)
            raise SystemExit(f"{len(failed)} check(s) failed (first: {failed[0]['check']}); no result written")
        out_dir = Path(out_dir or self.out or results_dir())
        path = out_dir / f"{self.name}.json"
        if self.synthetic and path.exists() and not json.loads(path.read_text()).get("synthetic", False):
            raise SystemExit(f"{path} holds a result of the real model: a synthetic run writes elsewhere "
                             f"(--results DIR or {RESULTS_ENV})")
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
        os.replace(tmp, path)  # a crash leaves the old result, never half a file
        peak = record["peak_memory_mib"]
        print(f"result: {path} (whole command {record['wall_s']:.1f} s, peak memory {peak['process']:.0f} MiB"
              + (f", children {peak['children']:.0f} MiB" if "children" in peak else "") + ")"
              + (" SYNTHETIC" if self.synthetic else ""), flush=True)
        return path


def plot_lines(path: Path, series: dict[str, list[tuple[float, float]]], *, xlabel: str, ylabel: str, title: str,
               logx: bool = False) -> Path:
    """Draw each series' (x, y) points as one line into `path`.png (beside a result's JSON, for the results
    page) and return the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in series.items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"# wrote {out}", flush=True)
    return out

