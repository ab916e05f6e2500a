"""Compiled kernels over keys read by id (issue 15): one shared library built from memlm.retrieval.by_id_source
(squared L2 by id, selection and sort keys: the numpy path's compiled steps) and memlm.retrieval.walk_step_source
(RetoMaton's compiled walk step, whose Python side is memlm.retrieval.walk_step).

Here: the build and the load, and the numpy path's kernels: squared L2 by id (`l2_by_id`: each key read once where
it lies, float16 keys converted in registers (F16C), float32 fused multiply-adds, the key two ids ahead prefetched),
the sort keys of clustered_states.rank_keys (`placed_keys_into`) and each row's lowest keys (`lowest_keys_into`).

The C source is compiled at first use (memlm.compiled: cached by source and flags, safe for concurrent processes),
with AVX-512 where /proc/cpuinfo shows avx512f, f16c and fma, and a portable -O3 build otherwise. Without a
compiler, or when the build or the load fails, `available()` is False (logged once) and callers keep their numpy
and faiss path.

Shape legend: r rows, e ids a row, d key dimension, N keys.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import numpy as np

from memlm.compiled import RADIX_SORT_C, compile_library, cpu_flags, load_or_warn
from memlm.retrieval.by_id_source import BY_ID_C
from memlm.retrieval.walk_step_source import WALK_STEP_C

log = logging.getLogger(__name__)

SOURCE = (BY_ID_C + WALK_STEP_C).replace("/* RADIX_SORT_C */", RADIX_SORT_C)
"""The library's C: memlm.retrieval.by_id_source's part, then memlm.retrieval.walk_step_source's."""

VECTOR_CPU_FLAGS = ("avx512f", "f16c", "fma")
"""What the vector build needs of the CPU (its -m flags below)."""
VECTOR_FLAGS = ("-O3", "-mavx512f", "-mf16c", "-mfma")
PORTABLE_FLAGS = ("-O3",)


def build_flags() -> tuple[str, ...]:
    """VECTOR_FLAGS where the CPU has VECTOR_CPU_FLAGS, else PORTABLE_FLAGS."""
    return VECTOR_FLAGS if set(VECTOR_CPU_FLAGS) <= cpu_flags() else PORTABLE_FLAGS


def compile_kernels(flags: tuple[str, ...], folder: Path | None = None) -> Path:
    """SOURCE's shared library built with `flags` (memlm.compiled.compile_library: cached by source and flags)."""
    return compile_library(SOURCE, "by_id", flags, folder)


def load_kernels(path: Path) -> ctypes.CDLL:
    """The library at `path` with its functions' argument types declared."""
    lib = ctypes.CDLL(str(path))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    for name in ("l2_by_id_f16", "l2_by_id_f32"):
        fn = getattr(lib, name)
        fn.argtypes = [pointer, pointer, pointer, size, size, size, pointer]
        fn.restype = None
    lib.placed_keys_into.argtypes = [pointer, size, size, size, pointer, pointer]
    lib.placed_keys_into.restype = None
    lib.lowest_keys_into.argtypes = [pointer, pointer, pointer, size, size, pointer]
    lib.lowest_keys_into.restype = ctypes.c_int
    lib.extend_sketched.argtypes = [size, pointer, size, pointer, pointer, pointer, pointer, pointer, size, pointer,
                                    pointer, pointer, size, pointer, pointer, size, pointer, ctypes.c_int, size, size,
                                    size, pointer, pointer, pointer, pointer]
    lib.extend_sketched.restype = ctypes.c_int
    lib.walk_step.argtypes = [size, pointer, pointer, pointer, size, pointer, size, pointer, pointer, pointer,
                              pointer, size, pointer, pointer, *lib.extend_sketched.argtypes[5:21], pointer, pointer]
    lib.walk_step.restype = ctypes.c_int
    return lib


@functools.cache
def kernels() -> ctypes.CDLL | None:
    """This process' kernels, built for this CPU; None (logged once) where they cannot be built or loaded: exact
    distances then use faiss."""
    return load_or_warn(lambda: load_kernels(compile_kernels(build_flags())), log, "by-id kernels")


def available() -> bool:
    """Whether `l2_by_id` can run in this process (else the caller takes its faiss path)."""
    return kernels() is not None


def l2_by_id(queries: np.ndarray, keys: np.ndarray, ids: np.ndarray, lib: ctypes.CDLL | None = None) -> np.ndarray:
    """(r, e) float32 squared L2 between queries (r, d) float32 and keys[ids] (ids (r, e) int64, each in [0, N)
    or -1), inf where the id is -1; keys (N, d) float16 or float32, C-contiguous (a memmap will do). float32
    arithmetic in any summation order: equal to a float64 oracle up to float32 rounding. lib: a library of
    load_kernels (default this process' `kernels()`, which must be available)."""
    lib = lib or kernels()
    if lib is None:
        raise RuntimeError("the by-id kernels are not available (by_id_kernels.available() is False)")
    if keys.dtype not in (np.float16, np.float32) or not keys.flags.c_contiguous or keys.ndim != 2:
        raise ValueError(f"keys must be C-contiguous (N, d) float16 or float32, got {keys.dtype} {keys.shape}")
    d = keys.shape[1]
    q = np.ascontiguousarray(queries, dtype=np.float32)  # (r, d)
    at = np.ascontiguousarray(ids, dtype=np.int64)  # (r, e)
    if q.ndim != 2 or q.shape[1] != d or at.ndim != 2 or at.shape[0] != q.shape[0]:
        raise ValueError(f"queries (r, {d}) and ids (r, e) expected, got {q.shape} and {at.shape}")
    if at.size and (int(at.max()) >= keys.shape[0] or int(at.min()) < -1):  # C reads any address it is given
        raise ValueError(f"ids must be in [0, {keys.shape[0]}) or -1, got [{int(at.min())}, {int(at.max())}]")
    out = np.empty(at.shape, dtype=np.float32)  # (r, e)
    if out.size:
        fn = lib.l2_by_id_f16 if keys.dtype == np.float16 else lib.l2_by_id_f32
        fn(q.ctypes.data, keys.ctypes.data, at.ctypes.data, at.shape[0], at.shape[1], d, out.ctypes.data)
    return out


def placed_keys_into(scores: np.ndarray, first_place: int, starts: np.ndarray, out: np.ndarray,
                     lib: ctypes.CDLL | None = None) -> None:
    """out[starts[i] : starts[i] + s] = clustered_states.placed_keys(scores[i], first_place + arange(s)) for each
    row i of scores (g, s) float32 C-contiguous without nan (starts (g,) int64, out (T,) int64 C-contiguous): the
    rows' sort keys written where they go, in one pass (rank_keys). lib: as l2_by_id's."""
    lib = lib or kernels()
    if lib is None:
        raise RuntimeError("the by-id kernels are not available (by_id_kernels.available() is False)")
    at = np.ascontiguousarray(starts, dtype=np.int64)  # (g,)
    g, s = scores.shape
    if scores.dtype != np.float32 or not scores.flags.c_contiguous or at.shape != (g,):
        raise ValueError(f"scores (g, s) C-contiguous float32 and starts (g,) expected, got {scores.dtype} "
                         f"{scores.shape} and {at.shape}")
    if out.dtype != np.int64 or out.ndim != 1 or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writeable C-contiguous (T,) int64 array, got {out.dtype} {out.shape}")
    if g and (int(at.min()) < 0 or int(at.max()) + s > out.shape[0] or not 0 <= first_place <= (1 << 32) - s):
        raise ValueError(f"rows of {s} keys from starts in [{int(at.min())}, {int(at.max())}] do not fit out "
                         f"({out.shape[0]}), or places from {first_place} pass 2^32")
    if g and s:
        lib.placed_keys_into(scores.ctypes.data, g, s, first_place, at.ctypes.data, out.ctypes.data)


def lowest_keys_into(keys: np.ndarray, bounds: np.ndarray, takes: np.ndarray, out: np.ndarray,
                     lib: ctypes.CDLL | None = None) -> None:
    """out[i, :t] = the t = min(takes[i], its length) lowest of row i's keys, keys[bounds[i] : bounds[i + 1]],
    lowest first (clustered_states.lowest_keys' rule: keys (T,) int64 unique within a row, bounds (r + 1,), takes
    (r,); out (r, w) int64 C-contiguous, w >= max(takes), already filled with the pad past each row's t). keys
    is only read. lib: as l2_by_id's."""
    lib = lib or kernels()
    if lib is None:
        raise RuntimeError("the by-id kernels are not available (by_id_kernels.available() is False)")
    k = np.ascontiguousarray(keys, dtype=np.int64)  # (T,)
    b = np.ascontiguousarray(bounds, dtype=np.int64)  # (r + 1,)
    t = np.ascontiguousarray(takes, dtype=np.int64)  # (r,)
    r = t.shape[0]
    if b.shape != (r + 1,) or (r and (int(b[0]) < 0 or int(b[-1]) > k.shape[0] or bool((np.diff(b) < 0).any()))):
        raise ValueError(f"bounds (r + 1,) rising within keys ({k.shape[0]}) expected, got {b.shape}")
    if out.dtype != np.int64 or out.ndim != 2 or out.shape[0] != r or not out.flags.c_contiguous \
            or not out.flags.writeable or (r and out.shape[1] < int(t.max())):
        raise ValueError(f"out must be a writeable C-contiguous ({r}, >= max(takes)) int64 array, got {out.dtype} "
                         f"{out.shape}")
    if r and lib.lowest_keys_into(k.ctypes.data, b.ctypes.data, t.ctypes.data, r, out.shape[1], out.ctypes.data):
        raise MemoryError("lowest_keys_into could not allocate its row buffers")


def library(lib: ctypes.CDLL | None = None) -> ctypes.CDLL:
    """`lib`, or this process' kernels, which must be available (memlm.retrieval.walk_step's wrappers)."""
    lib = lib or kernels()
    if lib is None:
        raise RuntimeError("the by-id kernels are not available (by_id_kernels.available() is False)")
    return lib
