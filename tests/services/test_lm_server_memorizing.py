"""MEMORY_MODE_MEMORIZING on the LM server: Score and Generate equal the library's memorizing
scoring and generation (memlm.jobs.scoring.score_tokens_segments, reference_decoding.reference_generate with a
memorizing MemoryConfig and the same KnnAttention), bit for bit; the request's knn sizes are bounded;
a server without a KnnAttention answers UNIMPLEMENTED.

Real servers on port 0 over the tiny model (2 layers: the memorizing layer is 1) with a KnnAttention
whose gates are open (logit 0: g = 0.5), so the retrieved pairs change the scores (checked against XL).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from memlm.errors import MemlmError
from reference_decoding import reference_generate
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.jobs.scoring import score_tokens_segments
from memlm.model.memory_config import MemoryConfig
from memlm.memory.memorizing import new_knn_attention
from memlm.model.tokenizer import document_boundary
from memlm.v1 import language_model_pb2 as lm_pb2
from memlm.v1 import language_model_pb2_grpc as lm_grpc
from services.lm.requests import LMLimits
from services.lm.server import start_lm_server

MEMORY = MemoryConfig("memorizing", mem_len=16, sink_tokens=2, segment=16, knn_layer=1, knn_mem_size=48, knn_top_k=4)
"""What the requests below ask for (knn_mem_size 48 < the inputs' length: FIFO eviction happens)."""
OPTIONS = lm_pb2.MemoryOptions(segment_tokens=16, memory_tokens=16, sink_tokens=2, knn_mem_size=48, knn_top_k=4)
LIMITS = LMLimits(knn_layer=1, max_knn_top_k=8)


def ids(n: int, salt: int = 0) -> list[int]:
    return [(5 * i + salt) % 200 + 3 for i in range(n)]


@pytest.fixture(scope="module")
def knn_attention(tiny):
    module = new_knn_attention(tiny.model.config)
    with torch.no_grad():
        module.gate_logit.zero_()  # g = 0.5 in every head
    return module


@pytest.fixture(scope="module")
def address(tiny, knn_attention, module_loop) -> str:
    started = module_loop.run(start_lm_server("127.0.0.1:0", tiny, limits=LIMITS, knn_attention=knn_attention))
    module_loop.servers.append(started.running.server)
    return f"127.0.0.1:{started.running.port}"


@pytest.fixture(scope="module")
def stub(address):
    with grpc.insecure_channel(address) as channel:
        yield lm_grpc.LanguageModelServiceStub(channel)


def score(stub, seqs, mode=lm_pb2.MEMORY_MODE_MEMORIZING, options=OPTIONS) -> list[np.ndarray]:
    response = stub.Score(lm_pb2.ScoreRequest(
        inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=s)) for s in seqs], memory_mode=mode,
        memory=options), timeout=60)
    return [np.array([t.logprob for t in r.tokens], dtype=np.float32) for r in response.results]


def test_get_info_reports_memorizing(stub):
    info = stub.GetInfo(lm_pb2.LanguageModelServiceGetInfoRequest(), timeout=10)
    assert lm_pb2.MEMORY_MODE_MEMORIZING in info.memory_modes and info.knn_layer == 1
    assert (info.default_memory.knn_mem_size, info.default_memory.knn_top_k) == (LIMITS.knn_mem_size, LIMITS.knn_top_k)
    assert (info.max_knn_mem_size, info.max_knn_top_k) == (LIMITS.max_knn_mem_size, 8)


def test_score_equals_the_library_and_differs_from_xl(tiny, knn_attention, stub):
    seqs = [ids(120, salt=1), ids(70, salt=2), ids(9, salt=3)]
    got = score(stub, seqs)
    rows = LIMITS.step_rows(MEMORY.segment)
    library = score_tokens_segments(tiny.model, seqs, memory=MEMORY, boundary_token=document_boundary(tiny.tokenizer),
                                    batch_size=rows, knn_attention=knn_attention)
    for g, s in zip(got, library):
        np.testing.assert_array_equal(g, s.logprob)
    xl = score(stub, seqs, lm_pb2.MEMORY_MODE_XL)
    assert not np.array_equal(got[0], xl[0])  # the retrieved pairs count
    # The segment before the first retrieval has no past to retrieve: equal to XL there.
    # (XL Score runs on the engine, services.lm.score_engine: float32 rounding of its cache layout only.)
    np.testing.assert_allclose(got[0][:MEMORY.segment - 1], xl[0][:MEMORY.segment - 1], rtol=0, atol=2e-6)


def test_generate_equals_the_library(tiny, knn_attention, stub):
    prompt = ids(60, salt=4)
    request = lm_pb2.GenerateRequest(prompt_token_ids=lm_pb2.TokenIds(ids=prompt), max_new_tokens=12,
                                     sampling=lm_pb2.SamplingOptions(temperature=0.0),
                                     memory_mode=lm_pb2.MEMORY_MODE_MEMORIZING, memory=OPTIONS)
    served = [t.token_id for r in stub.Generate(request, timeout=60) if r.HasField("delta") for t in r.delta.tokens]
    events = reference_generate(tiny.model, tiny.tokenizer, prompt, max_new_tokens=12, sampling=SamplingConfig(temperature=0.0),
                                boundary_token=document_boundary(tiny.tokenizer), eos_id=tiny.tokenizer.eos_id, memory=MEMORY,
                                knn_attention=knn_attention)
    assert served == [e.token_id for e in events if isinstance(e, TokenEvent)] and served


@pytest.mark.parametrize("options, code, start", [
    (lm_pb2.MemoryOptions(knn_top_k=9), grpc.StatusCode.OUT_OF_RANGE, "memory.knn_top_k: 9, at most 8"),
    (lm_pb2.MemoryOptions(knn_mem_size=0), grpc.StatusCode.INVALID_ARGUMENT, "memory.knn_mem_size: 0, must be >= 1"),
    (lm_pb2.MemoryOptions(knn_mem_size=LIMITS.max_knn_mem_size + 1), grpc.StatusCode.OUT_OF_RANGE,
     "memory.knn_mem_size:"),
])
def test_knn_sizes_are_bounded(stub, options, code, start):
    with pytest.raises(grpc.RpcError) as e:
        score(stub, [ids(20)], options=options)
    assert e.value.code() == code and e.value.details().startswith(start), e.value.details()


def test_a_server_without_knn_attention_answers_unimplemented(servers):
    with grpc.insecure_channel(servers["plain"]) as channel, pytest.raises(grpc.RpcError) as e:
        score(lm_grpc.LanguageModelServiceStub(channel), [ids(20)])
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert e.value.details().startswith("memory_mode:") and "memorizing checkpoint" in e.value.details()



def test_the_client_and_memlm_client_flags_ask_for_memorizing(address, stub):
    # `memlm client score --memory memorizing --knn-mem-size 48 --knn-top-k 4 ...` sends what OPTIONS says.
    from memlm.cli.commands import build_parser, memory_request
    from services.lm.client import LanguageModelClient

    args = build_parser().parse_args(["client", "score", "--address", address, "--memory", "memorizing",
                                      "--segment", "16", "--mem-len", "16", "--sink-tokens", "2",
                                      "--knn-mem-size", "48", "--knn-top-k", "4", "text"])
    request = memory_request(args)
    assert request["memory_mode"] == "memorizing" and request["memory"].to_proto() == OPTIONS
    seqs = [ids(90, salt=5)]
    with LanguageModelClient(address, timeout=60) as client:
        (result,) = client.score(seqs, **request)
    np.testing.assert_array_equal(np.array([t.logprob for t in result.tokens], dtype=np.float32), score(stub, seqs)[0])
    xl = build_parser().parse_args(["client", "score", "--address", address, "--memory", "xl", "--knn-top-k", "4", "t"])
    with pytest.raises(MemlmError, match="--knn-top-k needs --memory memorizing"):
        memory_request(xl)


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A real `memlm train --memory memorizing` checkpoint of the tiny model (2 steps from scratch)."""
    tmp = tmp_path_factory.mktemp("memorizing-ckpt")
    out, text = tmp / "ckpt", tmp / "doc.txt"
    text.write_text("The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 60)  # ~4K tokens
    train = ["train", "--model", "tiny", "--init", "scratch", "--data", str(text), "--max-train-tokens", "3000",
             "--memory", "memorizing", "--segment", "32", "--mem-len", "32", "--knn-mem-size", "96", "--knn-top-k", "4",
             "--knn-layer", "0", "--steps", "2", "--batch-size", "1", "--eval-every", "1000", "--device", "cpu",
             "--out", str(out)]
    done = subprocess.run([sys.executable, "-m", "memlm", *train], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return out


def serve_checkpoint_and_score(model: Path, seqs: list[list[int]], *extra: str):
    """Run `memlm serve lm --model DIR --port 0 EXTRA...` as a process, Score `seqs` with the checkpoint's
    memory defaults, stop it: (GetInfo, log-probs)."""
    proc = subprocess.Popen([sys.executable, "-m", "memlm", "serve", "lm", "--model", str(model), "--port", "0", *extra],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(60)
        assert lines and lines[0].startswith("listening on "), (lines, proc.poll())
        with grpc.insecure_channel(lines[0].split()[-1]) as channel:
            stub = lm_grpc.LanguageModelServiceStub(channel)
            info = stub.GetInfo(lm_pb2.LanguageModelServiceGetInfoRequest(), timeout=10)
            return info, score(stub, seqs, options=lm_pb2.MemoryOptions())  # the checkpoint's sizes
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def library_score(model: Path, seqs: list[list[int]]) -> list[np.ndarray]:
    """The checkpoint's memorizing scores in process (exact backend, the server's rows per step)."""
    from memlm.memory.memorizing import load_knn_attention
    from memlm.model.checkpoint import read_settings
    from memlm.model.weights import load_pretrained

    pre = load_pretrained(str(model))
    memory = read_settings(model).memory
    return [s.logprob for s in score_tokens_segments(
        pre.model, seqs, memory=memory, boundary_token=document_boundary(pre.tokenizer),
        batch_size=LMLimits().step_rows(memory.segment), knn_attention=load_knn_attention(model))]


def test_serve_lm_with_a_memorizing_checkpoint_serves_its_layer_and_sizes(checkpoint):
    # A real `memlm serve lm --model DIR` process: MEMORIZING is served at the checkpoint's layer with its
    # sizes as defaults, and a Score equals the library's over the same weights and KnnAttention.
    seqs = [ids(150, salt=6)]
    info, got = serve_checkpoint_and_score(checkpoint, seqs)
    assert lm_pb2.MEMORY_MODE_MEMORIZING in info.memory_modes and info.knn_layer == 0
    assert (info.default_memory.segment_tokens, info.default_memory.knn_mem_size, info.default_memory.knn_top_k) == (
        32, 96, 4)
    np.testing.assert_array_equal(got[0], library_score(checkpoint, seqs)[0])


def test_serve_lm_keeps_a_service_checkpoints_memory_in_the_retrieval_server(checkpoint, tmp_path, memory_service):
    # A checkpoint whose settings name the "service" backend: `serve lm` refuses to start without
    # --knn-service (one line), and with it serves the library's in-process scores from the remote memory.
    service_ckpt = tmp_path / "service-ckpt"
    shutil.copytree(checkpoint, service_ckpt)
    settings = json.loads((service_ckpt / "settings.json").read_text())
    settings["memory"]["knn_backend"] = "service"
    (service_ckpt / "settings.json").write_text(json.dumps(settings))
    done = subprocess.run([sys.executable, "-m", "memlm", "serve", "lm", "--model", str(service_ckpt), "--port", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1 and done.stderr.splitlines()[-1] == (
        "memlm: error: --knn-backend service needs --knn-service HOST:PORT (memlm serve retrieval with memory "
        "sessions)"), done.stderr
    seqs = [ids(150, salt=10)]
    _, got = serve_checkpoint_and_score(service_ckpt, seqs, "--knn-service", memory_service)
    np.testing.assert_array_equal(got[0], library_score(checkpoint, seqs)[0])


@pytest.fixture(scope="module")
def memory_service(module_loop):
    """A real retrieval server hosting memory sessions only (no datastore) on port 0: its address."""
    from services.retrieval.memory_sessions import MemoryOptions
    from services.retrieval.server import create_retrieval_server

    port = module_loop.start(create_retrieval_server, "127.0.0.1:0", None, memories=MemoryOptions())
    return f"127.0.0.1:{port}"


def start_service_lm(tiny, knn_attention, module_loop, memories: str) -> tuple[str, object]:
    """An LM server like `address`'s whose MEMORIZING memories live in the retrieval server `memories`."""
    from dataclasses import replace

    from services.retrieval.memory_client import remote_memory_factory

    client = remote_memory_factory(memories, timeout=30)
    started = module_loop.run(start_lm_server("127.0.0.1:0", tiny, limits=replace(LIMITS, knn_backend="service"),
                                              knn_attention=knn_attention, knn_service=client))
    module_loop.servers.append(started.running.server)
    return f"127.0.0.1:{started.running.port}", client


def test_score_and_generate_through_the_memory_service_equal_in_process(tiny, knn_attention, module_loop, stub,
                                                                        memory_service):
    # The memory of a MEMORIZING request held by a retrieval server's sessions gives the
    # in-process server's log-probs and tokens bit for bit (the session runs the same exact scan).
    address, client = start_service_lm(tiny, knn_attention, module_loop, memory_service)
    seqs = [ids(120, salt=7), ids(40, salt=8)]
    request = lm_pb2.GenerateRequest(prompt_token_ids=lm_pb2.TokenIds(ids=ids(60, salt=9)), max_new_tokens=8,
                                     sampling=lm_pb2.SamplingOptions(temperature=0.0),
                                     memory_mode=lm_pb2.MEMORY_MODE_MEMORIZING, memory=OPTIONS)
    try:
        with grpc.insecure_channel(address) as channel:
            remote = lm_grpc.LanguageModelServiceStub(channel)
            got = score(remote, seqs)
            served = [t.token_id for r in remote.Generate(request, timeout=60) if r.HasField("delta")
                      for t in r.delta.tokens]
    finally:
        client.close()
    for g, w in zip(got, score(stub, seqs)):
        np.testing.assert_array_equal(g, w)
    local = [t.token_id for r in stub.Generate(request, timeout=60) if r.HasField("delta") for t in r.delta.tokens]
    assert served == local and served


def test_the_memory_service_is_where_the_memory_lives(tiny, knn_attention, module_loop):
    # Its limits are the ones that refuse (RESOURCE_EXHAUSTED naming the limit, passed on by the LM server),
    # while XL requests, which need no memory, still answer.
    from services.retrieval.memory_sessions import MemoryOptions
    from services.retrieval.server import create_retrieval_server

    port = module_loop.start(create_retrieval_server, "127.0.0.1:0", None,
                             memories=MemoryOptions(max_session_bytes=47))  # < 1 stream x 48 entries of any size
    address, client = start_service_lm(tiny, knn_attention, module_loop, f"127.0.0.1:{port}")
    try:
        with grpc.insecure_channel(address) as channel:
            remote = lm_grpc.LanguageModelServiceStub(channel)
            with pytest.raises(grpc.RpcError) as e:
                score(remote, [ids(40)])
            assert score(remote, [ids(40)], lm_pb2.MEMORY_MODE_XL)[0].size == 40
    finally:
        client.close()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "47" in e.value.details(), e.value.details()


def test_a_service_backend_without_a_memory_service_is_refused(tiny, knn_attention, module_loop):
    from dataclasses import replace

    with pytest.raises(MemlmError, match=r"kNN backend 'service' needs a retrieval server with memory sessions"):
        module_loop.run(start_lm_server("127.0.0.1:0", tiny, limits=replace(LIMITS, knn_backend="service"),
                                        knn_attention=knn_attention))


def test_serve_lm_refuses_a_knn_service_its_memory_would_not_use(checkpoint):
    # The checkpoint's backend is "auto" (in process): --knn-service alone is refused in one line, not ignored.
    done = subprocess.run([sys.executable, "-m", "memlm", "serve", "lm", "--model", str(checkpoint), "--port", "0",
                           "--knn-service", "127.0.0.1:1"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 1 and done.stderr.splitlines()[-1] == (
        "memlm: error: --knn-service needs a memorizing checkpoint served with --knn-backend service"), done.stderr
