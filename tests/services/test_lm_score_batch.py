"""services.lm.score_batch, now for the Score calls the engine does not run (score_path BATCHED: attribution, a
model the engine does not hold): calls of one key that wait for the model's turn share one library call, each
gets its own sequences' scores back, a call that gives up while waiting leaves the batch, and calls of other
keys run apart. The library call is a recording stand-in; the turns are the server's real ModelScheduler."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from memlm.jobs.windows import WorkStopped
from services.lm.args import ScoreArgs
from services.lm.results import ScoreOutcome
from services.lm.scheduler import CallStop, ModelScheduler
from services.lm.score_batch import ScoreBatcher

ARGS = ScoreArgs(token_seqs=[[1]], contexts=[[]], context=8, stride=4, knn=None, top_n=0, memory=None, spalm=None,
                 batch_size=1, attribution=2)


class Context:
    """What CallStop reads of a grpc context: no deadline."""

    def time_remaining(self):
        return None


def test_calls_of_one_key_share_a_library_call_and_each_gets_its_own_scores():
    async def main():
        scheduler = ModelScheduler(4)
        merged: list[list[list[int]]] = []

        def run(args, gate, stop):
            merged.append(args.token_seqs)
            return ScoreOutcome([f"score of {s}" for s in args.token_seqs], None, {7})

        batcher = ScoreBatcher(scheduler, run)
        held, release = threading.Event(), threading.Event()

        def hold():
            held.set()
            release.wait(10)

        closing = threading.Event()
        blocker = asyncio.ensure_future(scheduler.run(scheduler.gate(CallStop(Context(), closing), "other"), hold))
        await asyncio.to_thread(held.wait, 10)  # the model's turn is taken: the calls below queue up
        stops = [CallStop(Context(), closing) for _ in range(4)]
        calls = [dataclasses.replace(ARGS, token_seqs=[[i], [i, i]]) for i in range(3)]
        calls.append(dataclasses.replace(ARGS, token_seqs=[[9]], attribution=3))  # another key: its own call
        futures = [asyncio.ensure_future(batcher.score(a, s, f"client{i}")) for i, (a, s) in enumerate(zip(calls, stops))]
        quitter = asyncio.ensure_future(batcher.score(dataclasses.replace(ARGS, token_seqs=[[5]]), gone := CallStop(
            Context(), closing), "quitter"))
        await asyncio.sleep(0.05)
        gone.set()  # gives up while its batch waits for the turn
        release.set()
        await blocker
        results = await asyncio.gather(*futures)
        with pytest.raises(WorkStopped):
            await quitter
        scheduler.close()
        return merged, results, batcher.batches

    merged, results, batches = asyncio.run(main())
    assert batches == 2  # the three calls of one key in one library call, the other key in its own
    assert [[0], [0, 0], [1], [1, 1], [2], [2, 2]] in merged and [[9]] in merged
    for i, out in enumerate(results[:3]):
        assert out.scores == [f"score of {[i]}", f"score of {[i, i]}"] and out.generations == {7}
    assert results[3].scores == ["score of [9]"]
