"""Key/value shards that survive SIGKILL, and merging them.

Every file of a build is written through memlm.files' atomic writes (temporary name, fsync, rename,
fsync of the folder), so a file with its final name is always complete: a killed build leaves at
most a stray `*.partial` (memlm.files.PARTIAL_SUFFIX), which the next run overwrites. A shard is
complete when both its key and its value file exist.

Shape legend: n rows of one shard, N rows in all, d key dimension.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

from memlm.files import atomic_open, atomic_write

KEY_DTYPE = np.dtype("<f2")
VALUE_DTYPE = np.dtype("<i4")


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


def shard_paths(directory: Path, shard: int) -> tuple[Path, Path]:
    """Key and value file of shard number `shard`."""
    return directory / f"keys-{shard:06d}.f16", directory / f"values-{shard:06d}.i32"


def write_shard(directory: Path, shard: int, keys: np.ndarray, values: np.ndarray) -> None:
    """keys (n, d) float16, values (n,) int32 -> one complete shard (value file renamed last)."""
    if keys.shape[0] != values.shape[0]:
        raise ValueError(f"shard {shard}: {keys.shape[0]} keys but {values.shape[0]} values")
    key_path, value_path = shard_paths(directory, shard)
    write_array(key_path, keys, KEY_DTYPE)
    write_array(value_path, values, VALUE_DTYPE)


def complete_shards(directory: Path) -> int:
    """Number of complete shards from shard 0 on (shards are written in order)."""
    count = 0
    while all(p.exists() for p in shard_paths(directory, count)):
        count += 1
    return count


def merge_shards(directory: Path, n_shards: int, dim: int, keys_out: Path, values_out: Path) -> int:
    """Concatenate shards 0..n_shards-1 into one key file (N, d) and one value file (N,); returns N.

    One memmap per array keeps `Datastore.keys[ids]` a plain fancy index, and costs one sequential
    copy (seconds per GB), which is small next to encoding the keys.
    """
    n_total = 0
    with atomic_open(keys_out, durable=True) as fk:
        for shard in range(n_shards):
            key_path, _ = shard_paths(directory, shard)
            for block in _file_blocks(key_path):
                fk.write(block)
            n_total += key_path.stat().st_size // (KEY_DTYPE.itemsize * dim)
    with atomic_open(values_out, durable=True) as fv:
        for shard in range(n_shards):
            _, value_path = shard_paths(directory, shard)
            for block in _file_blocks(value_path):
                fv.write(block)
    return n_total


def _file_blocks(path: Path, block: int = 1 << 24) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(block):
            yield chunk
