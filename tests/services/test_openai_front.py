"""The OpenAI-compatible front: the official `openai` client, unmodified, against `memlm serve
openai` over real LM servers on port 0 (the tiny model; tests/services/conftest.py `servers`)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")

from services.lm.client import KnnRequest, LanguageModelClient
from services.openai_front.server import Front, FrontLimits, start_front

PROMPT = "the quick brown fox"
TOKEN = "front-secret"


@pytest.fixture(scope="module")
def fronts(servers):
    """HTTP fronts on port 0: "plain" (no token) and "knn" (over the LM server with the in-process index,
    token TOKEN, small limits); each {"port", "lm"}."""
    made, out = [], {}
    for name, lm, token, limits in (("plain", servers["plain"], None, FrontLimits()),
                                    ("knn", servers["local"], TOKEN, FrontLimits(max_body_bytes=4096, max_tokens=64))):
        client = LanguageModelClient(lm, token=token)
        running = start_front(Front(client, "tiny", token, limits))
        made.append((running, client))
        out[name] = {"port": running.port, "lm": lm}
    yield out
    for running, client in made:
        running.stop()
        client.close()


def oai(front, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{front['port']}/v1", api_key=api_key, max_retries=0)


def lm_text(address: str, **kw) -> str:
    with LanguageModelClient(address) as c:
        return "".join(e.text for e in c.generate(PROMPT, **kw) if hasattr(e, "text"))


def test_the_official_client_completes_as_generate_does(fronts):
    r = oai(fronts["plain"]).completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == "tiny" and len(r.choices) == 1
    assert r.choices[0].text == lm_text(fronts["plain"]["lm"], max_new_tokens=12, temperature=0.0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(PROMPT)  # byte tokenizer
    # a seed reproduces a sampled completion, through the front as through the LM service
    seeded = [oai(fronts["plain"]).completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=1.0,
                                                      top_p=0.9, seed=7).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1] == lm_text(fronts["plain"]["lm"], max_new_tokens=10, temperature=1.0, top_p=0.9,
                                             seed=7)


def test_streaming_is_server_sent_events_of_the_same_text(fronts):
    client = oai(fronts["plain"])
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1]) and len(chunks) > 2


def test_a_list_of_prompts_and_stop_sequences(fronts):
    texts = [lm_text(fronts["plain"]["lm"], max_new_tokens=12, temperature=0.0)]
    stop = texts[0][3:5]
    r = oai(fronts["plain"]).completions.create(model="tiny", prompt=[PROMPT, PROMPT], max_tokens=12, temperature=0,
                                                stop=[stop])
    assert [c.index for c in r.choices] == [0, 1]
    # OpenAI's rule: the text ends before the stop sequence (the LM service's includes it)
    assert all(c.finish_reason == "stop" and c.text == texts[0][:texts[0].index(stop)] for c in r.choices)
    streamed = oai(fronts["plain"]).completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                                       stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == texts[0][:texts[0].index(stop)]


def test_echo_with_logprobs_is_score(fronts):
    """lm-eval's local-completions scoring: echo, max_tokens 0, logprobs; the log-probs are Score's."""
    for front, knn in ((fronts["plain"], None), (fronts["knn"], {"lambda": 0.5, "k": 8})):
        client = oai(front, TOKEN)
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2,
                                      extra_body={} if knn is None else {"knn": knn})
        lp = r.choices[0].logprobs
        with LanguageModelClient(front["lm"]) as lm:
            want = lm.score([PROMPT], top_n=2, knn=None if knn is None else KnnRequest(lmbda=0.5, k=8))[0]
        assert r.choices[0].text == PROMPT and lp.tokens == [t.text for t in want.tokens]
        assert lp.token_logprobs == [t.logprob for t in want.tokens]  # bit for bit through JSON
        assert lp.top_logprobs == [{a.text: a.logprob for a in t.alternatives} for t in want.tokens]
        assert lp.text_offset == list(range(len(PROMPT)))
        if knn is not None:
            assert lp.token_logprobs != [t.base_logprob for t in want.tokens]  # kNN-LM did mix in
    # token ids as the prompt, as lm-eval sends them
    with LanguageModelClient(fronts["plain"]["lm"]) as lm:
        ids = list(lm.tokenize([PROMPT])[0].ids)
        want = [t.logprob for t in lm.score([ids])[0].tokens]
    r = oai(fronts["plain"]).completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert r.choices[0].logprobs.token_logprobs == want and r.choices[0].text == PROMPT


def test_the_memory_extra_field_is_the_lm_services_memory_mode(fronts):
    from services.lm.client import MemoryRequest

    # A memory of 16 states cannot hold the 57-token text, so XL scoring differs from plain by what it sees, not by
    # rounding (with a memory holding the whole text it is plain attention, and equal to the last bit on some CPUs).
    memory = {"mode": "xl", "segment_tokens": 16, "memory_tokens": 16}
    r = oai(fronts["plain"]).completions.create(model="tiny", prompt=PROMPT * 3, max_tokens=0, echo=True, logprobs=0,
                                                extra_body={"memory": memory})
    with LanguageModelClient(fronts["plain"]["lm"]) as lm:
        xl = lm.score([PROMPT * 3], memory_mode="xl", memory=MemoryRequest(segment_tokens=16, memory_tokens=16))[0]
        plain = lm.score([PROMPT * 3])[0]
    assert r.choices[0].logprobs.token_logprobs == [t.logprob for t in xl.tokens]
    assert r.choices[0].logprobs.token_logprobs != pytest.approx([t.logprob for t in plain.tokens], abs=1e-3)


def test_echo_with_a_completion_and_its_logprobs(fronts):
    r = oai(fronts["plain"]).completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                                logprobs=1)
    c = r.choices[0]
    assert c.text == PROMPT + lm_text(fronts["plain"]["lm"], max_new_tokens=5, temperature=0.0)
    assert len(c.logprobs.token_logprobs) == len(PROMPT) + 5
    assert c.logprobs.text_offset[len(PROMPT)] == len(PROMPT)


def test_errors_are_4xx_in_openais_shape(fronts):
    client = oai(fronts["plain"])
    for kwargs, param in (({"n": 2}, "n"), ({"logprobs": 9}, "logprobs"), ({"max_tokens": 0}, "max_tokens"),
                          ({"stop": ["a", ""]}, "stop"), ({"extra_body": {"knn": {"lamda": 1}}}, "knn"),
                          ({"extra_body": {"memory": {"mode": "bogus"}}}, "memory"),
                          ({"temperature": "hot"}, "temperature")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt=PROMPT, **{"max_tokens": 4, **kwargs})
        assert e.value.status_code == 400 and e.value.body["param"] == param, kwargs
        assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    assert e.value.body["code"] == "model_not_found"
    # the LM service's own refusal (no datastore behind the plain server) comes back as a 400
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, extra_body={"knn": {}})
    assert "LM service: FAILED_PRECONDITION" in e.value.body["message"]


def test_the_bearer_token_and_the_limits(fronts):
    front = fronts["knn"]
    with pytest.raises(openai.AuthenticationError) as e:
        oai(front, "wrong").completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert [m.id for m in oai(front, TOKEN).models.list()] == ["tiny"]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oai(front, TOKEN).completions.create(model="tiny", prompt=PROMPT, max_tokens=65)
    conn = http.client.HTTPConnection("127.0.0.1", front["port"], timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "x" * 5000}),
                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 413 and "at most 4096" in json.loads(response.read())["error"]["message"]
    conn = http.client.HTTPConnection("127.0.0.1", front["port"], timeout=30)
    conn.request("GET", "/health")  # no token needed, as gRPC health
    response = conn.getresponse()
    assert response.status == 200 and json.loads(response.read()) == {"status": "ok"}


def test_health_is_503_while_the_lm_service_is_down():
    client = LanguageModelClient("127.0.0.1:1", timeout=2.0)
    try:
        with start_front(Front(client, "tiny", None, FrontLimits())) as running:
            conn = http.client.HTTPConnection("127.0.0.1", running.port, timeout=30)
            conn.request("GET", "/health")
            response = conn.getresponse()
            assert response.status == 503 and json.loads(response.read())["error"]["type"] == "api_error"
    finally:
        client.close()


def test_memlm_serve_openai_prints_its_address_and_drains_on_sigterm(servers):
    proc = subprocess.Popen([sys.executable, "-m", "memlm", "serve", "openai", "--lm", servers["plain"], "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if k != "MEMLM_TOKEN"})
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on 127.0.0.1:"), proc.stderr.read() if proc.poll() is not None else line
        port = int(line.strip().rsplit(":", 1)[1])
        models = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0).models.list()
        assert [m.id for m in models] == ["tiny"]  # the LM server's GetInfo name
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
