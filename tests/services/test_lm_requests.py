"""LanguageModelService request validation over the wire: every malformed Score or Generate request gets
INVALID_ARGUMENT / OUT_OF_RANGE (FAILED_PRECONDITION, UNIMPLEMENTED where they apply) with a message that
starts with the field's name, never UNKNOWN or INTERNAL, and the server keeps serving. The checks live in
services/lm/requests.py; the servers come from conftest.py (`servers`).
"""

from __future__ import annotations

import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memlm.v1 import language_model_pb2 as lm_pb2
from memlm.v1 import language_model_pb2_grpc as lm_grpc
from services.lm.client import Finish, KnnRequest, LanguageModelClient
from services.common.server import ServiceError


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


def score_request(**kw) -> lm_pb2.ScoreRequest:
    return lm_pb2.ScoreRequest(**kw)


def one(text="hi") -> list[lm_pb2.ScoreInput]:
    return [lm_pb2.ScoreInput(text=text)]


BAD_SCORES = [
    (score_request(), grpc.StatusCode.INVALID_ARGUMENT, "inputs"),
    (score_request(inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=[1, 400]))]),
     grpc.StatusCode.INVALID_ARGUMENT, "inputs[0].token_ids.ids[1]"),
    (score_request(inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=[-1]))]),
     grpc.StatusCode.INVALID_ARGUMENT, "inputs[0].token_ids.ids[0]"),
    (score_request(inputs=[lm_pb2.ScoreInput(context_text="x")]), grpc.StatusCode.INVALID_ARGUMENT,
     "inputs[0].continuation"),
    (score_request(inputs=one("x" * 500)), grpc.StatusCode.OUT_OF_RANGE, "inputs[0]"),
    (score_request(inputs=one() * 65), grpc.StatusCode.OUT_OF_RANGE, "inputs"),
    (score_request(inputs=one(), top_n=21), grpc.StatusCode.INVALID_ARGUMENT, "top_n"),
    (score_request(inputs=one(), window_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "window_tokens"),
    (score_request(inputs=one(), window_tokens=8, stride_tokens=9), grpc.StatusCode.INVALID_ARGUMENT, "stride_tokens"),
    (score_request(inputs=one(), knn=lm_pb2.KnnOptions(enabled=True)), grpc.StatusCode.FAILED_PRECONDITION,
     "knn.enabled"),
    (score_request(inputs=one(), memory_mode=lm_pb2.MEMORY_MODE_MEMORIZING), grpc.StatusCode.UNIMPLEMENTED,
     "memory_mode"),
    (score_request(inputs=one(), memory_mode=lm_pb2.MEMORY_MODE_SPALM), grpc.StatusCode.UNIMPLEMENTED, "memory_mode"),
    (score_request(inputs=one(), memory_mode=99), grpc.StatusCode.INVALID_ARGUMENT, "memory_mode"),
    (score_request(inputs=one(), memory_mode=lm_pb2.MEMORY_MODE_XL, memory=lm_pb2.MemoryOptions(segment_tokens=0)),
     grpc.StatusCode.INVALID_ARGUMENT, "memory.segment_tokens"),
    (score_request(inputs=one(), memory_mode=lm_pb2.MEMORY_MODE_XL, memory=lm_pb2.MemoryOptions(segment_tokens=1025)),
     grpc.StatusCode.INVALID_ARGUMENT, "memory.segment_tokens"),
    (score_request(inputs=one(), memory_mode=lm_pb2.MEMORY_MODE_XL, memory=lm_pb2.MemoryOptions(memory_tokens=-1)),
     grpc.StatusCode.INVALID_ARGUMENT, "memory.memory_tokens"),
    (score_request(inputs=one(), memory_mode=lm_pb2.MEMORY_MODE_XL, memory=lm_pb2.MemoryOptions(sink_tokens=70000)),
     grpc.StatusCode.OUT_OF_RANGE, "memory.sink_tokens"),
]


def generate_request(**kw) -> lm_pb2.GenerateRequest:
    if "prompt_token_ids" not in kw:
        kw.setdefault("prompt_text", "hi")
    kw.setdefault("max_new_tokens", 2)
    return lm_pb2.GenerateRequest(**kw)


BAD_GENERATES = [
    (lm_pb2.GenerateRequest(max_new_tokens=2), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (generate_request(max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
    (generate_request(max_new_tokens=100_001), grpc.StatusCode.OUT_OF_RANGE, "max_new_tokens"),
    (generate_request(sampling=lm_pb2.SamplingOptions(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.temperature"),
    (generate_request(sampling=lm_pb2.SamplingOptions(temperature=float("nan"))), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.temperature"),
    (generate_request(sampling=lm_pb2.SamplingOptions(top_p=0)), grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
    (generate_request(sampling=lm_pb2.SamplingOptions(top_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
    (generate_request(sampling=lm_pb2.SamplingOptions(top_k=0)), grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_k"),
    (generate_request(stop_sequences=["a", ""]), grpc.StatusCode.INVALID_ARGUMENT, "stop_sequences[1]"),
    (generate_request(prompt_token_ids=lm_pb2.TokenIds(ids=[999])), grpc.StatusCode.INVALID_ARGUMENT,
     "prompt_token_ids.ids[0]"),
    (generate_request(prompt_text="y" * 500), grpc.StatusCode.OUT_OF_RANGE, "prompt"),
    (generate_request(knn=lm_pb2.KnnOptions(enabled=True)), grpc.StatusCode.FAILED_PRECONDITION, "knn.enabled"),
    (generate_request(memory_mode=lm_pb2.MEMORY_MODE_MEMORIZING), grpc.StatusCode.UNIMPLEMENTED, "memory_mode"),
    (generate_request(memory_mode=lm_pb2.MEMORY_MODE_XL, memory=lm_pb2.MemoryOptions(segment_tokens=0)),
     grpc.StatusCode.INVALID_ARGUMENT, "memory.segment_tokens"),
]


def test_malformed_requests_get_field_named_statuses(servers):
    address = servers["plain"]
    with grpc.insecure_channel(address) as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        for request, code, field in BAD_SCORES:
            with pytest.raises(grpc.RpcError) as e:
                stub.Score(request, timeout=30)
            assert (e.value.code(), e.value.details().split(":")[0]) == (code, field), request
        for request, code, field in BAD_GENERATES:
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request, timeout=30))
            assert (e.value.code(), e.value.details().split(":")[0]) == (code, field), request
        with pytest.raises(grpc.RpcError) as e:
            stub.Tokenize(lm_pb2.TokenizeRequest(), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with LanguageModelClient(servers["local"], timeout=60) as c:  # kNN options out of their domain
        for knn, field in ((KnnRequest(lmbda=1.5), "knn.lambda_weight"), (KnnRequest(temperature=0.0), "knn.temperature"),
                           (KnnRequest(k=0), "knn.k"), (KnnRequest(nprobe=0), "knn.nprobe")):
            with pytest.raises(ServiceError) as e:
                c.score(["hi"], knn=knn)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.details.startswith(field)
    assert health(address) == health_pb2.HealthCheckResponse.SERVING
    with LanguageModelClient(address, timeout=60) as c:
        assert len(c.score(["fine"])[0].tokens) == 4


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=64))
def test_fuzzed_request_bytes_never_break_the_server(servers, data):
    with grpc.insecure_channel(servers["plain"]) as channel:
        for method in ("Score", "Tokenize"):
            call = channel.unary_unary(f"/memlm.v1.LanguageModelService/{method}")
            try:
                call(data, timeout=30)
            except grpc.RpcError as e:
                assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                                    grpc.StatusCode.UNIMPLEMENTED), (e.code(), e.details())
        # Generate streams: a request that happens to be valid may generate for long, so read one message.
        stream = channel.unary_stream("/memlm.v1.LanguageModelService/Generate")(data, timeout=30)
        try:
            next(stream, None)
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                                grpc.StatusCode.UNIMPLEMENTED), (e.code(), e.details())
        finally:
            stream.cancel()


# Generate fuzzed like Score: each generated request is wrong in exactly one way, so the expected status
# and the field its message must name are known (LIMITS: prompts < 400 tokens, max_new_tokens <= 100_000).

INVALID, RANGE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE
F32 = {"width": 32}  # the proto fields are float32


def _floats(**kw):
    return st.floats(**F32, **kw)


@st.composite
def malformed_generate(draw, vocab: int):
    """(GenerateRequest fields, expected code, field the message starts with)."""
    good = {"prompt_text": "hi", "max_new_tokens": draw(st.integers(1, 3))}
    kind = draw(st.sampled_from([
        "no_prompt", "prompt_id", "prompt_long", "max_new_low", "max_new_high", "temperature", "top_k", "top_p",
        "stops_many", "stop_empty", "mode_unknown", "mode_unserved", "segment", "memory_size", "knn_lambda",
        "knn_temperature", "knn_k", "knn_nprobe",
    ]))
    if kind == "no_prompt":
        return {"max_new_tokens": good["max_new_tokens"]}, INVALID, "prompt"
    if kind == "prompt_id":
        ids = draw(st.lists(st.integers(0, vocab - 1), max_size=5))
        j = draw(st.integers(0, len(ids)))
        bad = draw(st.one_of(st.integers(-(2**31), -1), st.integers(vocab, 2**31 - 1)))
        ids.insert(j, bad)
        fields = {"prompt_token_ids": lm_pb2.TokenIds(ids=ids), "max_new_tokens": good["max_new_tokens"]}
        return fields, INVALID, f"prompt_token_ids.ids[{j}]"
    if kind == "prompt_long":
        ids = [draw(st.integers(0, vocab - 1))] * draw(st.integers(400, 600))
        return {"prompt_token_ids": lm_pb2.TokenIds(ids=ids), "max_new_tokens": 1}, RANGE, "prompt_token_ids.ids"
    if kind == "max_new_low":
        return dict(good, max_new_tokens=draw(st.integers(-(2**31), 0))), INVALID, "max_new_tokens"
    if kind == "max_new_high":
        return dict(good, max_new_tokens=draw(st.integers(100_001, 2**31 - 1))), RANGE, "max_new_tokens"
    if kind == "temperature":
        t = draw(st.one_of(_floats(max_value=-0.5), st.sampled_from([math.nan, math.inf, -math.inf])))
        return dict(good, sampling=lm_pb2.SamplingOptions(temperature=t)), INVALID, "sampling.temperature"
    if kind == "top_k":
        return dict(good, sampling=lm_pb2.SamplingOptions(top_k=draw(st.integers(-(2**31), 0)))), INVALID, "sampling.top_k"
    if kind == "top_p":
        p = draw(st.one_of(_floats(max_value=0.0), _floats(min_value=1.5), st.just(math.nan)))
        return dict(good, sampling=lm_pb2.SamplingOptions(top_p=p)), INVALID, "sampling.top_p"
    if kind == "stops_many":
        stops = draw(st.lists(st.text(min_size=1, max_size=3), min_size=17, max_size=30))
        return dict(good, stop_sequences=stops), RANGE, "stop_sequences"
    if kind == "stop_empty":
        stops = draw(st.lists(st.text(min_size=1, max_size=3), max_size=5))
        j = draw(st.integers(0, len(stops)))
        stops.insert(j, "")
        return dict(good, stop_sequences=stops), INVALID, f"stop_sequences[{j}]"
    if kind == "mode_unknown":
        mode = draw(st.integers(-(2**31), 2**31 - 1).filter(lambda m: m not in lm_pb2.MemoryMode.values()))
        return dict(good, memory_mode=mode), INVALID, "memory_mode"
    if kind == "mode_unserved":
        mode = draw(st.sampled_from([lm_pb2.MEMORY_MODE_MEMORIZING, lm_pb2.MEMORY_MODE_SPALM]))
        return dict(good, memory_mode=mode), grpc.StatusCode.UNIMPLEMENTED, "memory_mode"
    xl = dict(good, memory_mode=lm_pb2.MEMORY_MODE_XL)
    if kind == "segment":
        segment = draw(st.one_of(st.integers(-(2**31), 0), st.integers(1025, 2**31 - 1)))  # tiny context: 1024
        return dict(xl, memory=lm_pb2.MemoryOptions(segment_tokens=segment)), INVALID, "memory.segment_tokens"
    if kind == "memory_size":
        name = draw(st.sampled_from(["memory_tokens", "sink_tokens"]))
        if draw(st.booleans()):
            return dict(xl, memory=lm_pb2.MemoryOptions(**{name: draw(st.integers(-(2**31), -1))})), INVALID, f"memory.{name}"
        return dict(xl, memory=lm_pb2.MemoryOptions(**{name: draw(st.integers(65537, 2**31 - 1))})), RANGE, f"memory.{name}"
    if kind == "knn_lambda":
        lam = draw(st.one_of(_floats(max_value=-0.5), _floats(min_value=1.5), st.just(math.nan)))
        return dict(good, knn=lm_pb2.KnnOptions(enabled=True, lambda_weight=lam)), INVALID, "knn.lambda_weight"
    if kind == "knn_temperature":
        t = draw(st.one_of(_floats(max_value=0.0), st.sampled_from([math.nan, math.inf])))
        return dict(good, knn=lm_pb2.KnnOptions(enabled=True, temperature=t)), INVALID, "knn.temperature"
    if kind == "knn_k":
        if draw(st.booleans()):
            return dict(good, knn=lm_pb2.KnnOptions(enabled=True, k=draw(st.integers(-(2**31), 0)))), INVALID, "knn.k"
        return dict(good, knn=lm_pb2.KnnOptions(enabled=True, k=draw(st.integers(4097, 2**31 - 1)))), RANGE, "knn.k"
    nprobe = draw(st.integers(-(2**31), 0))
    return dict(good, knn=lm_pb2.KnnOptions(enabled=True, nprobe=nprobe)), INVALID, "knn.nprobe"


def test_fuzzed_malformed_generate_requests_get_field_named_statuses(tiny, servers):
    address = servers["local"]  # has a datastore, so kNN options are checked too
    vocab = min(tiny.model.config.vocab_size, tiny.tokenizer.vocab_size)
    with grpc.insecure_channel(address) as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)

        @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(malformed_generate(vocab))
        def check(case):
            fields, code, field = case
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(lm_pb2.GenerateRequest(**fields), timeout=30))
            assert e.value.code() == code, (fields, e.value.details())
            assert e.value.details().startswith(field + ":"), (fields, e.value.details())

        check()
    assert health(address) == health_pb2.HealthCheckResponse.SERVING
    with LanguageModelClient(address, timeout=60) as c:  # still generating after all that
        assert isinstance(list(c.generate("hi", max_new_tokens=2, temperature=0.0))[-1], Finish)
