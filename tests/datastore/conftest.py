"""Shared fixtures: a tiny random model, random token documents, and a small finished datastore."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from datastore import BuildSettings, BuildSource, build_from_tokens
from memlm.jobs.windows import WindowConfig
from memlm.model.config import ModelConfig
from memlm.model.decoder import build_model

VOCAB = 64
BOS = 1
WINDOW = WindowConfig(context=48, stride=24, batch_size=4)
PROVENANCE = BuildSource(
    model_name="tiny-test", model_fingerprint="m" * 64, tokenizer_fingerprint="t" * 64,
    corpus="random tokens", corpus_fingerprint="c" * 64, boundary_token=BOS,
)


def make_model(seed: int = 0):
    torch.manual_seed(seed)
    return build_model(ModelConfig.from_name("tiny", vocab_size=VOCAB)).eval()


def make_docs(seed: int = 0, sizes=(400, 90, 0, 700, 33, 260)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, size=n).tolist() for n in sizes]


@pytest.fixture(scope="session")
def tiny_model():
    return make_model()


@pytest.fixture(scope="session")
def docs():
    return make_docs()


@pytest.fixture(scope="session")
def built(tmp_path_factory, tiny_model, docs) -> Path:
    """A finished datastore of `docs` (1483 keys) with an IVF index whose probes skip most lists."""
    out = tmp_path_factory.mktemp("ds") / "store"
    settings = BuildSettings(window=WINDOW, index_factory="IVF16,Flat", nprobe=4, shard_batches=2)
    return build_from_tokens(tiny_model, docs, out, PROVENANCE, settings, progress=False, log=lambda m: None)
