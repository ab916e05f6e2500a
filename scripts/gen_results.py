"""Render the results pages from the benchmark harness's JSON files (benchmarks/harness.py): the measured-results
page, and the README's results table between its two marker comments.

    python scripts/gen_results.py           # writes docs/results/measured.md and README.md's table
    python scripts/gen_results.py --check   # exits 1 when either disagrees with the JSON

The README's table has one row per HEADLINES entry, in that order. A row's value comes only from the JSON of its
result that offers it (a `headlines` entry with the row's key, harness.Result.headline), with the command recorded
in that JSON; a row whose JSON does not exist yet, or does not offer the key, says "not measured yet" beside the
command that will measure it. No number appears in the table without a JSON behind it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "results" / "data"
PAGE = ROOT / "docs" / "results" / "measured.md"
README = ROOT / "README.md"
BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"
NOT_MEASURED = "not measured yet"


class Headline(NamedTuple):
    """One row of the README's results table."""

    result: str
    """The result's name: docs/results/data/<result>.json."""
    key: str
    """The key of the result's headline that gives the value."""
    label: str
    """The figure column (markdown): what is measured, linked to its explanation on docs/results.md."""
    command: str
    """The command that measures it (shown while the JSON does not exist)."""


HEADLINES = (
    Headline("knnlm_quality", "knnlm", "[kNN-LM perplexity](docs/results.md#knn-lm), base -> kNN-LM (datastore "
             "1990-2000, Flat; lambda and T tuned on 2001-2002; eval 2003+, 6,000 tokens)",
             "python benchmarks/knnlm_quality.py"),
    Headline("knnlm_interpolation", "knnlm_auto", "[kNN-LM, interpolation chosen by `--lambda auto`]"
             "(docs/results.md#knn-lm) (constant or learned lambda, with or without a document cache, chosen on a "
             "held-apart part of 2001-2002; the demo's datastore and evaluation)", "python benchmarks/knnlm_interpolation.py"),
    Headline("knnlm_quality_1980_2000", "knnlm", "[kNN-LM, larger datastore](docs/results.md#knn-lm) (1980-2000, "
             "IVF2048,SQ8; eval 2001+, 6,000 tokens; tuned on 2004+)",
             'python benchmarks/knnlm_quality.py --datastore DS_1980_2000 --eval-split "year>=2001" --tune-split '
             '"year>=2004" --result-name knnlm_quality_1980_2000'),
    Headline("memory_quality", "xl_sinks", "[XL memory 1024 + 4 sinks](docs/results.md#memories) vs no memory vs "
             "sliding window 1152 (frozen SmolLM2, segment 128)", "python benchmarks/memory_quality.py --sections a"),
    Headline("search_savings", "adaptive", "[adaptive retrieval](docs/results.md#fewer-searches): searches saved "
             "on held-out text, fraction chosen on the tuning split (+1% perplexity budget)",
             "python benchmarks/search_savings.py"),
    Headline("search_savings", "retomaton", "[RetoMaton pointers](docs/results.md#fewer-searches): searches saved "
             "on held-out text, walk chosen on the tuning split (+1% perplexity budget)",
             "python benchmarks/search_savings.py"),
    Headline("knnlm_overhead", "overhead", "[kNN-LM eval vs base eval](docs/results.md#speed-and-overhead), speed "
             "and peak memory", "python benchmarks/knnlm_overhead.py --repeats 3"),
    Headline("forward_throughput", "vs_transformers", "[our decoder vs transformers]"
             "(docs/results.md#speed-and-overhead), forward tokens/s",
             "OMP_NUM_THREADS=1 python benchmarks/forward_throughput.py --batch 2 --seq 256 --repeats 3"),
    Headline("xl_eval_speed", "span_1024", "[XL evaluation vs stride-1 sliding window]"
             "(docs/results.md#speed-and-overhead), span 1024", "python benchmarks/xl_eval_speed.py --tokens 64"),
    Headline("load", "micro_batching", "[retrieval micro-batching](docs/results.md#speed-and-overhead), 16 "
             "clients vs the best unbatched server", "python benchmarks/load.py"),
    Headline("generate_speed", "batch1", "[engine decode, batch 1](docs/results.md#speed-and-overhead), greedy, "
             "vs transformers' generate with its KV cache", "python benchmarks/generate_speed.py --figures 2,3"),
    Headline("generate_speed", "streams8", "[engine decode, 8 streams](docs/results.md#speed-and-overhead), "
             "aggregate tokens/s", "python benchmarks/generate_speed.py --figures 2,3"),
    Headline("speculative_knnlm", "speculative", "[speculative kNN-LM decoding](docs/results.md#fewer-searches) "
             "on held-out prompts, draft settings chosen on the tuning split", "python benchmarks/speculative_knnlm.py"),
    Headline("availability", "availability", "[availability](docs/results.md#speed-and-overhead): well-behaved "
             "clients' p99 beside cancelled, maximal and unauthenticated calls and a retrieval restart, vs undisturbed "
             "in the same run", "python benchmarks/availability.py"),
    Headline("ray_build", "ray_build", "[datastore build on Ray](docs/results.md#speed-and-overhead) vs a local "
             "build with the same total threads, whole commands, identical datastores", "python benchmarks/ray_build.py"),
    Headline("shared_cores", "shared_cores", "[decode beside two busy processes](docs/results.md#speed-and-overhead), "
             "batch-1 greedy tokens/s quiet -> beside them, per OpenMP wait policy, on 2 cores", "python benchmarks/shared_cores.py"),
    Headline("decoder_gemm", "batch8", "[decoder GEMM](docs/results.md#speed-and-overhead): batch-8 greedy "
             "decode tokens/s, MKL vs oneDNN", "python benchmarks/decoder_gemm.py"),
)
"""The README's results table, row by row."""


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        value = json.dumps(value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(rows: list[dict[str, Any]]) -> list[str]:
    columns = list(dict.fromkeys(c for row in rows for c in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return lines


def shown_command(record: dict[str, Any]) -> str:
    """The command with the thread variables it ran under, as one would type it."""
    env = " ".join(f"{k}={v}" for k, v in record.get("env", {}).items())
    return f"{env} {record['command']}".strip()


def render_result(record: dict[str, Any]) -> list[str]:
    """One result's section: its figures, its rows, the tuning that chose them, and how and where it was measured."""
    m = record["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items())
    lines = [f"## {record['name']}", ""]
    if record.get("synthetic"):
        lines += [f"**{record.get('synthetic_note') or 'SYNTHETIC RUN'}**", ""]
    lines += [f"```\n{shown_command(record)}\n```", ""]
    if record.get("settings"):
        lines += _table([record["settings"]]) + [""]
    tuning = record.get("tuning")
    if tuning:
        lines += [f"Chosen on the tuning split `{tuning['data']} {tuning['split']}` ({tuning['rule']}): "
                  f"`{_cell(tuning['chosen'])}`; the figures below are that choice measured once on the held-out "
                  f"`{tuning['evaluation']}`. The sweep on the tuning split:", ""]
        lines += (_table(tuning["sweep"]) if tuning.get("sweep") else ["(no sweep rows)"]) + [""]
    if record.get("figures"):
        lines += _table([{"figure": k, "value": v} for k, v in record["figures"].items()]) + [""]
    if record.get("rows"):
        lines += _table(record["rows"]) + [""]
    if record.get("build_s"):
        lines += ["Built before or beside the timed figures (seconds): "
                  + ", ".join(f"{k} {_cell(v)}" for k, v in record["build_s"].items()) + ".", ""]
    if record.get("checks"):
        lines += [f"Checks passed: {len(record['checks'])} ("
                  + "; ".join(dict.fromkeys(c["check"] for c in record["checks"])) + ").", ""]
    torch = m.get("torch", {})
    torch_text = (f"; torch {torch.get('threads')} threads, default dtype {torch.get('default_dtype')}"
                  + (f", CPU GEMM {torch['cpu_gemm']}" if torch.get("cpu_gemm") else "")) if torch else ""
    peak = record.get("peak_memory_mib", {})
    peak_text = (f", peak memory {peak.get('process')} MiB" + (f" (children {peak['children']} MiB)"
                 if peak.get("children") else "")) if peak else ""
    lines += [f"Measured {record['date']} at commit `{record['commit'][:12]}`{' (with local changes)' if record.get('dirty') else ''}"
              f" on {m.get('cpu')}, {m.get('cores')} cores{', ' + m['gpu'] if m.get('gpu') else ''}"
              f" (load {m.get('load_1min_before')} before, {m.get('load_1min')} after); {versions}{torch_text};"
              f" the whole command took {record['wall_s']} s{peak_text}.", ""]
    return lines


def records(data: Path = DATA) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(data.glob("*.json"))]


def render(data: Path = DATA) -> str:
    lines = ["# Measured results", "",
             "Generated by `python scripts/gen_results.py` from the JSON files in `docs/results/data/`, which the "
             "benchmarks write through `benchmarks/harness.py`; do not edit by hand. Each section names the "
             "command that produced it.", "", "## Headlines", "",
             "The README's results table; each value links to its section below.", "",
             for_docs(render_table(data)), ""]
    for record in records(data):
        lines += render_result(record)
    return "\n".join(lines).rstrip("\n") + "\n"


def for_docs(table: str) -> str:
    """The README's table with its links made relative to this page (docs/results/measured.md)."""
    return table.replace("(docs/results/measured.md#", "(#").replace("(docs/results.md#", "(../results.md#")


def render_table(data: Path = DATA) -> str:
    """The README's results table (without the markers): HEADLINES, each value from its result's JSON."""
    found = {r["name"]: r for r in records(data)}
    lines = ["| figure | value | command |", "|---|---|---|"]
    for row in HEADLINES:
        record = found.get(row.result)
        offered = {h["key"]: h["value"] for h in (record or {}).get("headlines", [])}
        if row.key in offered:
            value = offered[row.key] + (" (SYNTHETIC)" if record.get("synthetic") else "")
            value += f" ([measured](docs/results/measured.md#{row.result}))"
            command = shown_command(record)
        else:
            value, command = NOT_MEASURED, row.command
        lines.append(f"| {row.label} | {value.replace('|', '/')} | `{command}` |")
    return "\n".join(lines) + "\n"


def render_readme(text: str, data: Path = DATA) -> str:
    """`text` (README.md) with the table between BEGIN and END generated anew."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} block for the results table")
    return text[: start + len(BEGIN)] + "\n" + render_table(data) + text[end:]


def stale(data: Path | None = None, page: Path | None = None, readme: Path | None = None) -> list[str]:
    """The generated files (default: PAGE and README) that disagree with the JSON in `data` (default DATA)."""
    data, page, readme = data or DATA, page or PAGE, readme or README
    out = []
    if not page.exists() or page.read_text() != render(data):
        out.append(str(page.relative_to(ROOT) if page.is_relative_to(ROOT) else page))
    text = readme.read_text()
    if render_readme(text, data) != text:
        out.append(str(readme.relative_to(ROOT) if readme.is_relative_to(ROOT) else readme))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a page disagrees with its JSON")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale()
        for name in bad:
            print(f"{name} is stale: run python scripts/gen_results.py", file=sys.stderr)
        return 1 if bad else 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(render())
    README.write_text(render_readme(README.read_text()))
    print(PAGE)
    print(README)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
