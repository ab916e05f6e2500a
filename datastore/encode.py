"""Encoding in shards: one window's rows, one shard's rows, the shard plan, and the seam for parallel stages.

A shard is `shard_batches` whole forward batches of the deterministic window plan (memlm.jobs.windows), so
shard s can be encoded alone -- skip s * shard_batches batches, run the next shard_batches -- and its keys are
byte-identical to those of an in-order run (every batch has the same composition and padding). The local
build (datastore.build) encodes the shards in order; the Ray build (datastore.ray_build) encodes them in
parallel, each with `encode_shard`.

Shape legend: n entries of a window, d key dimension.
"""

from __future__ import annotations

import math
from itertools import islice
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from datastore.shards import PROVENANCE_DTYPE, VALUE_DTYPE, ShardArrays, write_shard
from memlm.errors import MemlmError
from memlm.jobs.windows import ScoredTokens, WindowConfig, plan_windows, score_documents
from memlm.model.decoder import Decoder


class ParallelStages(Protocol):
    """Workers for the two stages that split into independent units (datastore.ray_build implements it)."""

    def encode(self, work: Path, n_shards: int) -> None:
        """Write every missing shard of 0..n_shards-1 into work/shards (datastore.shards), each exactly as
        the in-order encoding writes it; complete shards are left as they are."""

    def add_blocks(self, work: Path, keys: np.ndarray, ranges: list[tuple[int, int]], paths: list[Path]) -> None:
        """Write each missing block paths[b] = datastore.index.add_block(work / TRAINED_NAME, keys, *ranges[b], ...)."""


def entry_positions(scored: ScoredTokens) -> np.ndarray:
    """The provenance positions (n,) int32 of a window's entries (manifest.POSITIONS_NAME): the
    boundary token is position 0, so the target document[j] (ScoredTokens.positions j) is at j + 1."""
    return (scored.positions.numpy() + 1).astype(PROVENANCE_DTYPE)  # (n,)


def planned_shards(offsets: np.ndarray, window: WindowConfig, shard_batches: int) -> int:
    """Key/value shards of a build over documents `offsets`: whole forward batches of the window plan,
    shard_batches a shard."""
    n_windows = sum(len(plan_windows(int(n), window.context, window.stride)) for n in np.diff(offsets) if n > 0)
    return math.ceil(math.ceil(n_windows / window.batch_size) / shard_batches)


def window_arrays(scored: ScoredTokens) -> ShardArrays:
    """One window's entries as shard rows: keys (n, d) float16, values, documents and positions (n,)."""
    k16 = scored.keys.to(torch.float16)  # (n, d)
    if not torch.isfinite(k16).all():
        raise MemlmError(f"keys of document {scored.doc} overflow float16; the model's key activations are too large")
    n = scored.targets.shape[0]
    return ShardArrays(k16.cpu().numpy(), scored.targets.numpy().astype(VALUE_DTYPE),
                       np.full(n, scored.doc, dtype=PROVENANCE_DTYPE), entry_positions(scored))


def concatenate(parts: list[ShardArrays]) -> ShardArrays:
    """Windows' arrays -> one shard's, field by field."""
    return ShardArrays(*(np.concatenate(column) for column in zip(*parts)))


def encode_shard(model: Decoder, tokens: np.ndarray, offsets: np.ndarray, window: WindowConfig, shard_batches: int,
                 boundary_token: int, shards_dir: Path, shard: int) -> None:
    """Encode shard `shard` alone and write it to shards_dir: the windows of batches
    [shard * shard_batches, (shard + 1) * shard_batches) of the plan over documents `offsets` of `tokens`."""
    def docs():
        for i in range(offsets.shape[0] - 1):
            yield tokens[offsets[i] : offsets[i + 1]].tolist()

    stream = score_documents(model, docs(), window, boundary_token, with_logprobs=False,
                             skip_batches=shard * shard_batches)
    parts = [window_arrays(scored) for scored in islice(stream, shard_batches * window.batch_size)]
    if not parts:
        raise RuntimeError(f"shard {shard} holds no windows: past the end of the plan")
    write_shard(shards_dir, shard, concatenate(parts))
