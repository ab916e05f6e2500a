"""MEMORY_MODE_SPALM on the LM server: Score equals memlm.jobs.spalm_scoring.score_spalm
(whose per-token log-probs are evaluate_spalm's, tests/memlm/jobs/test_spalm_service.py) bit for bit, in
process and through a real retrieval server; Generate's greedy tokens equal a by-hand loop of spalm_forward;
a server without a head or a searcher answers UNIMPLEMENTED naming what it lacks; the datastore is checked
against the head's keys' model at start; a remote search gives the model's turn away and ends by the
deadline; `memlm client --memory spalm` and `memlm serve lm` with a trained checkpoint work end to end.

Real servers on port 0 over the tiny model and the conftest's exact index of its (key, next token) pairs,
with a head whose gate varies by position (w_g random, bias 0), so the retrieved tokens change the scores.
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
import torch

from memlm.errors import MemlmError
from memlm.jobs.memorizing import open_memory
from memlm.jobs.spalm_scoring import score_spalm
from memlm.model.memory_config import MemoryConfig
from memlm.memory.spalm import SPALM_DEFAULT_K, SpalmHead, spalm_forward
from memlm.model.tokenizer import document_boundary
from memlm.v1 import language_model_pb2 as lm_pb2
from memlm.v1 import language_model_pb2_grpc as lm_grpc
from services.lm.requests import LMLimits
from services.lm.server import start_lm_server
from services.lm.spalm import NEEDS_HEAD, NEEDS_SEARCHER, SpalmCheckpoint
from services.retrieval.client import RetrievalClient
from services.retrieval.server import create_retrieval_server

MEMORY = MemoryConfig("spalm", mem_len=16, sink_tokens=2, segment=16)
"""What the requests below ask for."""
OPTIONS = lm_pb2.MemoryOptions(segment_tokens=16, memory_tokens=16, sink_tokens=2)
K = 4
SEARCH = lm_pb2.KnnOptions(k=K)
"""SPALM's search in the requests below: k neighbours per token (enabled false: no kNN-LM mixture)."""
LIMITS = LMLimits(max_k=64)
FAST_S = 1.0


def ids(n: int, salt: int = 0) -> list[int]:
    return [(5 * i + salt) % 200 + 3 for i in range(n)]


@pytest.fixture(scope="module")
def head(tiny):
    torch.manual_seed(3)
    module = SpalmHead(tiny.model.config.n_embd)
    with torch.no_grad():
        module.w_g.normal_(0, 0.5)
        module.bias.zero_()
    return module


def start(module_loop, pretrained, searcher=None, spalm=None) -> str:
    started = module_loop.run(start_lm_server("127.0.0.1:0", pretrained, searcher, limits=LIMITS, spalm=spalm))
    module_loop.servers.append(started.running.server)
    return f"127.0.0.1:{started.running.port}"


@pytest.fixture(scope="module")
def address(tiny, head, index, module_loop) -> str:
    """An LM server with the SPALM head and the index in process (the keys' model is the tiny model itself)."""
    return start(module_loop, tiny, index, SpalmCheckpoint(head, tiny.fingerprint))


@pytest.fixture(scope="module")
def stub(address):
    with grpc.insecure_channel(address) as channel:
        yield lm_grpc.LanguageModelServiceStub(channel)


def score_request(seqs, mode=lm_pb2.MEMORY_MODE_SPALM, knn=SEARCH, **fields) -> lm_pb2.ScoreRequest:
    return lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=s)) for s in seqs],
                               memory_mode=mode, memory=OPTIONS, knn=knn, **fields)


def logprobs(response) -> list[np.ndarray]:
    return [np.array([t.logprob for t in r.tokens], dtype=np.float32) for r in response.results]


def library(tiny, head, searcher, seqs, k=K, top_n=0):
    return score_spalm(tiny.model, head, seqs, memory=MEMORY, searcher=searcher, k=k, top_n=top_n,
                       boundary_token=document_boundary(tiny.tokenizer), batch_size=LIMITS.step_rows(MEMORY.segment))


def test_get_info_lists_spalm_only_where_served(stub, servers):
    info = stub.GetInfo(lm_pb2.LanguageModelServiceGetInfoRequest(), timeout=10)
    assert lm_pb2.MEMORY_MODE_SPALM in info.memory_modes and info.HasField("datastore")
    with grpc.insecure_channel(servers["local"]) as channel:
        local = lm_grpc.LanguageModelServiceStub(channel).GetInfo(lm_pb2.LanguageModelServiceGetInfoRequest(), timeout=10)
    assert lm_pb2.MEMORY_MODE_SPALM not in local.memory_modes


def test_score_equals_the_library_and_reports_the_gate(tiny, head, index, stub):
    seqs = [ids(90, salt=1), ids(40, salt=2), ids(7, salt=3)]
    response = stub.Score(score_request(seqs, top_n=2), timeout=60)
    expected = library(tiny, head, index, seqs, top_n=2)
    for got, s, gates, r in zip(logprobs(response), expected.scores, expected.gates, response.results):
        np.testing.assert_array_equal(got, s.logprob)
        np.testing.assert_array_equal(np.array([t.gate for t in r.tokens], dtype=np.float32), gates)
        assert [t.is_greedy for t in r.tokens] == s.greedy.tolist()
        assert [a.token_id for a in r.tokens[0].alternatives] == s.top_ids[0].tolist()
    all_gates = np.concatenate(expected.gates)
    assert all_gates.min() < 0.5 < all_gates.max() < 1  # the retrieved tokens count
    xl = stub.Score(score_request(seqs, lm_pb2.MEMORY_MODE_XL, knn=None), timeout=60)
    assert not np.array_equal(logprobs(xl)[0], logprobs(response)[0])
    assert not xl.results[0].tokens[0].HasField("gate")
    # knn.k unset: SPALM_DEFAULT_K neighbours, the default of `memlm eval --memory spalm`
    default = stub.Score(score_request(seqs[:1], knn=None), timeout=60)
    np.testing.assert_array_equal(logprobs(default)[0], library(tiny, head, index, seqs[:1], SPALM_DEFAULT_K).scores[0].logprob)


def test_score_through_a_retrieval_server_equals_the_index_in_process(tiny, head, index, module_loop, stub):
    retrieval = f"127.0.0.1:{module_loop.start(create_retrieval_server, '127.0.0.1:0', index)}"
    link = RetrievalClient(retrieval)
    try:
        remote = start(module_loop, tiny, link, SpalmCheckpoint(head, tiny.fingerprint))
        seqs = [ids(70, salt=4), ids(33, salt=5)]
        with grpc.insecure_channel(remote) as channel:
            got = lm_grpc.LanguageModelServiceStub(channel).Score(score_request(seqs), timeout=60)
    finally:
        link.close()
    assert got == stub.Score(score_request(seqs), timeout=60)
    for g, s in zip(logprobs(got), library(tiny, head, index, seqs).scores):
        np.testing.assert_array_equal(g, s.logprob)


def test_generate_equals_a_greedy_loop_of_spalm_forward(tiny, head, index, stub):
    prompt = ids(40, salt=6)
    request = lm_pb2.GenerateRequest(prompt_token_ids=lm_pb2.TokenIds(ids=prompt), max_new_tokens=12,
                                     sampling=lm_pb2.SamplingOptions(temperature=0.0),
                                     memory_mode=lm_pb2.MEMORY_MODE_SPALM, memory=OPTIONS, knn=lm_pb2.KnnOptions(k=K))
    served = [t.token_id for r in stub.Generate(request, timeout=60) if r.HasField("delta") for t in r.delta.tokens]
    model, tok = tiny.model, tiny.tokenizer
    tokens, state, expected = [document_boundary(tok), *prompt], open_memory(model, MEMORY, 1), []
    with torch.inference_mode():
        for lo in range(0, len(tokens), MEMORY.segment):  # the memory is the decoder's: any search mask
            idx = torch.tensor([tokens[lo : lo + MEMORY.segment]])  # (1, T)
            out = spalm_forward(model, head, idx, state, index, K, torch.ones_like(idx, dtype=torch.bool))
            state = out.state
        while len(expected) < 12:
            token = int(out.logits[0, -1, : tok.vocab_size].argmax())
            if token == tok.eos_id:
                break
            expected.append(token)
            out = spalm_forward(model, head, torch.tensor([[token]]), state, index, K, torch.ones(1, 1, dtype=torch.bool))
            state = out.state
    assert served == expected and served


def unimplemented(address) -> str:
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as e:
        lm_grpc.LanguageModelServiceStub(channel).Score(score_request([ids(20)]), timeout=30)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and e.value.details().startswith("memory_mode:")
    return e.value.details()


def test_a_server_without_a_head_or_a_searcher_names_what_it_lacks(tiny, head, module_loop, servers):
    plain = unimplemented(servers["plain"])
    assert NEEDS_HEAD in plain and NEEDS_SEARCHER in plain
    local = unimplemented(servers["local"])  # a datastore, no head
    assert NEEDS_HEAD in local and NEEDS_SEARCHER not in local
    headless = unimplemented(start(module_loop, tiny, None, SpalmCheckpoint(head, tiny.fingerprint)))
    assert NEEDS_SEARCHER in headless and NEEDS_HEAD not in headless


@pytest.mark.parametrize("knn, code, start_", [
    (lm_pb2.KnnOptions(enabled=True), grpc.StatusCode.INVALID_ARGUMENT, "knn.enabled: kNN-LM interpolation does not"),
    (lm_pb2.KnnOptions(lambda_weight=0.5), grpc.StatusCode.INVALID_ARGUMENT, "knn.lambda_weight: is kNN-LM's"),
    (lm_pb2.KnnOptions(k=0), grpc.StatusCode.INVALID_ARGUMENT, "knn.k: 0, must be >= 1"),
    (lm_pb2.KnnOptions(k=65), grpc.StatusCode.OUT_OF_RANGE, "knn.k: 65, at most 64"),
    (lm_pb2.KnnOptions(nprobe=0), grpc.StatusCode.INVALID_ARGUMENT, "knn.nprobe: 0, must be >= 1"),
])
def test_the_search_fields_are_checked(stub, knn, code, start_):
    with pytest.raises(grpc.RpcError) as e:
        stub.Score(score_request([ids(20)], knn=knn), timeout=30)
    assert e.value.code() == code and e.value.details().startswith(start_), e.value.details()


def test_the_datastore_must_hold_the_heads_keys(tiny, head, index, module_loop):
    with pytest.raises(MemlmError, match="fingerprint") as e:
        module_loop.run(start_lm_server("127.0.0.1:0", tiny, index, spalm=SpalmCheckpoint(head, "another-model")))
    assert "\n" not in str(e.value)
    # A fine-tuned checkpoint (its own fingerprint) over the datastore of the model its head was trained
    # against: SPALM is served, kNN-LM is not (its queries would not be made as the keys were).
    tuned = tiny._replace(fingerprint="fine-tuned")
    address = start(module_loop, tuned, index, SpalmCheckpoint(head, tiny.fingerprint))
    with grpc.insecure_channel(address) as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        seqs = [ids(30, salt=7)]
        np.testing.assert_array_equal(logprobs(stub.Score(score_request(seqs), timeout=30))[0],
                                      library(tiny, head, index, seqs).scores[0].logprob)
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(score_request(seqs, lm_pb2.MEMORY_MODE_NONE, knn=lm_pb2.KnnOptions(enabled=True)), timeout=30)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "SPALM head's" in e.value.details()


class GatedIndex:
    """The index behind a gate: a search blocks until `release` is set (a hung retrieval service)."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()

    @property
    def dim(self) -> int:
        return self._inner.dim

    def info(self):
        return self._inner.info()

    def search(self, xq, k, options=None):
        self.entered.set()
        assert self.release.wait(30), "test never released the searcher"
        return self._inner.search(xq, k, options)


def test_a_remote_spalm_search_gives_the_turn_away_and_ends_by_the_deadline(tiny, head, index, module_loop, stub):
    gated = GatedIndex(index)
    retrieval = f"127.0.0.1:{module_loop.start(create_retrieval_server, '127.0.0.1:0', gated)}"
    link = RetrievalClient(retrieval)
    try:
        address = start(module_loop, tiny, link, SpalmCheckpoint(head, tiny.fingerprint))
        spalm = score_request([ids(60, salt=8)])
        with grpc.insecure_channel(address) as channel:
            remote = lm_grpc.LanguageModelServiceStub(channel)
            future = remote.Score.future(spalm, timeout=60)
            assert gated.entered.wait(10)  # the SPALM Score waits on the retrieval service now
            t0 = time.monotonic()
            remote.Score(score_request([ids(40)], lm_pb2.MEMORY_MODE_NONE, knn=None), timeout=30)
            assert time.monotonic() - t0 < FAST_S and not future.done()
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                remote.Score(spalm, timeout=0.5)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 0.5 + FAST_S
            gated.release.set()
            assert future.result(timeout=30) == stub.Score(spalm, timeout=30)  # the index in process
    finally:
        gated.release.set()
        link.close()


def test_memlm_client_asks_for_spalm(address, stub):
    # `memlm client score --memory spalm --k 4 --segment 16 --mem-len 16 --sink-tokens 2 ...`
    from memlm.cli.commands import build_parser, knn_request, memory_request
    from services.lm.client import LanguageModelClient

    argv = ["client", "score", "--address", address, "--memory", "spalm", "--k", "4", "--segment", "16",
            "--mem-len", "16", "--sink-tokens", "2", "text"]
    args = build_parser().parse_args(argv)
    request = memory_request(args)
    assert knn_request(args) is None and request["memory_mode"] == "spalm"
    assert request["memory"].to_proto() == OPTIONS and request["spalm"].to_proto() == lm_pb2.KnnOptions(k=K)
    seqs = [ids(50, salt=9)]
    with LanguageModelClient(address, timeout=60) as client:
        (result,) = client.score(seqs, **request)
    expected = stub.Score(score_request(seqs), timeout=60)
    assert [t.logprob for t in result.tokens] == [t.logprob for t in expected.results[0].tokens]
    assert [t.gate for t in result.tokens] == [t.gate for t in expected.results[0].tokens]
    for extra, message in ((["--lambda", "0.5"], "--lambda is kNN-LM's interpolation"),
                           (["--knn"], "--knn does not combine with --memory spalm")):
        with pytest.raises(MemlmError, match=message):
            knn_request(build_parser().parse_args(argv[:-1] + extra + ["text"]))


def test_serve_lm_with_a_spalm_checkpoint_serves_its_head_over_the_datastore(tmp_path):
    # A real `memlm train --memory spalm` checkpoint and a real `memlm serve lm --model DIR --datastore DIR`
    # process: SPALM is served with the checkpoint's memory sizes as defaults, the datastore passes the check
    # against the head's keys' model (the checkpoint's own fingerprint differs: W trained), and a Score
    # equals the library's over the same weights, head and datastore.
    import json
    import os
    import subprocess
    import sys

    from datastore import Datastore
    from memlm.cli import main
    from memlm.memory.spalm import load_spalm_head
    from memlm.model.checkpoint import load_checkpoint, read_settings

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    corpus, store, out = tmp_path / "corpus.jsonl", tmp_path / "store", tmp_path / "ckpt"
    rows = [{"text": f"Speech number {i}: the state of the union is strong and growing.", "year": 1990 + i}
            for i in range(12)]
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["datastore", "build", "--model", "tiny", "--data", str(corpus), "--split", "year<2000", "--out",
                 str(store), "--context", "64", "--stride", "32", "--index", "Flat", "--quiet"]) == 0
    assert main(["train", "--model", "tiny", "--init", "pretrained", "--memory", "spalm", "--datastore", str(store),
                 "--data", str(corpus), "--split", "year<2000", "--steps", "2", "--warmup-steps", "0", "--lr", "0.05",
                 "--segment", "32", "--mem-len", "32", "--batch-size", "2", "--k", "4", "--out", str(out)]) == 0
    proc = subprocess.Popen([sys.executable, "-m", "memlm", "serve", "lm", "--model", str(out), "--datastore",
                             str(store), "--port", "0"], cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(60)
        assert lines and lines[0].startswith("listening on "), (lines, proc.poll())
        with grpc.insecure_channel(lines[0].split()[-1]) as channel:
            stub = lm_grpc.LanguageModelServiceStub(channel)
            info = stub.GetInfo(lm_pb2.LanguageModelServiceGetInfoRequest(), timeout=10)
            seqs = [ids(100, salt=10)]
            got = stub.Score(lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=seqs[0]))],
                                                 memory_mode=lm_pb2.MEMORY_MODE_SPALM), timeout=60)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert lm_pb2.MEMORY_MODE_SPALM in info.memory_modes and info.default_memory.segment_tokens == 32
    pre, (head, keys) = load_checkpoint(out), load_spalm_head(out)
    assert keys != pre.fingerprint == info.model_fingerprint and info.datastore.model_fingerprint == keys
    memory = read_settings(out).memory
    expected = score_spalm(pre.model, head, seqs, memory=memory, searcher=Datastore.open(store), k=SPALM_DEFAULT_K,
                           boundary_token=document_boundary(pre.tokenizer), batch_size=LMLimits().step_rows(32))
    np.testing.assert_array_equal(logprobs(got)[0], expected.scores[0].logprob)
