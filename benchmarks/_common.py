"""Shared setup of the benchmarks: SmolLM2 and the SOTU corpus when fetched; a random model or random
tokens only with --synthetic, and then every output says so. Nothing is downloaded here.

A figure measured on random weights or random tokens says nothing about the real model (a random model's
perplexity, its kNN gains, even its attention cost per token are not SmolLM2's), so a benchmark refuses to
print results without the real model and corpus unless the caller asks for a synthetic run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, NamedTuple

try:
    import harness
except ImportError:  # imported as benchmarks._common
    from benchmarks import harness

ROOT = harness.ROOT
"""The repository root (benchmarks/harness.py, which puts it on sys.path)."""

REAL_MODEL = "smollm2-135m"
SYNTHETIC_MODEL = "tiny"
RANDOM_PRESETS = ("tiny", "small")
"""memlm.model.weights presets with random weights."""
SYNTHETIC_NOTE = harness.SYNTHETIC_NOTE


def add_synthetic_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--synthetic", action="store_true",
                        help="allow a random model / random tokens when SmolLM2 or the corpus is not fetched "
                             "(the output then says SYNTHETIC)")


class BenchModel(NamedTuple):
    pre: Any
    """memlm.model.weights.Pretrained: .model, .tokenizer, .fingerprint."""
    name: str
    """Preset name as loaded."""
    boundary: int
    """memlm.model.tokenizer.document_boundary of its tokenizer: the one document-boundary rule."""
    synthetic: bool
    """True when the weights are random (a RANDOM_PRESETS preset)."""


def refuse(what: str, fetch: str) -> None:
    raise SystemExit(f"{what} is not fetched: run `memlm fetch {fetch}` (or pass --synthetic for a random "
                     f"stand-in whose numbers measure speed only)")


def load_model(name: str | None, synthetic: bool, *, synthetic_model: str = SYNTHETIC_MODEL,
               device: str = "cpu", dtype: Any = None) -> BenchModel:
    """SmolLM2 (or the named model); the random `synthetic_model` preset only when synthetic and SmolLM2
    is absent. A named random preset ("tiny", "small") also needs --synthetic.

    device, dtype: as memlm.model.weights.load_pretrained (dtype None: float32).
    """
    import torch

    from memlm.model.tokenizer import document_boundary
    from memlm.model.weights import load_pretrained, model_path

    if name is None:
        if model_path(REAL_MODEL).is_file():
            name = REAL_MODEL
        elif synthetic:
            name = synthetic_model
        else:
            refuse(f"the {REAL_MODEL} model", REAL_MODEL)
    elif name == REAL_MODEL and not model_path(REAL_MODEL).is_file():
        refuse(f"the {REAL_MODEL} model", REAL_MODEL)
    elif name in RANDOM_PRESETS and not synthetic:
        raise SystemExit(f"--model {name} has random weights; pass --synthetic to measure it anyway")
    pre = load_pretrained(name, device=device, dtype=dtype or torch.float32)
    return BenchModel(pre, name, document_boundary(pre.tokenizer), name in RANDOM_PRESETS)


def load_tokens(bench: BenchModel, data: str, split: str | None, max_tokens: int | None,
                synthetic: bool, seed: int = 0) -> tuple[list[list[int]], bool]:
    """(token documents of a fetched corpus split, False), or (random tokens, True) when synthetic and
    the corpus is not fetched. max_tokens None: the whole split."""
    from memlm.data.corpora import is_fetched
    from memlm.data.documents import load_documents, tokenize_documents

    if is_fetched(data):
        docs = [d for d in tokenize_documents(load_documents(data, split), bench.pre.tokenizer, max_tokens) if d]
        return docs, False
    if not synthetic:
        refuse(f"the {data} corpus", data)
    import numpy as np

    rng = np.random.default_rng(seed)
    vocab = bench.pre.model.config.vocab_size
    total = max_tokens or 4000
    return [rng.integers(3, vocab, size=min(total, 2000)).tolist() for _ in range(max(1, total // 2000))], True


DEMO_DATASTORE = str(Path.home() / ".cache/memlm/demo/ds-sotu-1990-2000")
"""The datastore `make demo` builds (scripts/demo.sh): the kNN-LM benchmarks' default."""


class KnnlmSetting(NamedTuple):
    """The real model, a datastore checked against it, its windows, and disjoint evaluation and tuning tokens."""

    bench: BenchModel
    store: Any
    window: Any
    docs: list[list[int]]
    tune_docs: list[list[int]]
    checked_documents: int


def add_knnlm_setting_options(p: argparse.ArgumentParser) -> None:
    """The options of knnlm_setting: the demo's datastore, evaluation and tuning splits by default."""
    p.add_argument("--datastore", default=DEMO_DATASTORE, help="a datastore built by scripts/demo.sh")
    p.add_argument("--data", default="sotu")
    p.add_argument("--eval-split", default="year>=2003")
    p.add_argument("--eval-tokens", type=int, default=6000)
    p.add_argument("--tune-split", default="2001<=year<=2002")
    p.add_argument("--tune-tokens", type=int, default=4000)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4)


def knnlm_setting(args: argparse.Namespace) -> KnnlmSetting:
    """Load SmolLM2, refuse tuning text that shares a document with the evaluation text, open --datastore and check
    it against the model (memlm eval's checks), and load both splits' tokens."""
    from datastore import Datastore
    from memlm.jobs.windows import WindowConfig
    from memlm.retrieval.compat import check_searcher

    bench = load_model(None, False)
    model, tokenizer = bench.pre.model, bench.pre.tokenizer
    checked = harness.refuse_overlap(args.data, args.tune_split, args.eval_split, tokenizer=tokenizer,
                                     tune_tokens=args.tune_tokens, eval_tokens=args.eval_tokens)
    if not Path(args.datastore).is_dir():
        raise SystemExit(f"no datastore at {args.datastore}: run `make demo` or pass --datastore")
    store = Datastore.open(args.datastore)
    info = store.info()
    window = WindowConfig(info.context, info.stride, args.batch_size)
    check_searcher(info, model_fingerprint=bench.pre.fingerprint, tokenizer_fingerprint=tokenizer.fingerprint,
                   dim=model.config.n_embd, key_layer=model.config.key_description, boundary_token=bench.boundary,
                   context=window.context, stride=window.stride)
    docs, _ = load_tokens(bench, args.data, args.eval_split, args.eval_tokens, False)
    tune_docs, _ = load_tokens(bench, args.data, args.tune_split, args.tune_tokens, False)
    return KnnlmSetting(bench, store, window, docs, tune_docs, checked)


def synthetic_banner(synthetic: bool) -> None:
    """Print the synthetic-run note first, so no reader takes the figures for SmolLM2's (a benchmark with a
    harness.Result calls its set_synthetic, which prints this and records it in the JSON)."""
    if synthetic:
        print(f"# {SYNTHETIC_NOTE}")


def start_memlm(argv: list[str], log: Path, start_s: float) -> tuple[subprocess.Popen, str]:
    """A `memlm ...` child process and the address it prints (`listening on HOST:PORT`) within start_s
    seconds; its stderr goes to `log`. A child that does not start is killed and the run ends with its log."""
    err = log.open("a")
    proc = subprocess.Popen([sys.executable, "-m", "memlm", *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=err,
                            text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(start_s)
    if not (lines and lines[0].startswith("listening on ")):
        proc.kill()
        raise SystemExit(f"`memlm {' '.join(argv)}` did not start; see {log}:\n{log.read_text()[-2000:]}")
    return proc, lines[0].split()[-1]
