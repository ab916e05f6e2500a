"""datastore_token_counts counts live entries only: after `memlm datastore remove` the gate
report's token counts are those of the documents a search can still return."""

from __future__ import annotations

import numpy as np
import torch

from datastore import BuildSettings, BuildSource, Datastore, build_from_tokens
from datastore.removal import remove_documents
from memlm.jobs.spalm import datastore_token_counts
from memlm.jobs.windows import WindowConfig
from memlm.model.config import ModelConfig
from memlm.model.decoder import build_model

VOCAB = 64
SOURCE = BuildSource(model_name="tiny-test", model_fingerprint="m" * 64, tokenizer_fingerprint="t" * 64,
                     corpus="random tokens", corpus_fingerprint="c" * 64, boundary_token=1)
SETTINGS = BuildSettings(window=WindowConfig(context=48, stride=24, batch_size=1), index_factory="Flat")


def test_removed_documents_are_not_counted(tmp_path):
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_name("tiny", vocab_size=VOCAB)).eval()
    rng = np.random.default_rng(0)
    kept = rng.integers(2, 32, size=200).tolist()  # tokens 2..31
    gone = rng.integers(32, VOCAB, size=120).tolist()  # tokens 32..63: only the removed document has them
    out = build_from_tokens(model, [kept, gone], tmp_path / "store", SOURCE, SETTINGS, progress=False,
                            log=lambda m: None)
    before = datastore_token_counts(Datastore.open(out), VOCAB)
    assert before.sum() == 320 and before[32:].sum() == 120
    doc_id = Datastore.open(out).documents()[1].doc_id
    remove_documents(out, [doc_id], log=lambda m: None)
    after = datastore_token_counts(Datastore.open(out), VOCAB)
    np.testing.assert_array_equal(after, np.bincount(kept, minlength=VOCAB))  # oracle: the kept document's tokens
