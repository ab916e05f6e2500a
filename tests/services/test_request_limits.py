"""Request limits checked before any work, against real servers on port 0 (conftest's `servers`, the tiny
model): token-id arrays are refused by their length before any element is read, then by the first id out
of range; stop sequences by number and by total characters; knn.nprobe and a retrieval Search's nprobe past
MAX_NPROBE; byte sizes on the command line (512M, 4G) through the one parser.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from memlm.cli.commands import build_parser
from memlm.v1 import language_model_pb2 as lm_pb2
from memlm.v1 import language_model_pb2_grpc as lm_grpc
from memlm.v1 import retrieval_pb2, retrieval_pb2_grpc
from services.common.sizes import format_bytes, parse_bytes
from services.common.tensors import to_tensor
from services.lm.requests import LMLimits
from services.retrieval.memory_sessions import memory_options_from_args
from services.retrieval.server import MAX_NPROBE, create_retrieval_server

RANGE, INVALID = grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.INVALID_ARGUMENT
MAX_TOKENS = 400
"""conftest's LIMITS.max_score_tokens: with the boundary token, 399 ids at most."""


def refusal(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        result = call(request, timeout=30)
        list(result) if not isinstance(result, lm_pb2.ScoreResponse) else None
    return e.value.code(), e.value.details()


@pytest.fixture(scope="module")
def stub(servers):
    with grpc.insecure_channel(servers["local"]) as channel:
        yield lm_grpc.LanguageModelServiceStub(channel)


def generate(ids: list[int], **kw) -> lm_pb2.GenerateRequest:
    return lm_pb2.GenerateRequest(prompt_token_ids=lm_pb2.TokenIds(ids=ids), max_new_tokens=2, **kw)


def score(ids: list[int]) -> lm_pb2.ScoreRequest:
    return lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=ids))])


def test_token_ids_are_length_checked_before_their_elements(stub):
    info = stub.GetInfo(lm_pb2.LanguageModelServiceGetInfoRequest(), timeout=10)
    vocab = info.vocab_size
    for call, make, field in ((stub.Generate, generate, "prompt_token_ids.ids"),
                              (stub.Score, score, "inputs[0].token_ids.ids")):
        # Too many ids, every one out of range: the length is what is refused.
        code, details = refusal(call, make([-1] * MAX_TOKENS))
        assert (code, details) == (RANGE, f"{field}: {MAX_TOKENS} token ids, at most {MAX_TOKENS - 1}")
        # Within the length: the first id out of range is named, whichever others are.
        ids = np.ones(MAX_TOKENS - 1, dtype=np.int64)
        ids[[37, 200, 398]] = [vocab, -5, vocab + 9]
        code, details = refusal(call, make(ids.tolist()))
        assert (code, details) == (INVALID, f"{field}[37]: token id {vocab} outside [0, {vocab})")
    ok = stub.Score(score([1] * (MAX_TOKENS - 1)), timeout=60)  # the longest accepted
    assert len(ok.results[0].tokens) == MAX_TOKENS - 1


def test_stop_sequences_are_bounded_in_number_and_characters(stub):
    limits = LMLimits()
    info = stub.GetInfo(lm_pb2.LanguageModelServiceGetInfoRequest(), timeout=10)
    assert (info.max_stop_sequences, info.max_stop_chars) == (limits.max_stop_sequences, limits.max_stop_chars)
    code, details = refusal(stub.Generate, generate([1, 2], stop_sequences=["z"] * (limits.max_stop_sequences + 1)))
    assert code == RANGE and details.startswith("stop_sequences: 17, at most 16")
    half = limits.max_stop_chars // 2
    code, details = refusal(stub.Generate, generate([1, 2], stop_sequences=["q" * half, "r" * (half + 1)]))
    assert (code, details) == (RANGE, f"stop_sequences: {2 * half + 1} characters together, at most "
                                      f"{limits.max_stop_chars}")
    answered = list(stub.Generate(generate([1, 2], stop_sequences=["q" * half, "r" * half]), timeout=60))
    assert answered[-1].HasField("finish")  # exactly at the limit: served


def test_nprobe_past_its_limit_is_refused_by_the_lm_and_the_retrieval_server(stub, index, module_loop):
    info = stub.GetInfo(lm_pb2.LanguageModelServiceGetInfoRequest(), timeout=10)
    assert info.max_nprobe == MAX_NPROBE
    too_many = lm_pb2.KnnOptions(enabled=True, nprobe=MAX_NPROBE + 1)
    for call, request in ((stub.Score, lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(text="hi")], knn=too_many)),
                          (stub.Generate, lm_pb2.GenerateRequest(prompt_text="hi", max_new_tokens=2, knn=too_many))):
        assert refusal(call, request) == (RANGE, f"knn.nprobe: {MAX_NPROBE + 1}, at most {MAX_NPROBE}")
    at_limit = lm_pb2.KnnOptions(enabled=True, nprobe=MAX_NPROBE)
    assert stub.Score(lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(text="hi")], knn=at_limit), timeout=60).results
    port = module_loop.start(create_retrieval_server, "127.0.0.1:0", index)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        search = retrieval_pb2_grpc.RetrievalServiceStub(channel).Search
        xq = to_tensor(np.zeros((1, index.dim), dtype=np.float32))
        assert refusal(search, retrieval_pb2.SearchRequest(queries=xq, k=4, nprobe=MAX_NPROBE + 1)) == (
            RANGE, f"nprobe: {MAX_NPROBE + 1}, at most {MAX_NPROBE}")
        assert search(retrieval_pb2.SearchRequest(queries=xq, k=4, nprobe=MAX_NPROBE), timeout=30).ids


@pytest.mark.parametrize("text, size", [("65536", 65536), ("512M", 512 << 20), ("4G", 4 << 30), ("1.5g", 3 << 29),
                                        ("2KiB", 2048), ("3 MB", 3 << 20), ("1T", 1 << 40)])
def test_byte_sizes_parse_and_print_back(text, size):
    assert parse_bytes(text) == size
    assert parse_bytes(format_bytes(size)) == size


@pytest.mark.parametrize("text", ["", "G", "-1M", "1.5.5G", "4P", "0", "0.1"])
def test_a_bad_byte_size_is_refused(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_byte_flags_of_serve_retrieval_and_serve_lm():
    parser = build_parser()
    args = parser.parse_args(["serve", "retrieval", "--memories", "--max-memory-session-bytes", "512M",
                              "--max-memory-total-bytes", "4G"])
    options = memory_options_from_args(args)
    assert (options.max_session_bytes, options.max_total_bytes) == (512 << 20, 4 << 30)
    args = parser.parse_args(["serve", "lm", "--model", "tiny", "--max-kv-bytes", "256M"])
    assert args.max_kv_bytes == 256 << 20
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "lm", "--model", "tiny", "--max-kv-bytes", "lots"])
