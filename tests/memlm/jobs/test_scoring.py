"""memlm.jobs.scoring against its oracles: `memlm eval`'s windows and perplexity, full forward passes, and
kNN-LM evaluation (evaluate_knnlm) on the tiny random model.

Shape legend: n scored tokens, V vocab, N keys, C key width.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from memlm.jobs.evaluate import evaluate_perplexity
from memlm.jobs.knnlm_eval import evaluate_knnlm
from memlm.jobs.scoring import plan_scored_windows, score_tokens, score_tokens_segments
from memlm.jobs.segment_eval import evaluate_segments
from memlm.jobs.windows import WindowConfig, plan_windows, score_documents
from memlm.model.memory_config import MemoryConfig
from memlm.memory.state import new_memory
from memlm.model.tokenizer import Tokenizer, document_boundary
from memlm.model.weights import load_pretrained
from memlm.jobs.windows import exact_searcher_over_documents
from memlm.retrieval.knnlm import KNNLMConfig

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Peter Piper picked a peck of pickled peppers.",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. " * 2,
]

BOUNDARY = document_boundary(Tokenizer.byte_level())
"""The tiny preset's document boundary (its byte tokenizer has no <|endoftext|>: BOS)."""


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_pretrained("tiny")


@pytest.fixture(scope="module")
def docs(tiny):
    return [tiny.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def searcher(tiny):
    """Exact search over (key, next token) pairs of the tiny model over TEXTS (as a datastore holds)."""
    tok = tiny.tokenizer
    train = [tok.encode(t) for t in TEXTS + ["the lazy dog and the quick fox " * 4]]
    return exact_searcher_over_documents(tiny.model, train, WindowConfig(48, 24, 4), document_boundary(tok))


def test_plan_without_context_is_memlm_eval_plan():
    for n in range(0, 60, 7):
        for context, stride in ((8, 8), (8, 3), (16, 8), (5, 1)):
            assert plan_scored_windows(n, 0, context, stride) == plan_windows(n, context, stride)


def test_plan_refuses_bad_windows_with_and_without_context():
    from memlm.errors import MemlmError

    for first in (0, 3):  # the same check (memlm.jobs.windows.check_window) either way
        with pytest.raises(MemlmError, match=r"^--stride must be between 1 and --context \(8\), got 9$"):
            plan_scored_windows(10, first, 8, 9)
        with pytest.raises(MemlmError, match="^--context must be at least 1, got 0$"):
            plan_scored_windows(10, first, 0, 1)


def test_plan_with_context_scores_each_target_once_with_left_context():
    for n in range(1, 50, 3):
        for first in range(0, n, 4):
            for context, stride in ((8, 4), (8, 8), (6, 1), (64, 32)):
                windows = plan_scored_windows(n, first, context, stride)
                scored = [p for w in windows for p in range(w.score_from, w.end)]
                assert scored == list(range(first, n))
                for w in windows:
                    assert w.end - w.start <= context and w.start <= w.score_from < w.end
                    # every scored position keeps at least context - stride tokens of left context
                    assert w.score_from - w.start >= min(w.score_from, context - stride)


def test_score_without_context_equals_memlm_eval(tiny, docs):
    window = WindowConfig(context=32, stride=16, batch_size=4)
    scores = score_tokens(tiny.model, docs, context=32, stride=16, boundary_token=BOUNDARY)
    # Per-token base log-probs are bit-identical to the windows memlm eval runs.
    expected: list[list[torch.Tensor]] = [[] for _ in docs]
    for s in score_documents(tiny.model, docs, window, BOUNDARY):
        expected[s.doc].append(s.lm_logprob)
    for s, e, d in zip(scores, expected, docs):
        np.testing.assert_array_equal(s.base_logprob, torch.cat(e).numpy())
        np.testing.assert_array_equal(s.logprob, s.base_logprob)  # no kNN: final is base
        assert s.tokens.tolist() == d and s.context_tokens == 1
    result = evaluate_perplexity(tiny.model, docs, window, BOUNDARY, progress=False)
    nll = -sum(s.total_logprob for s in scores)
    assert math.isclose(math.exp(nll / result["tokens"]), result["perplexity"], rel_tol=1e-9)
    greedy = sum(int(s.greedy.sum()) for s in scores)
    assert greedy / result["tokens"] == pytest.approx(result["greedy_accuracy"])


def test_one_window_equals_full_forward(tiny, docs):
    seq = docs[1]
    (s,) = score_tokens(tiny.model, [seq], context=128, stride=64, boundary_token=BOUNDARY, top_n=5)
    idx = torch.tensor([[BOUNDARY, *seq]])
    with torch.no_grad():
        lp = F.log_softmax(tiny.model(idx).logits[0, :-1].float(), -1)  # (n, V)
    target = torch.tensor(seq)
    torch.testing.assert_close(torch.from_numpy(s.base_logprob), lp.gather(1, target[:, None])[:, 0])
    top = lp.topk(5, -1)
    assert s.top_ids.tolist() == top.indices.tolist()
    torch.testing.assert_close(torch.from_numpy(s.top_logprobs), top.values)
    assert s.greedy.tolist() == (lp.argmax(-1) == target).tolist()
    assert s.perplexity == pytest.approx(math.exp(-float(lp.gather(1, target[:, None]).double().sum()) / len(seq)))


def test_context_conditions_but_is_not_scored(tiny, docs):
    ctx, cont = docs[0][:40], docs[0][40:70]
    (with_ctx,) = score_tokens(tiny.model, [cont], contexts=[ctx], context=128, stride=64,
                               boundary_token=BOUNDARY)
    (whole,) = score_tokens(tiny.model, [ctx + cont], context=128, stride=64, boundary_token=BOUNDARY)
    assert with_ctx.tokens.tolist() == cont and with_ctx.context_tokens == 1 + len(ctx)
    torch.testing.assert_close(torch.from_numpy(with_ctx.base_logprob), torch.from_numpy(whole.base_logprob[40:]))
    # Short windows: each continuation token is scored in a window that starts where the plan says.
    (windowed,) = score_tokens(tiny.model, [cont], contexts=[ctx], context=16, stride=8,
                               boundary_token=BOUNDARY)
    seq = [BOUNDARY, *ctx, *cont]
    for w in plan_scored_windows(len(seq) - 1, len(ctx), 16, 8):
        with torch.no_grad():
            lp = F.log_softmax(tiny.model(torch.tensor([seq[w.start : w.end]])).logits[0].float(), -1)
        rows = torch.arange(w.score_from - w.start, w.end - w.start)
        want = lp[rows, torch.tensor(seq[w.score_from + 1 : w.end + 1])]
        got = windowed.base_logprob[w.score_from - len(ctx) : w.end - len(ctx)]
        torch.testing.assert_close(torch.from_numpy(got), want)


def test_empty_sequence_has_infinite_perplexity(tiny):
    (s,) = score_tokens(tiny.model, [[]], context=16, stride=8, boundary_token=BOUNDARY, top_n=2)
    assert len(s.tokens) == 0 and s.top_ids.shape == (0, 2) and s.perplexity == math.inf


def test_knn_lambda_zero_is_base(tiny, docs, searcher):
    knn = KNNLMConfig(k=8, lmbda=0.0, temperature=1.0)
    (s,) = score_tokens(tiny.model, docs[:1], context=32, stride=16, boundary_token=BOUNDARY,
                        searcher=searcher, knn=knn)
    np.testing.assert_array_equal(s.logprob, s.base_logprob)


def test_knn_perplexity_equals_evaluate_knnlm(tiny, docs, searcher):
    knn = KNNLMConfig(k=8, lmbda=0.5, temperature=5.0)
    window = WindowConfig(context=32, stride=16, batch_size=4)
    scores = score_tokens(tiny.model, docs, context=32, stride=16, boundary_token=BOUNDARY,
                          searcher=searcher, knn=knn, top_n=3)
    result = evaluate_knnlm(tiny.model, docs, searcher, window, knn, BOUNDARY,
                            recall_queries=0, progress=False)
    nll = -sum(s.total_logprob for s in scores)
    base_nll = -sum(s.base_total_logprob for s in scores)
    assert math.isclose(nll, result["knnlm_nll"], rel_tol=1e-9)
    assert math.isclose(base_nll, result["base_nll"], rel_tol=1e-9)
    assert abs(nll - base_nll) > 1.0  # the datastore holds these texts: kNN-LM must change the scores
    for s in scores:
        # Greedy and top-n come from the dense mixture; they must agree with the sparse target score.
        assert (s.top_logprobs[:, :-1] >= s.top_logprobs[:, 1:]).all()
        assert s.greedy.tolist() == (s.top_ids[:, 0] == s.tokens).tolist()
        in_top = s.top_ids == s.tokens[:, None]  # (n, N)
        np.testing.assert_allclose(s.top_logprobs[in_top], s.logprob[in_top.any(1)], rtol=1e-5, atol=1e-5)
        assert (s.top_logprobs[:, 0] >= s.logprob - 1e-5).all()


def test_searches_count_knn_searches_only(tiny, docs, searcher):
    """SequenceScore.searched is None without kNN-LM (no search: searches 0) and marks every token with
    plain kNN-LM (searches = tokens), windows and segments alike."""
    knn = KNNLMConfig(k=8, lmbda=0.5, temperature=5.0)
    memory = MemoryConfig("xl", mem_len=12, sink_tokens=2, segment=8)
    for score in (lambda **kw: score_tokens(tiny.model, docs, context=32, stride=16, boundary_token=BOUNDARY, **kw),
                  lambda **kw: score_tokens_segments(tiny.model, docs, memory=memory, boundary_token=BOUNDARY, **kw)):
        for s in score():
            assert len(s.tokens) > 0 and s.searched is None and s.searches == 0
        for s in score(searcher=searcher, knn=knn):
            assert s.searched.tolist() == [True] * len(s.tokens) and s.searches == len(s.tokens)


# ---------------------------------------------------------------------------------------------
# Segment-recurrent scoring (memory modes): oracle memlm.jobs.segment_eval.evaluate_segments


@pytest.mark.parametrize("segments", [False, True], ids=["windows", "segments"])
def test_bad_arguments_are_refused_and_top_n_is_capped(tiny, docs, searcher, segments):
    from memlm.errors import MemlmError

    def score(**kw):
        if segments:
            return score_tokens_segments(tiny.model, docs[:1], memory=MemoryConfig("xl", segment=8),
                                         boundary_token=BOUNDARY, **kw)
        return score_tokens(tiny.model, docs[:1], context=32, stride=16, boundary_token=BOUNDARY, **kw)

    with pytest.raises(MemlmError, match="^kNN-LM scoring needs both a searcher and a KNNLMConfig$"):
        score(searcher=searcher)
    with pytest.raises(MemlmError, match=r"^kNN-LM scoring needs a fixed lambda and temperature \(tuning is"):
        score(searcher=searcher, knn=KNNLMConfig(k=8, lmbda=None))
    with pytest.raises(MemlmError, match="^top_n must be >= 0, got -1$"):
        score(top_n=-1)
    with pytest.raises(MemlmError, match="^2 contexts for 1 sequences$"):
        score(contexts=[[], []])
    if not segments:
        with pytest.raises(MemlmError, match=r"^--context 1025 is longer than the model supports \(1024\)"):
            score_tokens(tiny.model, docs[:1], context=1025, stride=16, boundary_token=BOUNDARY)
    (s,) = score(top_n=10_000)  # more alternatives than the vocabulary has: all of them, most likely first
    V = tiny.model.config.vocab_size
    assert s.top_ids.shape == (len(docs[0]), V)
    assert (np.diff(s.top_logprobs, axis=1) <= 0).all()
    assert sorted(s.top_ids[0].tolist()) == list(range(V))


@pytest.mark.parametrize("batch_size", [1, 2])
def test_segments_xl_equal_evaluate_segments(tiny, docs, batch_size):
    # Segments of 8 and a memory of 12 slots (+2 sinks): every document spans several segments and
    # evicts from its memory, so the memory carried between segments is what is being compared.
    memory = MemoryConfig("xl", mem_len=12, sink_tokens=2, segment=8)
    boundary = BOUNDARY
    scores = score_tokens_segments(tiny.model, docs, memory=memory, boundary_token=boundary,
                                   batch_size=batch_size, top_n=2)
    result = evaluate_segments(tiny.model, docs, segment=8, memory="xl", mem_len=12, sink_tokens=2,
                               batch_size=batch_size, boundary_token=boundary)
    assert sum(len(s.tokens) for s in scores) == result["tokens"]
    total = sum(s.total_logprob for s in scores)
    assert math.isclose(total, -result["nll"] * result["tokens"], rel_tol=1e-9)
    for s, d in zip(scores, docs):
        assert s.tokens.tolist() == d and s.context_tokens == 1
        np.testing.assert_array_equal(s.logprob, s.base_logprob)
        assert s.greedy.tolist() == (s.top_ids[:, 0] == s.tokens).tolist()


def test_segments_xl_per_token_equal_manual_recurrence(tiny, docs):
    """Per token: one document run segment by segment by hand with XLMemory (batch 1)."""
    memory = MemoryConfig("xl", mem_len=12, sink_tokens=2, segment=8)
    boundary = BOUNDARY
    doc = docs[0]
    (s,) = score_tokens_segments(tiny.model, [doc], memory=memory, boundary_token=boundary, batch_size=1)
    seq = [boundary, *doc]
    state = new_memory(memory, 1)
    want = []
    with torch.no_grad():
        for lo in range(0, len(doc), 8):
            inputs = torch.tensor([seq[lo : lo + 8]])  # (1, T)
            out = tiny.model(inputs, state)
            state = out.state
            lp = F.log_softmax(out.logits[0].float(), -1)  # (T, V)
            want.append(lp.gather(1, torch.tensor(seq[lo + 1 : lo + 9])[:, None])[:, 0])
    torch.testing.assert_close(torch.from_numpy(s.base_logprob), torch.cat(want), rtol=1e-5, atol=1e-5)
    # The memory matters: without it (each segment alone) the scores differ.
    (alone,) = score_tokens_segments(tiny.model, [doc], memory=MemoryConfig("none", segment=8),
                                     boundary_token=boundary, batch_size=1)
    assert not np.allclose(alone.base_logprob, s.base_logprob)


def test_segments_context_conditions_but_is_not_scored(tiny, docs):
    ctx, cont = docs[0][:20], docs[0][20:45]
    memory = MemoryConfig("xl", mem_len=12, sink_tokens=2, segment=8)
    boundary = BOUNDARY
    (with_ctx, empty) = score_tokens_segments(tiny.model, [cont, []], contexts=[ctx, ctx],
                                              memory=memory, boundary_token=boundary, batch_size=2, top_n=1)
    (whole,) = score_tokens_segments(tiny.model, [ctx + cont], memory=memory, boundary_token=boundary,
                                     batch_size=1)
    assert with_ctx.tokens.tolist() == cont and with_ctx.context_tokens == 1 + len(ctx)
    torch.testing.assert_close(torch.from_numpy(with_ctx.base_logprob), torch.from_numpy(whole.base_logprob[20:]))
    assert len(empty.tokens) == 0 and empty.top_ids.shape == (0, 1) and empty.context_tokens == 1 + len(ctx)


def test_segments_knn_lambda_zero_is_base_and_keys_come_from_the_memory_forward(tiny, docs, searcher):
    memory = MemoryConfig("xl", mem_len=12, sink_tokens=2, segment=8)
    boundary = BOUNDARY
    base = score_tokens_segments(tiny.model, docs, memory=memory, boundary_token=boundary)
    zero = score_tokens_segments(tiny.model, docs, memory=memory, boundary_token=boundary,
                                 searcher=searcher, knn=KNNLMConfig(k=8, lmbda=0.0, temperature=1.0))
    mixed = score_tokens_segments(tiny.model, docs, memory=memory, boundary_token=boundary, top_n=3,
                                  searcher=searcher, knn=KNNLMConfig(k=8, lmbda=0.5, temperature=5.0))
    for b, z, m in zip(base, zero, mixed):
        np.testing.assert_array_equal(z.logprob, b.base_logprob)
        np.testing.assert_array_equal(m.base_logprob, b.base_logprob)
        assert m.greedy.tolist() == (m.top_ids[:, 0] == m.tokens).tolist()
    assert abs(sum(m.total_logprob for m in mixed) - sum(b.total_logprob for b in base)) > 1.0
    # Oracle for the mixture: search the keys of the memory forward pass by hand (first document).
    knn = KNNLMConfig(k=8, lmbda=0.5, temperature=5.0)
    doc = docs[1]
    (s,) = score_tokens_segments(tiny.model, [doc], memory=memory, boundary_token=boundary,
                                 searcher=searcher, knn=knn, batch_size=1)
    seq, state, want = [boundary, *doc], new_memory(memory, 1), []
    from memlm.retrieval.knnlm import interpolate, knn_target_logprob

    with torch.no_grad():
        for lo in range(0, len(doc), 8):
            out = tiny.model(torch.tensor([seq[lo : lo + 8]]), state)
            state = out.state
            targets = torch.tensor(seq[lo + 1 : lo + 9])
            n = len(targets)
            lp = F.log_softmax(out.logits[0, :n].float(), -1).gather(1, targets[:, None])[:, 0]  # (n,)
            nb = searcher.search(out.knn_key[0, :n].float().numpy(), knn.k)
            want.append(interpolate(lp, knn_target_logprob(nb, targets, knn.temperature), knn.lmbda))
    torch.testing.assert_close(torch.from_numpy(s.logprob), torch.cat(want), rtol=1e-5, atol=1e-5)


def test_segments_reject_bad_arguments(tiny, docs):
    from memlm.errors import MemlmError

    too_long = MemoryConfig("xl", segment=tiny.model.config.max_seq_len + 1)
    with pytest.raises(MemlmError, match=r"^segment must be in \[1, 1024\] \(the model's context\), got 1025$"):
        score_tokens_segments(tiny.model, docs, memory=too_long, boundary_token=0)


# ---------------------------------------------------------------------------------------------
# Generation with an XL memory as the decoder state (what the Generate rpc's MEMORY_MODE_XL runs)


def test_generate_xl_runs_past_context_and_scores_as_segments(tiny):
    """A copy of the tiny model with a 32-token context generates 60 tokens with an XL memory (never
    re-encoding); scoring prompt + output segment by segment (segment 1, as generation steps) with the
    same memory gives back the generated tokens' base log-probabilities."""
    from dataclasses import replace

    from memlm.engine.generate import generate
    from memlm.jobs.decoding import SamplingConfig, TokenEvent
    from memlm.model.decoder import Decoder

    short = Decoder(replace(tiny.model.config, max_seq_len=32))
    short.load_state_dict(tiny.model.state_dict())
    short.eval()
    tok, boundary = tiny.tokenizer, BOUNDARY
    prompt = tok.encode("The quick brown fox")
    memory = MemoryConfig("xl", mem_len=16, sink_tokens=2, segment=1)
    events = list(generate(short, tok, prompt, max_new_tokens=60, sampling=SamplingConfig(0.9, seed=1),
                           boundary_token=boundary, memory=memory))
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert len(tokens) == 60 and 1 + len(prompt) + 60 > short.config.max_seq_len
    (s,) = score_tokens_segments(short, [[t.token_id for t in tokens]], contexts=[prompt], memory=memory,
                                 boundary_token=boundary, batch_size=1)
    torch.testing.assert_close(torch.from_numpy(s.base_logprob), torch.tensor([t.base_logprob for t in tokens]),
                               rtol=1e-5, atol=1e-5)


def test_generate_xl_without_eviction_equals_kv_cache(tiny):
    """While nothing leaves the memory, the XL memory holds exactly what a KV cache holds."""
    from memlm.engine.generate import generate
    from memlm.jobs.decoding import SamplingConfig, TokenEvent

    tok, boundary = tiny.tokenizer, BOUNDARY
    prompt = tok.encode("Peter Piper picked a peck")
    runs = {}
    for name, memory in (("cache", None), ("xl", MemoryConfig("xl", mem_len=256, sink_tokens=4, segment=8))):
        events = generate(tiny.model, tok, prompt, max_new_tokens=20, sampling=SamplingConfig(0.0),
                          boundary_token=boundary, memory=memory)
        runs[name] = [(e.token_id, e.base_logprob) for e in events if isinstance(e, TokenEvent)]
    assert [t for t, _ in runs["xl"]] == [t for t, _ in runs["cache"]]
    np.testing.assert_allclose([lp for _, lp in runs["xl"]], [lp for _, lp in runs["cache"]], rtol=1e-5, atol=1e-5)
