"""The datastore tests' shared pieces: a tiny random model, random token documents and the BuildSource
they are built with (a module of its own: every `conftest` of the tree shares that one module name, so
helpers imported from one resolve to whichever loaded first)."""

from __future__ import annotations

import numpy as np
import torch

from datastore import BuildSource
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
