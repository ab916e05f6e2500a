"""The retrieval service's Successors rpc: datastore ids -> their successors and the values stored
with them (memlm.retrieval.pointers.SuccessorTable), so that RetoMaton's pointer walk through the service
needs no keys. The table is derived from the served generation's provenance once per generation.

Shape legend: M ids asked, N datastore entries.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Protocol

import grpc
import numpy as np

from memlm.errors import MemlmError
from memlm.retrieval.pointers import SuccessorTable, successors
from memlm.retrieval.searcher import Provenance
from memlm.v1 import retrieval_pb2, tensor_pb2
from services.common.server import InvalidRequest
from services.common.tensors import from_tensor, to_tensor

SUCCESSOR_BYTES = 8 + 4
"""Bytes per id answered (int64 successor + int32 value), which the response must fit."""

SuccessorsNow = Callable[[], tuple[SuccessorTable, int]]
"""The successor table of the generation served now, and that generation."""


class ProvenanceStore(Protocol):
    """What a table is derived from: datastore.Datastore (each entry's document and position, its values)."""

    values: np.ndarray

    def provenance(self, ids: np.ndarray) -> Provenance: ...

    def __len__(self) -> int: ...


def table_of(store: ProvenanceStore) -> SuccessorTable:
    """The successor table of a datastore (memlm.retrieval.pointers.successors over its provenance)."""
    return SuccessorTable(successors(store.provenance, len(store)).next_ids, np.asarray(store.values, dtype=np.int32))


def successors_by_generation(served: Callable[[], tuple[ProvenanceStore, int]]) -> SuccessorsNow:
    """SuccessorsNow over `served` (GenerationWatch.served, or a fixed (store, 0)): the table is derived at
    the first call of each generation and kept until the generation changes."""
    lock = threading.Lock()
    held: list[tuple[SuccessorTable, int]] = []

    def now() -> tuple[SuccessorTable, int]:
        store, generation = served()
        with lock:
            if not held or held[0][1] != generation:
                held[:] = [(table_of(store), generation)]
            return held[0]

    return now


async def answer(request: retrieval_pb2.SuccessorsRequest, now: SuccessorsNow | None, max_message_bytes: int,
                 context: grpc.aio.ServicerContext) -> retrieval_pb2.SuccessorsResponse:
    """Validate the ids (InvalidRequest naming the field) and answer them from the generation served now."""
    if now is None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server was started without the datastore's successors")
    if not request.HasField("ids"):
        raise InvalidRequest("ids", "missing; send an (M,) int64 tensor of datastore rows")
    ids = from_tensor(request.ids, "ids", dtypes=(tensor_pb2.DTYPE_INT64,), ndim=1)  # (M,)
    if ids.shape[0] == 0:
        raise InvalidRequest("ids.shape[0]", "no ids: send at least one")
    if ids.shape[0] * SUCCESSOR_BYTES + 1024 > max_message_bytes:
        raise InvalidRequest("ids.shape[0]", f"{ids.shape[0]} ids do not fit one {max_message_bytes}-byte response; "
                             "split them", grpc.StatusCode.OUT_OF_RANGE)
    try:
        table, generation = await asyncio.to_thread(now)  # the first call of a generation derives the table
    except MemlmError as e:  # a datastore without provenance
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"ids: {e}")
    bad = (ids < 0) | (ids >= len(table))  # (M,)
    if bad.any():
        raise InvalidRequest("ids.data", f"id {int(ids[bad][0])} is not a row of the datastore (0 to {len(table) - 1})")
    next_ids, values = table.successors_of(ids)  # (M,), (M,)
    return retrieval_pb2.SuccessorsResponse(next_ids=to_tensor(next_ids.astype(np.int64)),
                                            values=to_tensor(values.astype(np.int32)), generation=generation)
