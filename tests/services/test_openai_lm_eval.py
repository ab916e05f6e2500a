"""lm-evaluation-harness' `local-completions` model scores and generates through the OpenAI front:
its loglikelihood requests (echo, max_tokens 1, logprobs 1, token-id prompts) give the LM service's Score of
the same tokens, and generate_until its Generate."""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI

from memlm.model.tokenizer import Tokenizer
from services.lm.client import LanguageModelClient
from services.openai_front.server import Front, FrontLimits, start_front

PAIRS = [("the quick brown", " fox jumps"), ("the lazy", " dog sleeps"), ("State of the Union:", " strong")]


@pytest.fixture(scope="module")
def harness(servers, tmp_path_factory):
    """lm-eval's local-completions over a front over the plain tiny LM server; the tiny preset's byte
    tokenizer saved where lm-eval's huggingface tokenizer backend reads it."""
    tokenizer_dir = tmp_path_factory.mktemp("tok")
    Tokenizer.byte_level().save(tokenizer_dir)
    client = LanguageModelClient(servers["plain"])
    running = start_front(Front(client, "tiny", None, FrontLimits()))
    lm = LocalCompletionsAPI(base_url=f"http://127.0.0.1:{running.port}/v1/completions", model="tiny",
                             tokenizer_backend="huggingface", tokenizer=str(tokenizer_dir), max_retries=1,
                             batch_size=2, max_length=1024)
    yield lm, client
    running.stop()
    client.close()


def test_local_completions_loglikelihood_is_score(harness):
    lm, client = harness
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)])
    tok = Tokenizer.byte_level()
    want = client.score([tok.encode(c) for _, c in PAIRS], contexts=[tok.encode(x) for x, _ in PAIRS], top_n=1)
    for (logprob, greedy), w in zip(got, want):
        assert logprob == pytest.approx(w.total_logprob, rel=1e-5, abs=1e-5)
        assert greedy == w.is_greedy


def test_local_completions_generate_until_is_generate(harness):
    lm, client = harness
    got = lm.generate_until([Instance("generate_until", {}, ("the quick brown", {"max_gen_toks": 8, "until": ["\n\n"]}),
                                      0)])
    want = "".join(e.text for e in client.generate("the quick brown", max_new_tokens=8, temperature=0.0, seed=1234,
                                                   stop=["\n\n"]) if hasattr(e, "text"))
    assert got == [want.split("\n\n")[0]]
