"""LiveDatastore: a Datastore that follows its directory's committed generation.

A running retrieval server holds one; `memlm datastore add`, `remove` and `compact` commit new generations
beside it (datastore.generations). `refresh()` reads the manifest and, when its generation is newer than
the one served, opens it (every check `Datastore.open` makes) while searches keep going to the old one,
then switches with one reference assignment: a search takes the reference once, so a call in flight
finishes on the generation it started on, and the next one sees the new one. The old generation's files
stay readable for it (mapped files outlive their unlinking). A generation that fails to open is not
served; the old one is, and the failure is logged once.

Polling, not a signal: the retrieval server calls `refresh()` every GenerationWatch.poll_s seconds on a
helper thread (services/retrieval/server.py), so a commit is picked up within that time with no
process-management plumbing between the command that commits and the server (containers, other hosts
sharing the folder).

Shape legend: Q queries, d key dimension, k neighbours.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from datastore.datastore import Datastore
from datastore.manifest import Manifest
from memlm.errors import MemlmError
from memlm.retrieval.attribution import SourcedNeighbors
from memlm.retrieval.searcher import DEFAULT_SEARCH_BACKEND, Neighbors, Provenance, SearcherInfo, SearchOptions


@dataclass(frozen=True)
class OpenOptions:
    """How each generation is opened (Datastore.open's options, the same for every generation)."""

    mmap: bool = False
    """Memory-map the FAISS index instead of loading it."""
    backend: str = DEFAULT_SEARCH_BACKEND
    """One of memlm.retrieval.searcher.SEARCH_BACKENDS ("torch": exact search on `device`)."""
    device: str | None = None
    """Device of the torch backend or of FAISS GPU clones; None: Datastore.open's default."""


class LiveDatastore:
    """The Searcher seam over the newest committed generation of a datastore directory."""

    def __init__(self, directory: str | Path, options: OpenOptions = OpenOptions(),
                 log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)):
        self.directory = Path(directory)
        self.options = options
        self._log = log
        self._lock = threading.Lock()  # one refresh at a time
        self._failed: int | None = None  # the generation that failed to open (logged once)
        self.current = self._open()

    def _open(self, verified: Manifest | None = None) -> Datastore:
        return Datastore.open(self.directory, mmap=self.options.mmap, backend=self.options.backend,
                              device=self.options.device, verified=verified)

    @property
    def generation(self) -> int:
        """The generation being served."""
        return self.current.manifest.generation

    def served(self) -> tuple[Datastore, int]:
        """The datastore answering now and its generation, from one read of the reference (a search on the
        returned datastore is answered by that generation, whatever refresh does meanwhile)."""
        store = self.current
        return store, store.manifest.generation

    @property
    def dim(self) -> int:
        return self.current.dim

    def __len__(self) -> int:
        return len(self.current)

    def info(self) -> SearcherInfo:
        return self.current.info()

    def search(self, xq: Any, k: int, options: SearchOptions | None = None) -> Neighbors:
        """Datastore.search on the generation served now (xq (Q, d) -> Neighbors (Q, k))."""
        return self.current.search(xq, k, options)

    def search_generation(self, xq: Any, k: int, options: SearchOptions | None = None) -> tuple[Neighbors, int]:
        """Datastore.search_generation on the generation served now (one read of the reference; read-only)."""
        return self.current.search_generation(xq, k, options)

    def search_sourced(self, xq: Any, k: int, options: SearchOptions | None = None) -> SourcedNeighbors:
        """Datastore.search_sourced on the generation served now: neighbours, documents and generation from
        one read of the reference (read-only; attribution)."""
        return self.current.search_sourced(xq, k, options)

    def provenance(self, ids: np.ndarray) -> Provenance:
        """Datastore.provenance of the generation served now (ids (Q, k) from its searches)."""
        return self.current.provenance(ids)

    def refresh(self) -> bool:
        """Open and switch to the committed generation when it is newer than the one served; True when it
        switched. Searches go on meanwhile (on another thread)."""
        with self._lock:
            try:
                committed = Manifest.read(self.directory).generation
            except MemlmError as e:  # e.g. a manifest being replaced on a filesystem without atomic rename
                return self._failure(-1, f"cannot read the manifest of {self.directory} ({e}); still serving "
                                     f"generation {self.generation}")
            if committed == self.generation:
                return False
            try:
                store = self._open(verified=self.current.manifest)  # unchanged files are not read again
            except (MemlmError, OSError, RuntimeError) as e:
                return self._failure(committed, f"generation {committed} of {self.directory} does not open ({e}); "
                                     f"still serving generation {self.generation}")
            before, self.current = self.generation, store
            self._failed = None
            self._log(f"datastore {self.directory}: now serving generation {store.manifest.generation} "
                      f"(was {before}; {len(store):,} entries)")
            return True

    def _failure(self, generation: int, message: str) -> bool:
        if self._failed != generation:
            self._log(message)
            self._failed = generation
        return False
