"""SPALM for the service (memlm.jobs.spalm_scoring): per-token SPALM scores equal a by-hand
loop of spalm_forward over evaluate_spalm's segments (and sum to its nll), gate 1 is XL scoring exactly,
generation equals a by-hand greedy loop, and SPALM through a real retrieval server (RetrievalClient as the
Searcher) equals SPALM in process over the same Flat datastore, bit for bit.

Shape legend: B rows, T segment tokens, V vocab.
"""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_models import phrase_documents, sharp_tiny_model

from memlm.errors import MemlmError
from memlm.engine.generate import generate
from memlm.engine.requests import SpalmSettings
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.jobs.memorizing import open_memory
from memlm.jobs.scoring import score_tokens_segments
from memlm.jobs.segment_eval import SegmentStream
from memlm.jobs.spalm import datastore_token_counts, evaluate_spalm
from memlm.jobs.spalm_scoring import score_spalm
from memlm.jobs.windows import WindowConfig
from memlm.model.memory_config import MemoryConfig
from memlm.memory.spalm import SpalmHead, spalm_forward
from memlm.model.weights import load_pretrained
from memlm.jobs.windows import exact_searcher_over_documents

BOUNDARY = 1
K = 4
MEMORY = MemoryConfig(kind="spalm", segment=16, mem_len=16, sink_tokens=2)


def open_head(n_embd: int, seed: int = 3) -> SpalmHead:
    """A head whose gate varies by position (w_g random, bias 0: g near 0.5), so the memory counts."""
    torch.manual_seed(seed)
    head = SpalmHead(n_embd)
    with torch.no_grad():
        head.w_g.normal_(0, 0.5)
        head.bias.zero_()
    return head


@pytest.fixture(scope="module")
def setup():
    model = sharp_tiny_model()
    searcher = exact_searcher_over_documents(model, phrase_documents(4, 96, seed=1), WindowConfig(32, 16), BOUNDARY)
    return model, open_head(model.config.n_embd), searcher


def by_hand(model, head, searcher, docs, rows):
    """The oracle: evaluate_spalm's loop written out, each row's per-token log-probs (targets in order)."""
    stream = SegmentStream(docs, rows, MEMORY.segment, BOUNDARY)
    state = open_memory(model, MEMORY, rows)
    got: dict[int, list[torch.Tensor]] = {}
    with torch.inference_mode():
        while (batch := stream.next_batch()) is not None:
            row_doc = list(stream.row_doc)
            state = state.reset_rows(batch.reset)
            out = spalm_forward(model, head, batch.inputs, state, searcher, K, batch.mask)
            state = out.state
            logp = F.log_softmax(out.logits.float(), dim=-1)  # (B, T, V)
            lp = logp.gather(-1, batch.targets[..., None])[..., 0]  # (B, T)
            for r in range(rows):
                if batch.mask[r].any():
                    got.setdefault(row_doc[r], []).append(lp[r][batch.mask[r]])
    return [torch.cat(got[d]).numpy() for d in range(len(docs))]


def test_scores_equal_evaluate_spalm_token_by_token(setup):
    model, head, searcher = setup
    docs = phrase_documents(3, 70, seed=2)
    rows = 2
    scored = score_spalm(model, head, docs, memory=MEMORY, searcher=searcher, k=K, boundary_token=BOUNDARY,
                         batch_size=rows, top_n=2)
    for s, expected in zip(scored.scores, by_hand(model, head, searcher, docs, rows)):
        np.testing.assert_array_equal(s.logprob, expected)
        np.testing.assert_array_equal(s.base_logprob, expected)  # no kNN-LM: SPALM's own
        assert s.top_ids.shape == (len(expected), 2)
        assert s.searches == len(expected)  # SPALM searches every scored token (ScoreResult.searches)
    counts = np.bincount(searcher.values, minlength=model.config.vocab_size)
    ev = evaluate_spalm(model, head, docs, MEMORY, searcher, K, boundary_token=BOUNDARY, token_counts=counts,
                        batch_size=rows)
    logprobs = np.concatenate([s.logprob for s in scored.scores]).astype(np.float64)
    assert ev["tokens"] == len(logprobs) == 210
    assert -logprobs.sum() / len(logprobs) == pytest.approx(ev["nll"], rel=1e-12)  # summed in another order
    gates = np.concatenate(scored.gates)
    assert gates.shape == (210,) and float(gates.mean()) == pytest.approx(ev["gate_mean"], rel=1e-6)
    assert gates.min() < 0.5 < gates.max() < 1  # the gate varies: the retrieved tokens count


def test_gate_one_is_xl_scoring_exactly_and_a_context_is_conditioning_only(setup):
    model, _, searcher = setup
    forced = SpalmHead(model.config.n_embd)
    with torch.no_grad():
        forced.bias.fill_(float("inf"))
    docs = phrase_documents(2, 50, seed=4)
    xl = score_tokens_segments(model, docs, memory=MemoryConfig("xl", segment=16, mem_len=16, sink_tokens=2),
                               boundary_token=BOUNDARY, batch_size=2)
    one = score_spalm(model, forced, docs, memory=MEMORY, searcher=searcher, k=K, boundary_token=BOUNDARY, batch_size=2)
    for a, b in zip(one.scores, xl):
        np.testing.assert_array_equal(a.logprob, b.logprob)
    assert all((g == 1).all() for g in one.gates)
    # A context is scored nowhere; its continuation scores as the tail of the whole sequence.
    _, head, _ = setup
    doc = docs[0]
    whole = score_spalm(model, head, [doc], memory=MEMORY, searcher=searcher, k=K, boundary_token=BOUNDARY)
    tail = score_spalm(model, head, [doc[20:]], contexts=[doc[:20]], memory=MEMORY, searcher=searcher, k=K,
                       boundary_token=BOUNDARY)
    assert tail.scores[0].context_tokens == 21 and len(tail.scores[0].logprob) == 30
    np.testing.assert_allclose(tail.scores[0].logprob, whole.scores[0].logprob[20:], rtol=0, atol=1e-5)
    with pytest.raises(MemlmError, match="--memory spalm"):
        score_spalm(model, head, [doc], memory=MemoryConfig("xl"), searcher=searcher, k=K, boundary_token=BOUNDARY)


def test_generation_equals_a_greedy_loop_of_spalm_forward(setup):
    model, head, searcher = setup
    tokenizer = load_pretrained("tiny").tokenizer  # bytes: ids from 259 up are never drawn
    prompt = phrase_documents(1, 40, seed=5)[0]
    events = generate(model, tokenizer, prompt, max_new_tokens=10, sampling=SamplingConfig(temperature=0.0),
                      boundary_token=BOUNDARY, memory=MEMORY, searcher=searcher, spalm_head=head, spalm=SpalmSettings(K))
    served = [e.token_id for e in events if isinstance(e, TokenEvent)]
    # By hand: every prompt segment through spalm_forward (the memory is the decoder's either way), the
    # last position's logits, then one token at a time, each with one search.
    tokens, state = [BOUNDARY, *prompt], open_memory(model, MEMORY, 1)
    expected = []
    with torch.inference_mode():
        for lo in range(0, len(tokens), MEMORY.segment):
            idx = torch.tensor([tokens[lo : lo + MEMORY.segment]])  # (1, T)
            out = spalm_forward(model, head, idx, state, searcher, K, torch.ones_like(idx, dtype=torch.bool))
            state = out.state
        for _ in range(10):
            token = int(out.logits[0, -1, : tokenizer.vocab_size].argmax())
            expected.append(token)
            out = spalm_forward(model, head, torch.tensor([[token]]), state, searcher, K, torch.ones(1, 1, dtype=torch.bool))
            state = out.state
    assert served == expected and len(served) == 10
    with pytest.raises(MemlmError, match="spalm_head"):
        generate(model, tokenizer, prompt, max_new_tokens=2, memory=MEMORY)


# ---------------------------------------------------------------------------------------------
# Through the retrieval service


class ServerThread:
    """A retrieval server on port 0 on an event loop of its own thread."""

    def __init__(self, searcher) -> None:
        from services.retrieval.server import create_retrieval_server

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server, port = self._run(create_retrieval_server("127.0.0.1:0", searcher))
        self.address = f"127.0.0.1:{port}"

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self._run(self.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def flat_store(tmp_path_factory):
    """A real Flat datastore of the tiny preset over a small corpus, and held-out documents."""
    from datastore import Datastore, build_datastore

    tmp = tmp_path_factory.mktemp("spalm-service")
    corpus = tmp / "corpus.jsonl"
    rows = [{"text": f"Speech number {i}: the state of the union is strong and growing.", "year": 1990 + i}
            for i in range(12)]
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = build_datastore(model="tiny", data=str(corpus), out=tmp / "store", split="year<2000", index="Flat",
                          context=64, stride=32, device="cpu", progress=False)
    pre = load_pretrained("tiny")
    held_out = [pre.tokenizer.encode(r["text"]) for r in rows[10:]]
    return pre, Datastore.open(out), held_out


def test_spalm_through_the_retrieval_service_equals_spalm_in_process(flat_store):
    from memlm.model.tokenizer import document_boundary
    from memlm.retrieval.compat import check_searcher
    from services.retrieval.client import RetrievalClient

    pre, store, docs = flat_store
    model, boundary = pre.model, document_boundary(pre.tokenizer)
    head = open_head(model.config.n_embd)
    counts = datastore_token_counts(store, model.config.vocab_size)
    memory = MemoryConfig(kind="spalm", segment=32, mem_len=32, sink_tokens=2)
    server = ServerThread(store)
    try:
        with RetrievalClient(server.address) as remote:
            check_searcher(remote.info(), model_fingerprint=pre.fingerprint,
                           tokenizer_fingerprint=pre.tokenizer.fingerprint, dim=model.config.n_embd,
                           key_layer=model.config.key_description, boundary_token=boundary)
            results = [evaluate_spalm(model, head, docs, memory, s, K, boundary_token=boundary, token_counts=counts)
                       for s in (store, remote)]
            scores = [score_spalm(model, head, docs, memory=memory, searcher=s, k=K, boundary_token=boundary,
                                  batch_size=1) for s in (store, remote)]
    finally:
        server.close()
    local, served = results
    assert served["nll"] == local["nll"] and served["perplexity"] == local["perplexity"]
    assert served["gate_by_frequency"] == local["gate_by_frequency"] and local["neighbour_rate"] == 1.0
    for a, b in zip(*(s.scores for s in scores)):
        np.testing.assert_array_equal(a.logprob, b.logprob)
    logprobs = np.concatenate([s.logprob for s in scores[0].scores]).astype(np.float64)
    assert -logprobs.mean() == pytest.approx(local["nll"], rel=1e-12)
