"""Attribution and datastore generations through the LM service, real servers on
port 0, the tiny model and a real Flat datastore built from a small corpus with metadata.

Oracles: memlm.jobs.scoring.score_tokens(attribution=N) in process; the interpolation identity
p = lambda p_kNN + (1 - lambda) p_LM for Generate's tokens; the datastore's own generation after `remove`."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import threading
import time

import grpc
import numpy as np
import pytest

from datastore import Datastore, build_datastore
from datastore.live import LiveDatastore
from datastore.removal import remove_documents
from memlm.jobs.scoring import score_tokens
from memlm.model.tokenizer import document_boundary
from memlm.model.weights import load_pretrained
from memlm.retrieval.knnlm import KNNLMConfig
from services.lm.client import (
    Finish,
    KnnRequest,
    LanguageModelClient,
    TextDelta,
    main_score,
)
from services.lm.server import start_lm_server
from services.retrieval.client import RetrievalClient
from services.retrieval.generations import GenerationWatch
from services.retrieval.server import start_retrieval_server
from services.common.server import ServiceError

KNN = KNNLMConfig(k=16, lmbda=0.5, temperature=1.0)
WORDS = ["union", "strong", "nation", "people", "congress", "war", "peace", "liberty", "freedom", "tax", "trade", "law",
         "court", "army", "navy"]


class Loop:
    """An event loop on a thread of its own for the servers; stops them on close."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.running = []

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def serve(self, coro) -> str:
        started = self.run(coro)
        self.running.append(started.running)
        return f"127.0.0.1:{started.running.port}"

    def close(self) -> None:
        for r in reversed(self.running):
            self.run(r.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(0)
    rows = [{"text": " ".join(rng.choice(WORDS, size=40)), "year": 1900 + i, "president": f"P{i % 3}"}
            for i in range(6)]
    root = tmp_path_factory.mktemp("lm-attr")
    (root / "corpus.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = build_datastore(model="tiny", data=str(root / "corpus.jsonl"), out=root / "store", index="Flat", context=64,
                          stride=32, device="cpu", progress=False)
    return rows, out


@pytest.fixture(scope="module")
def tiny():
    return load_pretrained("tiny")


def test_score_attribution_equals_the_library_local_and_remote(corpus, tiny, tmp_path):
    rows, store_dir = corpus
    store = Datastore.open(store_dir)
    text = rows[2]["text"][:80]
    ids = tiny.tokenizer.encode(text)
    (want,) = score_tokens(tiny.model, [ids], context=64, stride=32, boundary_token=document_boundary(tiny.tokenizer),
                           searcher=store, knn=KNN, attribution=3)
    loop = Loop()
    try:
        local = loop.serve(start_lm_server("127.0.0.1:0", tiny, store, knn_defaults=KNN))
        retrieval = loop.serve(start_retrieval_server("127.0.0.1:0", store))
        remote = loop.serve(start_lm_server("127.0.0.1:0", tiny, RetrievalClient(retrieval), knn_defaults=KNN))
        got = {}
        for name, address in (("local", local), ("remote", remote)):
            with LanguageModelClient(address, timeout=60) as c:
                (got[name],) = c.score([text], knn=KnnRequest(attribution_top_n=3))
                (plain,) = c.score([text], knn=KnnRequest())
            # Plain kNN-LM Score runs on the engine (services.lm.score_engine), attribution on the library: float32
            # rounding of the engine's cache layout only.
            assert all(math.isclose(p.logprob, a.logprob, rel_tol=1e-5, abs_tol=1e-6)
                       for p, a in zip(plain.tokens, got[name].tokens))
            assert plain.tokens[0].attribution is None and got[name].datastore_generations == (0,)
        bare = loop.serve(start_lm_server("127.0.0.1:0", tiny, store.exact_searcher("cpu"), knn_defaults=KNN))
        with LanguageModelClient(bare, timeout=60) as c:  # exact search over the keys alone: no documents
            with pytest.raises(ServiceError, match="attribution_top_n: attribution needs a datastore with a documents") as e:
                c.score([text], knn=KnnRequest(attribution_top_n=2))
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        with LanguageModelClient(local, timeout=60) as c:
            with pytest.raises(ServiceError, match="attribution_top_n"):
                c.score([text], knn=KnnRequest(attribution_top_n=65))
            # compressive Generate runs on the decoding engine, which attributes
            deltas = c.generate(text, max_new_tokens=2, temperature=0.0, knn=KnnRequest(attribution_top_n=1),
                                memory_mode="compressive")  # greedy: a sampled eos would end it early
            assert [len(d.attributions) for d in deltas if isinstance(d, TextDelta)] == [1, 1]
            (base,) = c.score([text])
            assert base.datastore_generations == ()
            printed = []
            main_score(local, [text], knn=KnnRequest(attribution_top_n=2), out=_Lines(printed))
    finally:
        loop.close()
    assert got["local"] == got["remote"]
    for t, a in zip(got["local"].tokens, want.attribution):
        assert t.attribution == a  # doc ids, metadata, masses and shares: float64 on the wire
    record = store.documents()[2]
    assert got["local"].tokens[-1].attribution.documents[0].source == want.attribution[-1].documents[0].source
    assert {d.source.doc_id for t in got["local"].tokens for d in t.attribution.documents} >= {record.doc_id}
    assert any(record.doc_id in line and "president=P2" in line and "year=1902" in line for line in printed)


class _Lines:
    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def write(self, s: str) -> None:
        self.lines.extend(s.splitlines())

    def flush(self) -> None:
        pass


def generated(c: LanguageModelClient, prompt: str, n: int, attribution: int = 0):
    deltas = list(c.generate(prompt, max_new_tokens=n, temperature=0.0,
                             knn=KnnRequest(attribution_top_n=attribution)))
    tokens = [d for d in deltas if isinstance(d, TextDelta)]
    finish = [d for d in deltas if isinstance(d, Finish)]
    return tokens, finish[0] if finish else None


def test_generate_attribution_and_generations_follow_a_live_datastore(corpus, tiny, tmp_path):
    rows, store_dir = corpus
    directory = shutil.copytree(store_dir, tmp_path / "served")
    live = LiveDatastore(directory, log=lambda m: None)
    loop = Loop()
    try:
        retrieval = loop.serve(start_retrieval_server("127.0.0.1:0", live, watch=GenerationWatch(
            live.refresh, live.served, poll_s=0.05)))
        link = RetrievalClient(retrieval)
        lm = loop.serve(start_lm_server("127.0.0.1:0", tiny, link, knn_defaults=KNN))
        prompt = rows[4]["text"][:60]
        with LanguageModelClient(lm, timeout=60) as c:
            tokens, finish = generated(c, prompt, 8, attribution=6)
            plain, plain_finish = generated(c, prompt, 8)
            assert [d.token_ids for d in tokens] == [d.token_ids for d in plain]  # attribution changes nothing
            assert finish.datastore_generations == (0,) == plain_finish.datastore_generations
            for d in tokens:
                (a,) = d.attributions
                p_knn = (np.exp(d.logprobs[0]) - (1 - KNN.lmbda) * np.exp(d.base_logprobs[0])) / KNN.lmbda
                assert abs(a.knn_prob - p_knn) <= 2e-6 and abs(sum(x.knn_mass for x in a.documents) - a.knn_prob) <= 1e-9
                assert a.generation == 0
            gone = Datastore.open(directory).documents()[4]
            assert gone.doc_id in {x.source.doc_id for d in tokens for a in d.attributions for x in a.documents}
            remove_documents(directory, [gone.doc_id], log=lambda m: None)
            deadline = time.monotonic() + 20
            while link.generation() != 1:
                assert time.monotonic() < deadline, "the retrieval server did not switch to generation 1"
                time.sleep(0.05)
            tokens, finish = generated(c, prompt, 8, attribution=6)
            (scored,) = c.score([prompt], knn=KnnRequest(attribution_top_n=6))
        assert finish.datastore_generations == (1,) and scored.datastore_generations == (1,)
        seen = {x.source.doc_id for d in tokens for a in d.attributions for x in a.documents}
        seen |= {x.source.doc_id for t in scored.tokens for x in t.attribution.documents}
        assert gone.doc_id not in seen and seen  # the removed document is never a source again
        assert all(a.generation == 1 for d in tokens for a in d.attributions)
        # A local datastore reports its own generation too.
        local = loop.serve(start_lm_server("127.0.0.1:0", tiny, Datastore.open(directory), knn_defaults=KNN))
        with LanguageModelClient(local, timeout=60) as c:
            (scored_local,) = c.score([prompt], knn=KnnRequest())
            _, local_finish = generated(c, prompt, 2)
        assert scored_local.datastore_generations == (1,) and local_finish.datastore_generations == (1,)
    finally:
        loop.close()


def test_client_attribution_flag_needs_knn(capsys):
    from memlm.cli import main

    assert main(["client", "score", "--address", "127.0.0.1:1", "--attribution", "2", "some text"]) != 0
    assert "--attribution needs --knn" in capsys.readouterr().err
    assert main(["client", "generate", "--address", "127.0.0.1:1", "--memory", "spalm", "--attribution", "2",
                 "a prompt"]) != 0
    assert "--attribution is kNN-LM's" in capsys.readouterr().err
