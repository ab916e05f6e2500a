"""services.retrieval.call_searcher.CallSearcher: a RetrievalClient's searches get the caller's CallOptions (what a
plain search wants, what search_generation / search_sourced ask for, options read at every search), an in-process
searcher's ignore them, and every answer's generation is noted. No server: the client's search_call is a
recording stand-in, or answers an empty batch itself."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from memlm.errors import MemlmError
from memlm.retrieval.attribution import SourcedNeighbors
from memlm.retrieval.searcher import Neighbors
from services.retrieval.call_searcher import CallSearcher
from services.retrieval.client import CallOptions, Found, RetrievalClient, Wants

K = 2


def neighbors(q: int) -> Neighbors:
    return Neighbors(np.zeros((q, K), np.float32), np.arange(q * K, dtype=np.int64).reshape(q, K),
                     np.ones((q, K), np.int32))


class RecordingClient(RetrievalClient):
    """A client whose search_call notes the CallOptions it got and answers from generation 7."""

    def __init__(self) -> None:
        super().__init__("127.0.0.1:1")
        self.calls: list[CallOptions] = []

    def search_call(self, xq, k, options=None, call=CallOptions()):
        self.calls.append(call)
        nb = neighbors(len(xq))
        sourced = SourcedNeighbors(nb, np.full((len(xq), k), -1, np.int32), (), 7)
        return Found(nb, 7, sourced if call.wants is Wants.SOURCES else None)


class Local:
    """An in-process searcher with generations (as a Datastore), and none when `generations` is False."""

    def __init__(self, generations: bool = True) -> None:
        if generations:
            self.search_generation = lambda xq, k, options=None: (neighbors(len(xq)), 3)

    dim = 4

    def search(self, xq, k, options=None):
        return neighbors(len(xq))


def never() -> bool:
    return False


def test_a_remote_search_gets_the_callers_options_and_what_each_method_asks_for():
    @contextlib.contextmanager
    def turn_away():
        yield

    call = CallOptions(deadline=123.0, should_stop=never, turn_away=turn_away, wants=Wants.GENERATION)
    with RecordingClient() as client:
        searcher = CallSearcher(client, call)
        xq = np.zeros((3, 4), np.float32)
        assert searcher.search(xq, K).ids.shape == (3, K)
        assert searcher.search_generation(xq, K)[1] == 7
        assert searcher.search_sourced(xq, K).generation == 7
        assert client.calls[0] is call and client.calls[1] is call
        assert client.calls[2] == CallOptions(123.0, never, turn_away, Wants.SOURCES)
        assert searcher.generations == {7}
        last = searcher.take_last()
        assert last is not None and last.sourced is not None and searcher.take_last() is None


def test_options_given_as_a_function_are_read_at_every_search():
    deadlines = iter([1.0, 2.0])
    with RecordingClient() as client:
        searcher = CallSearcher(client, lambda: CallOptions(deadline=next(deadlines), wants=Wants.SOURCES))
        searcher.search(np.zeros((1, 4), np.float32), K)
        searcher.search(np.zeros((1, 4), np.float32), K)
        assert [c.deadline for c in client.calls] == [1.0, 2.0]
        assert searcher.take_last().sourced is not None  # the options' wants: a plain search gives documents back


def test_an_in_process_search_ignores_the_bounds_and_notes_its_generation():
    entered = []

    @contextlib.contextmanager
    def turn_away():
        entered.append(True)
        yield

    call = CallOptions(deadline=0.0, should_stop=lambda: True, turn_away=turn_away, wants=Wants.GENERATION)
    with_generations, without = CallSearcher(Local(), call), CallSearcher(Local(generations=False), call)
    xq = np.zeros((2, 4), np.float32)
    assert with_generations.search(xq, K).ids.shape == (2, K) and with_generations.generations == {3}
    assert without.search_generation(xq, K)[1] == 0 and without.generations == {0}
    assert not entered  # the step is the bound of an in-process search: the turn is kept
    with pytest.raises(MemlmError, match="gives no provenance"):
        without.search_sourced(xq, K)


def test_the_client_runs_the_whole_search_inside_turn_away():
    entered = []

    @contextlib.contextmanager
    def turn_away():
        entered.append("in")
        yield
        entered.append("out")

    with RetrievalClient("127.0.0.1:1") as client:  # an empty batch is answered without a call
        found = client.search_call(np.zeros((0, 4), np.float32), K, None,
                                   CallOptions(turn_away=turn_away, wants=Wants.SOURCES))
    assert entered == ["in", "out"]
    assert found.neighbors.ids.shape == (0, K) and found.sourced is not None and found.generation == 0
