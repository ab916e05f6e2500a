"""Score calls from different clients share forward passes (services.lm_score_batch, issue 12).

Real servers on port 0 over the tiny model. Oracle: each call alone on the same server. Concurrent calls of
one key are scored by one library call (ScoreBatcher.batches counts them); each comes back with the same
tokens, greedy flags and alternatives as alone, its log-probs within float32 rounding (SHARED_ATOL).
"""

from __future__ import annotations

import dataclasses
import threading

import grpc
import numpy as np

from memlm.v1 import language_model_pb2 as lm_pb2
from memlm.v1 import language_model_pb2_grpc as lm_grpc
from services.lm_requests import LMLimits
from services.lm_server import start_lm_server

SHARED_ATOL = 1e-6
"""Largest |log-prob difference| allowed between a Score in a shared batch and alone: float32 rounding of a
forward pass over more rows (measured on the tiny model: 0 for 9 of these 12 calls, 4.8e-7 = 2^-21 for the
others, sliding windows and XL segment rows alike)."""


def ids(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + salt) % 250 + 1 for i in range(n)]  # ids the tiny tokenizer knows


def start(module_loop, tiny, **limits):
    started = module_loop.run(start_lm_server("127.0.0.1:0", tiny, limits=dataclasses.replace(
        LMLimits(max_score_tokens=4001, max_forward_tokens=1 << 22), **limits)))
    module_loop.servers.append(started.running.server)
    return f"127.0.0.1:{started.running.port}", started.servicer


def concurrently(stub, requests) -> list[lm_pb2.ScoreResponse]:
    out = [None] * len(requests)
    go = threading.Barrier(len(requests))

    def one(i):
        go.wait(10)
        out[i] = stub.Score(requests[i], timeout=120)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def logprobs(response) -> np.ndarray:
    return np.array([t.logprob for r in response.results for t in r.tokens], dtype=np.float64)


def test_concurrent_scores_share_library_calls_and_equal_each_alone(tiny, module_loop):
    address, servicer = start(module_loop, tiny, max_step_tokens=256)
    windows = [lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=ids(n, salt=n)))],
                                   window_tokens=64, stride_tokens=16, top_n=2) for n in (300, 500, 77, 410, 120, 90)]
    xl = [lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=ids(n, salt=n)))],
                              memory_mode=lm_pb2.MEMORY_MODE_XL,
                              memory=lm_pb2.MemoryOptions(segment_tokens=32, memory_tokens=64, sink_tokens=4))
          for n in (300, 123, 77, 410, 5, 260)]
    blocker = lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=ids(4000)))],
                                  window_tokens=256, stride_tokens=8)
    with grpc.insecure_channel(address) as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        for group in (windows, xl):
            alone = [stub.Score(r, timeout=60) for r in group]
            before = servicer.score_batches.batches
            busy = stub.Score.future(blocker, timeout=120)  # the model is busy: the group queues up meanwhile
            together = concurrently(stub, group)
            busy.cancel()
            assert servicer.score_batches.batches - before < len(group)  # some calls shared a library call
            for t, a in zip(together, alone):
                assert [[(x.token_id, x.is_greedy, [y.token_id for y in x.alternatives]) for x in r.tokens]
                        for r in t.results] == [[(x.token_id, x.is_greedy, [y.token_id for y in x.alternatives])
                                                 for x in r.tokens] for r in a.results]
                assert np.abs(logprobs(t) - logprobs(a)).max() <= SHARED_ATOL


def test_a_member_that_gives_up_leaves_the_batch_and_the_others_are_served(tiny, module_loop):
    address, servicer = start(module_loop, tiny, max_step_tokens=256)
    requests = [lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=ids(n, salt=n)))],
                                    window_tokens=64, stride_tokens=16) for n in (200, 300, 250)]
    blocker = lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=ids(4000)))],
                                  window_tokens=256, stride_tokens=8)
    with grpc.insecure_channel(address) as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        alone = [stub.Score(r, timeout=60) for r in requests]
        busy = stub.Score.future(blocker, timeout=120)
        futures = [stub.Score.future(r, timeout=60) for r in requests]  # one batch, queued behind the blocker
        futures[1].cancel()
        busy.cancel()
        for i in (0, 2):
            got = futures[i].result(timeout=60)
            assert [t.token_id for r in got.results for t in r.tokens] == [t.token_id for r in alone[i].results
                                                                           for t in r.tokens]
            assert np.abs(logprobs(got) - logprobs(alone[i])).max() <= SHARED_ATOL
        assert futures[1].cancelled()
        assert servicer.scheduler.turns.waiting() == 0
