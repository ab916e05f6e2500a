"""RetoMaton's walk step in compiled code (memlm.retrieval.walk_step_source, built into memlm.retrieval.
by_id_kernels' library): `walk_step` is one step of the walk over clustered states ranked by a KeySketch, for every
moving stream at once, in place on the walk's candidate block (memlm.jobs.pointer_walk): follow (the successors
of the candidates whose value came next), the minimum check, and the clustered extension (`extend_sketched` alone,
which memlm.engine.fewer_rows' generation uses too): the nearest clusters by centroid, every member ranked by the
sketch's float16 codes in blocks of 16 members (`sketch_blocks`), cluster by cluster for all rows asking for it,
the own candidates first, the kept and the scored picked by a histogram selection, exact squared L2 from the stored
keys for the scored. The rule is memlm.retrieval.pointers.extend_by_clusters'; the tests hold the compiled step to
numpy's follow + extend_by_clusters token for token (tests/memlm/retrieval/test_pointers_clusters.py) and the
extension to a row-by-row oracle (test_clustered_order.py). Its sums run in another order than numpy's and torch's
(the sketch scores, the centroid distances), so members whose scores tie to float32 rounding may rank differently.
On the 208K-key SOTU datastore (IVF2048,SQ8, 100 clusters, 3 nearest, 2,048 kept, 512 exact, one thread) the walk's
pass went from 1.05-1.13x plain kNN-LM's to 0.74x (README "Fewer searches").

Shape legend: r rows, N datastore entries, C clusters, d key dimension, p sketch components, S streams, W the
block's width, m moving streams.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np

from memlm.retrieval import by_id_kernels
from memlm.retrieval.clustered_states import StateClusters

SKETCH_BLOCK = 16
"""Members a sketch block holds (the C source's BLOCK): `sketch_blocks` lays a KeySketch's codes out so that 16
members' scores are formed side by side, one code component at a time."""


def sketch_blocks(codes: np.ndarray) -> np.ndarray:
    """(ceil(N / 16), p, 16) float16: codes (N, p) with member m's at [m // 16, :, m % 16], zeros past N (a
    KeySketch's codes are float16 values: key_sketch rounds them)."""
    n, p = codes.shape
    padded = np.zeros((-(-n // SKETCH_BLOCK) * SKETCH_BLOCK, p), dtype=np.float16)  # (N', p)
    padded[:n] = codes
    return np.ascontiguousarray(padded.reshape(-1, SKETCH_BLOCK, p).transpose(0, 2, 1))


class ClusterArrays(NamedTuple):
    """What extend_sketched reads of the clustered states (memlm.retrieval.clustered_states.StateClusters and its
    KeySketch, as C-contiguous arrays; N entries, C clusters, d key dimension, p sketch components)."""

    assign: np.ndarray  # (N,) int64 cluster of each entry
    position: np.ndarray  # (N,) int64 each entry's place in cluster order
    offsets: np.ndarray  # (C + 1,) int64 each cluster's first place
    members: np.ndarray  # (N,) int64 the entry at each place
    values: np.ndarray  # (N,) int32 the stored next token at each place
    centroids: np.ndarray  # (C, d) float32
    blocks: np.ndarray  # (ceil(N / 16), p, 16) float16 the sketch codes by place (sketch_blocks)
    norms: np.ndarray  # (N,) float32 the sketch's centred norms by place
    keys: np.ndarray  # (N, d) float16 or float32 the stored keys by place


def runs_compiled(cl: StateClusters | None) -> bool:
    """Whether rows over clustered states `cl` are extended here (the same rule as the numpy path of
    memlm.retrieval.pointers.extend_by_clusters): states with a KeySketch, keys float16 or float32, the kernels
    available."""
    return (cl is not None and cl.sketch is not None and cl.stored_keys.dtype in (np.float16, np.float32)
            and by_id_kernels.available())


def cluster_arrays(cl: StateClusters, member_values: np.ndarray) -> ClusterArrays:
    """The ClusterArrays of clustered states with a KeySketch and the values in their members order: the sketch's
    codes laid out in blocks of 16 members (N * p * 2 bytes more: 13 MB on the 208K SOTU datastore at 32
    components), the rest shared where it already has the dtype."""
    sk = cl.sketch
    return ClusterArrays(cl.assign, cl.position, cl.offsets, cl.members, member_values.astype(np.int32, copy=False),
                         np.ascontiguousarray(cl.centroids.numpy(), dtype=np.float32), sketch_blocks(sk.codes.numpy()),
                         np.ascontiguousarray(sk.centred_norms.numpy(), dtype=np.float32), cl.stored_keys)


def _cluster_args(cl: ClusterArrays, q: np.ndarray, qq: np.ndarray, exact: int, max_clusters: int | None,
                  width: int) -> list:
    """The C arguments from `assign` to `width` of extend_sketched and walk_step, the arrays checked (C reads any
    address it is given): q (r, d) and qq (r, p) float32 C-contiguous."""
    n, (c, d), p = cl.assign.shape[0], cl.centroids.shape, cl.blocks.shape[1]
    if q.shape != (q.shape[0], d) or qq.shape != (q.shape[0], p) or cl.keys.shape != (n, d):
        raise ValueError(f"q (r, {d}) and qq (r, {p}) expected, got {q.shape} and {qq.shape}")
    if cl.offsets.shape != (c + 1,) or cl.blocks.shape != (-(-n // SKETCH_BLOCK), p, SKETCH_BLOCK) \
            or any(a.shape != (n,) for a in (cl.position, cl.members, cl.values, cl.norms)):
        raise ValueError("the cluster arrays disagree in shape (ClusterArrays)")
    for a, dtype in zip(cl, (np.int64, np.int64, np.int64, np.int64, np.int32, np.float32, np.float16, np.float32,
                             cl.keys.dtype)):
        if a.dtype != dtype or not a.flags.c_contiguous:
            raise ValueError(f"cluster arrays must be C-contiguous {dtype}, got {a.dtype}")
    if cl.keys.dtype not in (np.float16, np.float32):
        raise ValueError(f"keys must be float16 or float32, got {cl.keys.dtype}")
    if width < 1 or exact < 1:
        raise ValueError(f"width and exact must be at least 1, got {width} and {exact}")
    return [cl.assign.ctypes.data, cl.position.ctypes.data, cl.offsets.ctypes.data, c, cl.members.ctypes.data,
            cl.values.ctypes.data, cl.centroids.ctypes.data, d, cl.blocks.ctypes.data, cl.norms.ctypes.data, p,
            cl.keys.ctypes.data, int(cl.keys.dtype == np.float16), exact, max_clusters or 0, width]


def extend_sketched(own: np.ndarray, q: np.ndarray, qq: np.ndarray, cl: ClusterArrays, exact: int,
                    max_clusters: int | None, width: int, lib: ctypes.CDLL | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """memlm.retrieval.pointers.extend_by_clusters' rule with a KeySketch, for every row at once in compiled code:
    own (r, w) int64 each row's own candidates (distinct ids, -1 padded), q (r, d) float32 its query, qq (r, p)
    float32 (q - mean) @ basis; exact = KeySketch.exact_members, max_clusters = KeySketch.max_clusters.
    Returns (dist, ids, vals, count): (r, width) float32 / int64 / int32, each row's kept members first (inf / -1 /
    -1 after them), and (r,) int64 how many each row keeps (0 for a row without own candidates). lib: as
    l2_by_id's."""
    lib = by_id_kernels.library(lib)
    own = np.ascontiguousarray(own, dtype=np.int64)  # (r, w)
    q = np.ascontiguousarray(q, dtype=np.float32)  # (r, d)
    qq = np.ascontiguousarray(qq, dtype=np.float32)  # (r, p)
    r, n = own.shape[0], cl.assign.shape[0]
    args = _cluster_args(cl, q, qq, exact, max_clusters, width)
    if own.ndim != 2 or q.shape[0] != r:
        raise ValueError(f"own (r, w) and q (r, d) expected, got {own.shape} and {q.shape}")
    if own.size and (int(own.max()) >= n or int(own.min()) < -1):
        raise ValueError(f"ids must be in [0, {n}) or -1, got [{int(own.min())}, {int(own.max())}]")
    dist = np.full((r, width), np.inf, dtype=np.float32)  # (r, width)
    ids = np.full((r, width), -1, dtype=np.int64)
    vals = np.full((r, width), -1, dtype=np.int32)
    count = np.zeros(r, dtype=np.int64)  # (r,)
    if r and own.shape[1] and lib.extend_sketched(r, own.ctypes.data, own.shape[1], q.ctypes.data, qq.ctypes.data,
                                                  *args, dist.ctypes.data, ids.ctypes.data, vals.ctypes.data,
                                                  count.ctypes.data):
        raise MemoryError("extend_sketched could not allocate its buffers")
    return dist, ids, vals, count


class CandidateBlock(NamedTuple):
    """The walk's candidates of S streams in place (memlm.jobs.pointer_walk), inf / -1 / -1 past each row's
    columns in use: what walk_step reads and writes (a row it extends holds its kept members first)."""

    ids: np.ndarray  # (S, W) int64
    dist: np.ndarray  # (S, W) float32
    vals: np.ndarray  # (S, W) int32
    count: np.ndarray  # (S,) int64 columns in use: up to each row's last candidate


def walk_step(block: CandidateBlock, rows: np.ndarray, prev_targets: np.ndarray, fresh: np.ndarray,
              min_pointers: int, next_ids: np.ndarray, q: np.ndarray, qq: np.ndarray, cl: ClusterArrays, exact: int,
              max_clusters: int | None, width: int, lib: ctypes.CDLL | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One step of RetoMaton's walk over clustered states with a KeySketch in compiled code, in place on `block`:
    the streams in block rows `rows` (m,) follow their candidates whose value is prev_targets (m,) (the token that
    came next) to their successors next_ids (N,) int64 (memlm.retrieval.pointers.follow's rule); those with fewer
    than min_pointers (>= 1), or fresh (m,) bool (a stream's first token), need a search and are left as they are;
    the others are extended by extend_by_clusters' rule (q (m, d), qq (m, p) as extend_sketched's) into their rows
    (at most `width` <= W). Returns need (m,) bool and scored (m,) int64: how many of a row's kept candidates
    have a distance (they come first; 0 where it needs a search). The block's ids and their successors must be
    datastore rows (checked where read: ValueError, nothing written)."""
    lib = by_id_kernels.library(lib)
    q = np.ascontiguousarray(q, dtype=np.float32)  # (m, d)
    qq = np.ascontiguousarray(qq, dtype=np.float32)  # (m, p)
    rows = np.ascontiguousarray(rows, dtype=np.int64)  # (m,)
    targets = np.ascontiguousarray(prev_targets, dtype=np.int32)  # (m,)
    first = np.ascontiguousarray(fresh, dtype=np.uint8)  # (m,)
    args = _cluster_args(cl, q, qq, exact, max_clusters, width)
    s, w = block.ids.shape
    m, n = rows.shape[0], cl.assign.shape[0]
    if q.shape[0] != m or targets.shape != (m,) or first.shape != (m,) or width > w or min_pointers < 1:
        raise ValueError(f"rows, prev_targets, fresh and q must have {m} rows, width <= {w}, min_pointers >= 1")
    if next_ids.shape != (n,) or next_ids.dtype != np.int64 or not next_ids.flags.c_contiguous:
        raise ValueError(f"next_ids must be C-contiguous ({n},) int64")  # its values are checked where read
    for a, dtype in zip(block, (np.int64, np.float32, np.int32, np.int64)):
        want = (s,) if a is block.count else (s, w)
        if a.dtype != dtype or a.shape != want or not a.flags.c_contiguous or not a.flags.writeable:
            raise ValueError(f"the block must be writeable C-contiguous {dtype} arrays of shape {want}")
    if m and (int(rows.min()) < 0 or int(rows.max()) >= s or int(block.count[rows].max()) > w):
        raise ValueError(f"rows must be in [0, {s}) and hold at most {w} candidates")
    need = np.zeros(m, dtype=np.uint8)  # (m,)
    scored = np.zeros(m, dtype=np.int64)
    status = lib.walk_step(m, rows.ctypes.data, targets.ctypes.data, first.ctypes.data, min_pointers,
                           next_ids.ctypes.data, n, block.ids.ctypes.data, block.dist.ctypes.data,
                           block.vals.ctypes.data, block.count.ctypes.data, w, q.ctypes.data, qq.ctypes.data, *args,
                           need.ctypes.data, scored.ctypes.data) if m else 0
    if status == -2:
        raise ValueError(f"a block row, or a successor of its ids, is outside [-1, {n})")
    if status:
        raise MemoryError("walk_step could not allocate its buffers")
    return need.astype(bool), scored
