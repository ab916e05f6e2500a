"""Shared setup of the benchmarks: SmolLM2 and the SOTU corpus when fetched, else a tiny random model
and random tokens. Nothing is downloaded here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def load_model(name: str | None) -> tuple[Any, str, str, int]:
    """(model, name, fingerprint, boundary token); SmolLM2 when fetched unless a name is given."""
    from memlm.model.tokenizer import document_boundary
    from memlm.model.weights import load_pretrained, model_path

    if name is None:
        name = "smollm2-135m" if model_path("smollm2-135m").is_file() else "tiny"
    pre = load_pretrained(name)
    tok = pre.tokenizer
    return pre, name, pre.fingerprint, document_boundary(tok)


def load_tokens(pre: Any, data: str, split: str | None, max_tokens: int, seed: int = 0) -> list[list[int]]:
    """Token documents of a fetched corpus split, or random tokens when the corpus is not fetched."""
    from memlm.data.corpora import is_fetched
    from memlm.data.documents import load_documents, tokenize_documents

    if is_fetched(data):
        docs = [d for d in tokenize_documents(load_documents(data, split), pre.tokenizer, max_tokens) if d]
        if docs:
            return docs
    import numpy as np

    print(f"corpus {data} not fetched: random tokens", file=sys.stderr)
    rng = np.random.default_rng(seed)
    vocab = pre.model.config.vocab_size
    return [rng.integers(3, vocab, size=min(max_tokens, 2000)).tolist() for _ in range(max(1, max_tokens // 2000))]
