"""memlm.engine.generate (one request through the decoding engine) against full forward passes without a KV
cache, seeded sampling, stops, UTF-8 deltas.

Shape legend: B batch, T tokens, V vocab, C key width.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from memlm.engine.generate import generate
from memlm.jobs.decoding import (
    GenerationEnd,
    SamplingConfig,
    TokenEvent,
    filter_logits,
)
from memlm.model.memory_config import MemoryConfig
from memlm.model.config import PRESETS
from memlm.model.decoder import KVCache, LMOutput, build_model
from memlm.model.tokenizer import Tokenizer, document_boundary
from memlm.model.weights import load_pretrained
from memlm.retrieval.exact import TorchExactSearcher
from memlm.retrieval.knnlm import KNNLMConfig

GREEDY = SamplingConfig(temperature=0.0)


@pytest.fixture(scope="module")
def tiny():
    return load_pretrained("tiny")


def run(tiny, prompt="The quick brown fox", **kwargs):
    tok = tiny.tokenizer
    kwargs.setdefault("boundary_token", document_boundary(tok))
    events = list(generate(tiny.model, tok, tok.encode(prompt), **kwargs))
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    (end,) = [e for e in events if isinstance(e, GenerationEnd)]
    assert events[-1] is end
    return tokens, end


def argmax_by_full_forward(model, prefix: list[int], n: int, decodable: int) -> list[int]:
    seq = list(prefix)
    out = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, -1]  # (V,)
        token = int(logits[:decodable].argmax())
        out.append(token)
        seq.append(token)
    return out


def test_greedy_equals_argmax_of_full_forward_passes(tiny):
    tok = tiny.tokenizer
    tokens, end = run(tiny, max_new_tokens=16, sampling=GREEDY)
    prefix = [document_boundary(tok), *tok.encode("The quick brown fox")]
    expected = argmax_by_full_forward(tiny.model, prefix, 16, tok.vocab_size)
    assert [t.token_id for t in tokens] == expected
    assert end.reason == "length" and end.completion_tokens == 16 and end.prompt_tokens == 19
    # Reported log-probs are the base LM's (no kNN) at the chosen token.
    seq = [document_boundary(tok), *tok.encode("The quick brown fox"), *expected]
    with torch.no_grad():
        lp = F.log_softmax(tiny.model(torch.tensor([seq])).logits[0].float(), -1)  # (T, V)
    want = lp[torch.arange(len(seq) - 17, len(seq) - 1), torch.tensor(expected)]
    torch.testing.assert_close(torch.tensor([t.logprob for t in tokens]), want, rtol=1e-4, atol=1e-4)
    assert all(t.logprob == t.base_logprob for t in tokens)


def test_seeded_sampling_is_reproducible(tiny):
    sampling = SamplingConfig(temperature=1.0, top_p=0.95, seed=1234)
    a, _ = run(tiny, max_new_tokens=16, sampling=sampling)
    b, _ = run(tiny, max_new_tokens=16, sampling=sampling)
    c, _ = run(tiny, max_new_tokens=16, sampling=dataclasses.replace(sampling, seed=99))
    assert [t.token_id for t in a] == [t.token_id for t in b]
    assert [t.token_id for t in a] != [t.token_id for t in c]  # 16 draws from ~259 near-uniform tokens


def test_top_k_one_is_greedy(tiny):
    greedy, _ = run(tiny, max_new_tokens=10, sampling=GREEDY)
    top1, _ = run(tiny, max_new_tokens=10, sampling=SamplingConfig(temperature=0.7, top_k=1, seed=5))
    assert [t.token_id for t in top1] == [t.token_id for t in greedy]


def test_filter_logits_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.05, 0.3, 0.15]))
    kept = torch.isfinite(filter_logits(logits, None, 0.8))
    assert kept.tolist() == [True, False, True, False]  # 0.5 + 0.3 >= 0.8
    kept = torch.isfinite(filter_logits(logits, None, 0.81))
    assert kept.tolist() == [True, False, True, True]
    assert torch.isfinite(filter_logits(logits, None, 1e-9)).tolist() == [True, False, False, False]
    assert torch.isfinite(filter_logits(logits, 2, None)).tolist() == [True, False, True, False]


def test_stop_sequences(tiny):
    free, _ = run(tiny, max_new_tokens=12, sampling=GREEDY)
    ids = [t.token_id for t in free]
    tokens, end = run(tiny, max_new_tokens=12, sampling=GREEDY, stop_sequences=[ids[3:5]])
    assert end.reason == "stop" and [t.token_id for t in tokens] == ids[:5]
    assert end.stop_sequence == tiny.tokenizer.decode(ids[3:5])
    text = "".join(t.text_delta for t in free)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop
    tokens, end = run(tiny, max_new_tokens=12, sampling=GREEDY, stop_sequences=["never generated \n", stop])
    got = "".join(t.text_delta for t in tokens) + end.text_delta
    assert end.reason == "stop" and end.stop_sequence == stop and stop in got
    assert stop not in tiny.tokenizer.decode([t.token_id for t in tokens[:-1]])  # stopped at the first match
    assert len(tokens) < 12


def test_eos_ends_generation(tiny):
    first, _ = run(tiny, max_new_tokens=3, sampling=GREEDY)
    tokens, end = run(tiny, max_new_tokens=3, sampling=GREEDY, eos_id=first[1].token_id)
    assert end.reason == "eos" and end.completion_tokens == 1 and len(tokens) == 1


class ScriptedModel(torch.nn.Module):
    """Predicts the next token of a fixed script with certainty: a stand-in decoder for the text tests."""

    def __init__(self, script: list[int]):
        super().__init__()
        self.config = PRESETS["tiny"]
        self.script = script
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    @property
    def device(self):
        return self.anchor.device

    def forward(self, idx, state=None, logits_from=0):
        B, T = idx.shape
        pos = state.positions(B, T, idx.device).long() if state is not None else torch.arange(T).expand(B, T)
        logits = torch.full((B, T, self.config.vocab_size), -30.0)  # (B, T, V)
        for t in range(T):
            nxt = int(pos[0, t]) + 1
            logits[:, t, self.script[nxt] if nxt < len(self.script) else 0] = 30.0
        new_state = KVCache(None, state.length + T, state.max_len) if state is not None else None
        return LMOutput(logits[:, logits_from:], torch.zeros(B, T, self.config.n_embd), new_state)


def test_text_deltas_hold_split_utf8_characters():
    tok = Tokenizer.byte_level()
    text = "héllo €😀 ok"
    script = [document_boundary(tok), *tok.encode("x"), *tok.encode(text)]
    events = list(generate(ScriptedModel(script), tok, tok.encode("x"), max_new_tokens=len(tok.encode(text)),
                           sampling=GREEDY, boundary_token=document_boundary(tok)))
    deltas = [e.text_delta for e in events]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas.count("") == len(tok.encode(text)) - len(text) + 1  # continuation bytes, plus the end event
    assert [d for d in deltas if d] == list(text)


def test_sliding_window_when_the_cache_is_full():
    config = dataclasses.replace(PRESETS["tiny"], max_seq_len=16)
    torch.manual_seed(0)
    model = build_model(config)
    tok = Tokenizer.byte_level()
    prompt = tok.encode("abcdefgh")
    events = list(generate(model, tok, prompt, max_new_tokens=40, sampling=GREEDY,
                           boundary_token=document_boundary(tok)))
    tokens = [e.token_id for e in events if isinstance(e, TokenEvent)]
    assert len(tokens) == 40 and events[-1].reason == "length"
    # Until the cache first fills (16 positions), decoding equals full forward passes.
    assert tokens[:7] == argmax_by_full_forward(model, [document_boundary(tok), *prompt], 7, tok.vocab_size)


def test_knn_lambda_zero_generates_the_base_tokens(tiny):
    keys = torch.randn(50, tiny.model.config.n_embd)
    searcher = TorchExactSearcher(keys, torch.randint(0, 200, (50,)).numpy())
    base, _ = run(tiny, max_new_tokens=8, sampling=GREEDY)
    mixed, _ = run(tiny, max_new_tokens=8, sampling=GREEDY, searcher=searcher, knn=KNNLMConfig(k=4, lmbda=0.0))
    assert [t.token_id for t in mixed] == [t.token_id for t in base]
    # The same log-probs up to float rounding: a greedy base-LM row takes logit - logsumexp, a kNN-LM row the
    # log-softmax the mixture needs (memlm.engine.sampling.choose_tokens).
    torch.testing.assert_close(torch.tensor([t.logprob for t in mixed]), torch.tensor([t.logprob for t in base]),
                               rtol=0, atol=1e-5)
    # lambda 1: only neighbour values can be drawn.
    only_knn, _ = run(tiny, max_new_tokens=8, sampling=SamplingConfig(seed=3), searcher=searcher,
                      knn=KNNLMConfig(k=4, lmbda=1.0, temperature=1.0))
    assert {t.token_id for t in only_knn} <= set(searcher.values.tolist())
    assert all(t.logprob > -1e30 for t in only_knn)


def test_bad_arguments(tiny):
    tok = tiny.tokenizer
    from memlm.errors import MemlmError

    with pytest.raises(MemlmError, match=r"^temperature must be a finite number >= 0, got -1.0$"):
        SamplingConfig(temperature=-1.0)
    with pytest.raises(MemlmError, match=r"^top_p must be in \(0, 1\], got 0.0$"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(MemlmError, match="^max_new_tokens must be >= 1, got 0$"):
        generate(tiny.model, tok, [1], max_new_tokens=0)
    with pytest.raises(MemlmError, match=r"^prompt has token ids outside \[0, 512\)$"):
        generate(tiny.model, tok, [100000], max_new_tokens=1)
    with pytest.raises(MemlmError, match="^stop sequences must be non-empty$"):
        generate(tiny.model, tok, [1], max_new_tokens=1, stop_sequences=[""])
    too_long = MemoryConfig("xl", segment=tiny.model.config.max_seq_len + 1)
    with pytest.raises(MemlmError, match=r"^segment must be in \[1, 1024\] with a memory, got 1025$"):
        generate(tiny.model, tok, [1], max_new_tokens=1, memory=too_long)


def test_should_stop_is_polled_before_every_step(tiny):
    from memlm.jobs.windows import WorkStopped

    tok, polls = tiny.tokenizer, []

    def should_stop() -> bool:
        polls.append(True)
        return len(polls) > 3  # three steps run: the prompt (and the first token), then two tokens

    events = generate(tiny.model, tok, tok.encode("The quick"), max_new_tokens=20, sampling=GREEDY,
                      boundary_token=document_boundary(tok), should_stop=should_stop)
    got = []
    with pytest.raises(WorkStopped):
        for event in events:
            got.append(event)
    assert len(got) == 3 and all(isinstance(e, TokenEvent) for e in got)
