"""The Searcher seam: what every nearest-neighbour backend answers.

The in-process `datastore.Datastore`, the gRPC retrieval client and the shard router all implement
`Searcher`; the model library above them does not know which one it has.

Shape legend: Q queries, d key dimension, k neighbours, N datastore entries.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np


class Neighbors(NamedTuple):
    """Result of `Searcher.search`. Rows are sorted by increasing distance.

    Missing neighbours (fewer than k entries) have id -1, value -1 and distance +inf.
    """

    distances: np.ndarray  # (Q, k) float32, squared L2 (or negative inner product) -- smaller is nearer
    ids: np.ndarray  # (Q, k) int64, row numbers in the datastore
    values: np.ndarray  # (Q, k) int32, the next token stored with each key


@runtime_checkable
class Searcher(Protocol):
    """Anything that finds the k nearest datastore keys to a batch of queries."""

    @property
    def dim(self) -> int:
        """Key dimension d."""
        ...

    def search(self, xq: np.ndarray, k: int) -> Neighbors:
        """xq: (Q, d) float32 or float16 queries -> Neighbors with (Q, k) arrays."""
        ...
