"""A transformers model behind the LM service and the OpenAI front: Score and Generate in memory mode
NONE with a tiny random GPT-2 saved with save_pretrained (memlm.model.hf_model), memory modes refused."""

from __future__ import annotations

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from reference_decoding import reference_generate
from memlm.jobs.decoding import SamplingConfig
from memlm.model.tokenizer import Tokenizer, document_boundary
from memlm.model.weights import load_pretrained
from services.lm.client import KnnRequest, LanguageModelClient
from services.lm.server import start_lm_server
from services.openai_front.server import Front, FrontLimits, start_front

PROMPT = "the state of the union"


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    directory = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=260, bos_token_id=256,
                        eos_token_id=257)
    GPT2LMHeadModel(config).save_pretrained(directory)
    Tokenizer.byte_level().save(directory)
    return load_pretrained(directory)


@pytest.fixture(scope="module")
def front(gpt2, module_loop):
    started = module_loop.run(start_lm_server("127.0.0.1:0", gpt2, model_name="gpt2-tiny"))
    module_loop.servers.append(started.running.server)
    lm = f"127.0.0.1:{started.running.port}"
    client = LanguageModelClient(lm)
    running = start_front(Front(client, "gpt2-tiny", None, FrontLimits()))
    yield {"lm": lm, "oai": openai.OpenAI(base_url=f"http://127.0.0.1:{running.port}/v1", api_key="x", max_retries=0)}
    running.stop()
    client.close()


def test_score_through_the_front_is_the_models_own_log_probs(gpt2, front):
    r = front["oai"].completions.create(model="gpt2-tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    ids = gpt2.tokenizer.encode(PROMPT)
    idx = torch.tensor([[document_boundary(gpt2.tokenizer), *ids]])  # (1, T + 1)
    with torch.inference_mode():
        logprobs = torch.log_softmax(gpt2.model(idx).logits[0, :-1].float(), dim=-1)  # (T, V)
    want = logprobs.gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()  # (T,)
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(want, abs=1e-5)


def test_generate_through_the_front_is_the_librarys(gpt2, front):
    r = front["oai"].completions.create(model="gpt2-tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    events = list(reference_generate(gpt2.model, gpt2.tokenizer, gpt2.tokenizer.encode(PROMPT), max_new_tokens=10,
                                     sampling=SamplingConfig(temperature=0), boundary_token=document_boundary(gpt2.tokenizer)))
    assert r.choices[0].text == "".join(e.text_delta for e in events)
    streamed = front["oai"].completions.create(model="gpt2-tiny", prompt=PROMPT, max_tokens=10, temperature=0,
                                               stream=True)
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_memory_modes_are_refused_in_one_line(front):
    with pytest.raises(openai.BadRequestError) as e:
        front["oai"].completions.create(model="gpt2-tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0,
                                        extra_body={"memory": {"mode": "xl"}})
    assert "needs memlm's decoder" in e.value.body["message"], e.value.body


def test_serve_lm_key_module_serves_a_datastore_built_with_it(gpt2, module_loop, tmp_path):
    """serve lm --key-module: the datastore's keys (built with the same --key-module) are this model's;
    without the flag the server refuses the datastore in one line (check_searcher)."""
    from datastore import build_datastore
    from memlm.errors import MemlmError
    from services.lm.server import open_model_and_searcher

    model_dir = gpt2.model.config.name
    corpus = tmp_path / "c.txt"
    corpus.write_text(PROMPT * 8)
    store = build_datastore(model_dir, str(corpus), tmp_path / "store", context=32, stride=16, progress=False,
                            key_module="transformer.h.0.mlp")
    pre, searcher = open_model_and_searcher(model_dir, datastore=str(store), key_module="transformer.h.0.mlp")
    started = module_loop.run(start_lm_server("127.0.0.1:0", pre, searcher, model_name="gpt2-tiny"))
    module_loop.servers.append(started.running.server)
    with LanguageModelClient(f"127.0.0.1:{started.running.port}") as lm:
        scored = lm.score([PROMPT], knn=KnnRequest(lmbda=0.5, k=4))[0]
    assert scored.total_logprob > scored.base_total_logprob  # the prompt is in the datastore: kNN-LM helps
    pre, searcher = open_model_and_searcher(model_dir, datastore=str(store))
    with pytest.raises(MemlmError, match="keys are input:transformer.h.0.mlp, this model's kNN key is input:transformer.h.1.mlp"):
        module_loop.run(start_lm_server("127.0.0.1:0", pre, searcher, model_name="gpt2-tiny"))
