"""Sliding windows: every token scored exactly once, with the context the window promises."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memlm.errors import MemlmError
from memlm.jobs.windows import WindowConfig, plan_windows, score_documents
from memlm.model.config import ModelConfig
from memlm.model.decoder import build_model


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 300), context=st.integers(1, 64), data=st.data())
def test_every_position_scored_exactly_once(n, context, data):
    stride = data.draw(st.integers(1, context))
    windows = plan_windows(n, context, stride)
    scored = [i for w in windows for i in range(w.score_from, w.end)]
    assert scored == list(range(n))
    for w in windows:
        assert 0 <= w.start <= w.score_from < w.end <= n
        assert w.end - w.start <= context
        # once the document is long enough, each scored token sees at least context - stride tokens
        if w.start > 0:
            assert w.score_from - w.start >= context - stride


def test_bad_stride_and_context_are_user_errors():
    with pytest.raises(MemlmError, match=r"^--stride must be between 1 and --context \(8\), got 9$"):
        plan_windows(10, 8, 9)
    with pytest.raises(MemlmError, match=r"^--stride must be between 1 and --context \(8\), got 0$"):
        plan_windows(10, 8, 0)
    with pytest.raises(MemlmError, match="^--context must be at least 1, got 0$"):
        plan_windows(10, 0, 1)


def test_context_longer_than_model_is_refused():
    model = build_model(ModelConfig.from_name("tiny"))
    refusal = r"^--context 4096 is longer than the model supports \(1024\); pass --context 1024 or less$"
    with pytest.raises(MemlmError, match=refusal):
        list(score_documents(model, [[1, 2, 3]], WindowConfig(context=4096, stride=1), boundary_token=0))


def test_scores_match_a_direct_full_pass():
    """With context >= document length, windowed log-probs equal one forward pass over [bos] + doc."""
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_name("tiny")).eval()
    docs = [torch.randint(1, 512, (n,)).tolist() for n in (37, 5, 60)]
    chunks = list(score_documents(model, docs, WindowConfig(context=64, stride=64, batch_size=2), boundary_token=0))
    for doc_index, doc in enumerate(docs):
        got = torch.cat([c.lm_logprob for c in chunks if c.doc == doc_index])
        seq = torch.tensor([[0, *doc]])
        with torch.no_grad():
            logits = model(seq[:, :-1]).logits[0]
        want = torch.log_softmax(logits, -1).gather(1, seq[0, 1:, None])[:, 0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_batching_and_padding_do_not_change_scores():
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_name("tiny")).eval()
    docs = [torch.randint(1, 512, (n,)).tolist() for n in (100, 13, 71)]
    window = dict(context=32, stride=8)
    one = list(score_documents(model, docs, WindowConfig(batch_size=1, **window), boundary_token=0))
    many = list(score_documents(model, docs, WindowConfig(batch_size=5, **window), boundary_token=0))
    torch.testing.assert_close(torch.cat([c.lm_logprob for c in one]), torch.cat([c.lm_logprob for c in many]),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.cat([c.targets for c in one]), torch.tensor([t for d in docs for t in d]))


def test_keys_without_the_head_equal_keys_with_it():
    """The datastore builder (with_logprobs=False) and evaluation share one forward: same keys, bit for bit."""
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_name("tiny")).eval()
    docs = [torch.randint(1, 512, (n,)).tolist() for n in (50, 9, 33)]
    window = WindowConfig(context=16, stride=8, batch_size=3)
    with_head = list(score_documents(model, docs, window, boundary_token=0))
    keys_only = list(score_documents(model, docs, window, boundary_token=0, with_logprobs=False))
    assert [(c.doc, c.positions.tolist()) for c in keys_only] == [(c.doc, c.positions.tolist()) for c in with_head]
    for a, b in zip(keys_only, with_head):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.targets, b.targets)
        assert a.lm_logprob.numel() == 0 and b.lm_logprob.shape == b.targets.shape


def test_window_defaults_for_a_model():
    assert WindowConfig.for_model(2048) == WindowConfig(1024, 512, 4)
    assert WindowConfig.for_model(256) == WindowConfig(256, 128, 4)  # capped at the model's context
    assert WindowConfig.for_model(2048, context=100) == WindowConfig(100, 50, 4)
    assert WindowConfig.for_model(2048, context=1, batch_size=2) == WindowConfig(1, 1, 2)
    assert WindowConfig.for_model(2048, context=64, stride=64) == WindowConfig(64, 64, 4)
    assert WindowConfig.for_model(2048, context=0) == WindowConfig(0, 1, 4)  # kept: plan_windows refuses it
