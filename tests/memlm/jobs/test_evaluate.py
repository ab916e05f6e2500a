"""Perplexity jobs against oracles: a memorised string scores near perplexity 1; a uniform model scores V."""

import math

import torch

from memlm.jobs.evaluate import evaluate_perplexity
from memlm.jobs.windows import WindowConfig
from memlm.model.config import ModelConfig
from memlm.model.decoder import build_model


def test_memorised_string_scores_near_perplexity_one():
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_name("tiny"))
    text = list(b"the quick brown fox jumps over the lazy dog; memlm remembers every byte of it.")
    seq = torch.tensor([[0, *text]])  # boundary token 0, then the bytes
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        logits = model(seq[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits[0], seq[0, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    result = evaluate_perplexity(model, [text], WindowConfig(context=128, stride=128), boundary_token=0, progress=False)
    assert result["tokens"] == len(text)
    assert result["perplexity"] < 1.05
    assert result["greedy_accuracy"] == 1.0


def test_uniform_model_has_perplexity_vocab_size():
    model = build_model(ModelConfig.from_name("tiny"))
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0 -> uniform distribution over V tokens
    docs = [list(range(1, 200)), list(range(5, 40))]
    result = evaluate_perplexity(model, docs, WindowConfig(context=16, stride=4), boundary_token=0, progress=False)
    assert result["tokens"] == 199 + 35
    assert math.isclose(result["perplexity"], model.config.vocab_size, rel_tol=1e-4)


def test_token_count_does_not_depend_on_stride():
    """Stride changes the context each token sees, never the number of tokens scored."""
    model = build_model(ModelConfig.from_name("tiny")).eval()
    docs = [torch.randint(1, 512, (300,), generator=torch.Generator().manual_seed(1)).tolist()]
    counts = {
        stride: evaluate_perplexity(model, docs, WindowConfig(context=64, stride=stride), 0, progress=False)["tokens"]
        for stride in (1, 7, 32, 64)
    }
    assert set(counts.values()) == {300}
