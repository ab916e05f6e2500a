"""Segment-recurrent evaluation runs no more rows than there are documents (idle rows were pure waste)."""

from __future__ import annotations

import math

from tiny_models import phrase_documents, sharp_tiny_model

from memlm.jobs.segment_eval import evaluate_memory
from memlm.model.memory_config import MemoryConfig

BOUNDARY = 0


def test_one_document_runs_one_row_whatever_the_batch_size():
    model = sharp_tiny_model()
    (doc,) = phrase_documents(1, 150)
    memory = MemoryConfig(kind="xl", segment=32, mem_len=32)
    rows: list[int] = []
    hook = model.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    try:
        alone = evaluate_memory(model, [doc], memory, boundary_token=BOUNDARY, batch_size=1)
        asked_four = evaluate_memory(model, [doc], memory, boundary_token=BOUNDARY, batch_size=4)
    finally:
        hook.remove()
    assert set(rows) == {1}  # before the cap, the batch_size=4 run fed (4, T) batches with 3 idle rows
    assert asked_four["tokens"] == alone["tokens"] == 150
    assert math.isclose(asked_four["perplexity"], alone["perplexity"], rel_tol=1e-6)
