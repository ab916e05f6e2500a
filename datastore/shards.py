"""Key/value shards that survive SIGKILL, and merging them.

Every file of a build is written through memlm.files' atomic writes (temporary name, fsync, rename,
fsync of the folder), so a file with its final name is always complete: a killed build leaves at
most a stray `*.partial` (memlm.files.PARTIAL_SUFFIX), which the next run overwrites. A shard is
complete when all its files (keys, values, docs, positions) exist.

Shape legend: n rows of one shard, N rows in all, d key dimension.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from memlm.files import atomic_open, atomic_write

KEY_DTYPE = np.dtype("<f2")
VALUE_DTYPE = np.dtype("<i4")
PROVENANCE_DTYPE = np.dtype("<i4")
"""Document indices and positions (int32: 2**31 documents or tokens per document are far off)."""


def write_array(path: Path, array: np.ndarray, dtype: np.dtype) -> None:
    """Write `array` as raw little-endian `dtype` bytes, atomically and durably."""
    atomic_write(path, np.ascontiguousarray(array, dtype=dtype).tobytes(), durable=True)


def read_array(path: Path, dtype: np.dtype, width: int | None = None, mmap: bool = True) -> np.ndarray:
    """Raw file -> (n,) or (n, width) array; memory-mapped read-only when `mmap`."""
    path = Path(path)
    itemsize = dtype.itemsize * (width or 1)
    size = path.stat().st_size
    if size % itemsize:
        raise ValueError(f"{path} has {size} bytes, not a multiple of its row size {itemsize}")
    n = size // itemsize
    shape = (n, width) if width else (n,)
    if n == 0:
        return np.zeros(shape, dtype=dtype)
    if mmap:
        return np.memmap(path, dtype=dtype, mode="r", shape=shape)
    return np.fromfile(path, dtype=dtype).reshape(shape)


class ShardArrays(NamedTuple):
    """The arrays of a shard (or, merged, of a datastore): one row per datastore entry."""

    keys: np.ndarray  # (n, d) float16
    values: np.ndarray  # (n,) int32 next-token ids
    docs: np.ndarray  # (n,) int32 document index (memlm.retrieval.searcher.Provenance)
    positions: np.ndarray  # (n,) int32 position of the next token in its document (boundary = 0)


class ShardPaths(NamedTuple):
    """The files of one shard, or the merged files of a datastore, field by field as ShardArrays."""

    keys: Path
    values: Path
    docs: Path
    positions: Path


ARRAY_DTYPES = ShardArrays(KEY_DTYPE, VALUE_DTYPE, PROVENANCE_DTYPE, PROVENANCE_DTYPE)
"""The on-disk dtype of each array, field by field."""


def shard_paths(directory: Path, shard: int) -> ShardPaths:
    """The files of shard number `shard`."""
    return ShardPaths(directory / f"keys-{shard:06d}.f16", directory / f"values-{shard:06d}.i32",
                      directory / f"docs-{shard:06d}.i32", directory / f"positions-{shard:06d}.i32")


def write_shard(directory: Path, shard: int, arrays: ShardArrays) -> None:
    """One shard: every array with n rows, each file written atomically; complete once all exist."""
    rows = {name: array.shape[0] for name, array in zip(ShardArrays._fields, arrays)}
    if len(set(rows.values())) != 1:
        raise ValueError(f"shard {shard}: arrays of different lengths {rows}")
    for path, array, dtype in zip(shard_paths(directory, shard), arrays, ARRAY_DTYPES):
        write_array(path, array, dtype)


def complete_shards(directory: Path) -> int:
    """Number of complete shards from shard 0 on (shards are written in order)."""
    count = 0
    while all(p.exists() for p in shard_paths(directory, count)):
        count += 1
    return count


def merge_shards(directory: Path, n_shards: int, dim: int, out: ShardPaths) -> int:
    """Concatenate shards 0..n_shards-1 into one file per array (keys (N, d), the others (N,)); returns N.

    One memmap per array keeps `Datastore.keys[ids]` a plain fancy index, and costs one sequential
    copy (seconds per GB), which is small next to encoding the keys.
    """
    for field_index, out_path in enumerate(out):
        with atomic_open(out_path, durable=True) as f:
            for shard in range(n_shards):
                for block in _file_blocks(shard_paths(directory, shard)[field_index]):
                    f.write(block)
    return out.keys.stat().st_size // (KEY_DTYPE.itemsize * dim)


def _file_blocks(path: Path, block: int = 1 << 24) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(block):
            yield chunk
