"""The FAISS index over the keys: choose a factory string, train on a sample, add in chunks, search.

One factory string describes the index (printed, recorded, reproducible). The default follows the datastore size N and
the key dimension d (`default_factory`) and is printed with its reason. Training and adding run on all
GPUs (cloned, or sharded when the index does not fit one) when faiss has GPU support and torch sees
CUDA; otherwise on the CPU. The index on disk is always a CPU index; `read_index(mmap=True)` maps it
instead of loading it.

Shape legend: N keys, n rows of a chunk, d key dimension, Q queries, k neighbours.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import faiss
import numpy as np
from tqdm import tqdm

from memlm.errors import MemlmError
from memlm.files import atomic_path

FLAT_MAX = 200_000
"""Up to this many keys a brute-force "Flat" index is exact and still fast (N * d multiply-adds per
query: 0.1 GFLOP at N 200k, d 576) and needs no training."""
SQ8_MAX = 4_000_000
"""Up to this many keys "IVF{nlist},SQ8" (one byte per dimension, near-exact distances) fits in a few
GB; beyond it product quantisation ("IVF{nlist},PQ{m}", m bytes per key) keeps the index in memory."""


def default_nlist(n: int) -> int:
    """Inverted lists for N keys: the power of two nearest 4 * sqrt(N) (faiss's guideline of 4-16
    sqrt(N)), with at least 64 keys per list so that every centroid gets trained."""
    nlist = 2 ** round(math.log2(max(4 * math.sqrt(max(n, 1)), 1)))
    return int(max(1, min(nlist, n // 64)))


def default_pq_m(d: int) -> int:
    """PQ sub-quantisers: the largest divisor of d that is at most min(64, d // 4), so every
    sub-vector has at least 4 dimensions (the kNN-LM paper used PQ64 on d 1024)."""
    cap = max(1, min(64, d // 4))
    return max(m for m in range(1, cap + 1) if d % m == 0)


def default_factory(n: int, d: int) -> tuple[str, str]:
    """(factory string, one-line reason) for N keys of dimension d."""
    if n <= FLAT_MAX:
        return "Flat", f"N {n} <= {FLAT_MAX}: exact brute-force search is affordable"
    nlist = default_nlist(n)
    if n <= SQ8_MAX:
        return f"IVF{nlist},SQ8", f"N {n} <= {SQ8_MAX}: {nlist} lists (~4 sqrt N), 8-bit scalar codes, {d} bytes/key"
    m = default_pq_m(d)
    return f"IVF{nlist},PQ{m}", f"N {n} > {SQ8_MAX}: {nlist} lists (~4 sqrt N), product codes of {m} bytes/key"


def default_nprobe(index: faiss.Index) -> int:
    """Lists visited per query: nlist / 128 (32 of 4096 in the kNN-LM paper), at least 16."""
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is None:
        return 1
    return int(min(ivf.nlist, max(16, ivf.nlist // 128)))


def train_sample_size(index: faiss.Index, n: int) -> int:
    """Keys to train on: 64 per inverted list, and at least 65536 (256 per PQ/SQ centroid); all when fewer."""
    if index.is_trained:
        return 0
    ivf = faiss.try_extract_index_ivf(index)
    nlist = ivf.nlist if ivf is not None else 1
    return int(min(n, max(64 * nlist, 65536)))


def make_index(factory: str, d: int) -> faiss.Index:
    try:
        index = faiss.index_factory(d, factory, faiss.METRIC_L2)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[-1] if str(e).strip() else "unknown error"
        raise MemlmError(f"FAISS cannot build index {factory!r} for dimension {d} ({first}); "
                         "pass another --index, e.g. Flat or IVF1024,PQ64") from e
    ivf = faiss.try_extract_index_ivf(index)
    inner = faiss.downcast_index(ivf if ivf is not None else index)
    if isinstance(inner, (faiss.IndexPQ, faiss.IndexIVFPQ)):
        # The factory turns on polysemous training for PQ codes; we never search with Hamming
        # filtering, and for PQ64 it takes minutes (measured: > 10 min on 8k keys, 2 CPU cores).
        inner.do_polysemous_training = False
    return index


def gpu_count() -> int:
    """GPUs FAISS can use: needs faiss built with GPU support (faiss-cpu reports 0) and torch seeing CUDA."""
    try:
        import torch

        if not torch.cuda.is_available():
            return 0
    except ImportError:
        return 0
    return int(faiss.get_num_gpus())


def to_gpus(index: faiss.Index, n: int, log: Callable[[str], None]) -> faiss.Index | None:
    """Clone `index` to all GPUs (sharded when N keys would not fit one GPU), or None when it cannot be."""
    if gpu_count() == 0 or faiss.try_extract_index_ivf(index) is None:
        return None  # a Flat index gains nothing on the GPU while building
    import torch

    co = faiss.GpuMultipleClonerOptions()
    co.useFloat16 = True  # float16 look-up tables: GPU IVF-PQ needs them for many sub-quantisers
    need = (index.sa_code_size() + 8) * n  # codes plus int64 ids
    free = min(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
    co.shard = need > 0.8 * free
    try:
        gpu = faiss.index_cpu_to_all_gpus(index, co=co)
    except RuntimeError as e:  # e.g. PQ sub-vector sizes the GPU kernels lack
        log(f"GPU FAISS cannot hold this index ({str(e).strip().splitlines()[-1]}); using the CPU")
        return None
    log(f"FAISS on {faiss.get_num_gpus()} GPU(s), {'sharded' if co.shard else 'replicated'}")
    return gpu


def train_index(
    factory: str, keys: np.ndarray, seed: int, log: Callable[[str], None], progress: bool = True
) -> faiss.Index:
    """keys: (N, d) float16 memmap -> an empty, trained CPU index; trained on a seeded random sample."""
    n, d = keys.shape
    index = make_index(factory, d)
    size = train_sample_size(index, n)
    if size == 0:
        return index
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.choice(n, size=size, replace=False))  # (S,) sorted: sequential-ish memmap reads
    sample = np.empty((size, d), dtype=np.float32)  # (S, d)
    chunk = 65536
    with tqdm(total=size + 1, desc="train index", unit="key", file=sys.stderr, disable=not progress) as bar:
        for lo in range(0, size, chunk):
            sample[lo : lo + chunk] = keys[ids[lo : lo + chunk]]
            bar.update(min(chunk, size - lo))
        gpu = to_gpus(index, size, log)
        if gpu is not None:
            gpu.train(sample)
            index = faiss.index_gpu_to_cpu(gpu)
        else:
            index.train(sample)
        bar.update(1)
    return index


def add_keys(
    index: faiss.Index, keys: np.ndarray, chunk: int, log: Callable[[str], None], progress: bool = True
) -> faiss.Index:
    """Add keys (N, d) float16 in chunks of `chunk` rows, in order, after the index's rows (index row
    start + i = key row i, start = index.ntotal before: 0 for a build, the datastore's N for an add)."""
    n, start = keys.shape[0], index.ntotal
    if is_on_disk(index):  # memlm datastore add writes a new generation's index.faiss, never the lists' file
        raise MemlmError("this datastore's IVF lists are on disk (built with --on-disk); adding to them is not "
                         "supported yet: rebuild the datastore with the new documents")
    gpu = to_gpus(index, n, log)
    target = gpu if gpu is not None else index
    with tqdm(total=n, desc="add to index", unit="key", file=sys.stderr, disable=not progress) as bar:
        for lo in range(0, n, chunk):
            x = np.ascontiguousarray(keys[lo : lo + chunk], dtype=np.float32)  # (n, d)
            target.add(x)
            bar.update(x.shape[0])
    if gpu is not None:
        index = faiss.index_gpu_to_cpu(gpu)
    if index.ntotal != start + n:
        raise RuntimeError(f"index holds {index.ntotal} keys after adding {n} to {start}")
    return index


IVFDATA_NAME = "index.ivfdata"
"""The inverted lists of an on-disk IVF index: faiss OnDiskInvertedLists, memory-mapped,
so only the coarse quantizer and the list directory (index.faiss) are resident; a search reads the nprobe
lists it visits. index.faiss names this file; read_index finds it beside index.faiss
(IO_FLAG_ONDISK_SAME_DIR), wherever the directory is moved."""
ON_DISK_BLOCK_CHUNKS = 16
"""Add chunks per block of an on-disk build: each block is added into its own in-memory inverted lists and
written (the memory a block takes is what an on-disk build needs), then all blocks are merged on disk."""


def is_on_disk(index: faiss.Index) -> bool:
    """True when the index's inverted lists live in a memory-mapped file (OnDiskInvertedLists)."""
    ivf = faiss.try_extract_index_ivf(index)
    return ivf is not None and isinstance(faiss.downcast_InvertedLists(ivf.invlists), faiss.OnDiskInvertedLists)


def check_on_disk_factory(factory: str, d: int) -> None:
    """Refuse, in one line, an on-disk build of an index without inverted lists."""
    if faiss.try_extract_index_ivf(make_index(factory, d)) is None:
        raise MemlmError(f"--on-disk needs an IVF index (e.g. IVF1024,PQ64 or IVF256,Flat); {factory!r} has no "
                         "inverted lists to keep on disk")


def add_block(trained_path: Path, keys: np.ndarray, lo: int, hi: int, chunk: int, path: Path) -> None:
    """Add key rows [lo, hi) (ids lo..hi-1) into a copy of the trained index and write it to `path`: one
    block of an on-disk build (blocks are independent: a distributed build adds them in parallel)."""
    index = read_index(trained_path)
    for start in range(lo, hi, chunk):
        stop = min(start + chunk, hi)
        x = np.ascontiguousarray(keys[start:stop], dtype=np.float32)  # (n, d)
        index.add_with_ids(x, np.arange(start, stop, dtype=np.int64))  # (n,) global row ids
    write_index(index, path)


def block_ranges(n: int, chunk: int) -> list[tuple[int, int]]:
    """The [lo, hi) key rows of each block of an on-disk build of N keys."""
    rows = chunk * ON_DISK_BLOCK_CHUNKS
    return [(lo, min(lo + rows, n)) for lo in range(0, n, rows)]


def merge_on_disk(trained_path: Path, blocks: list[Path], ivfdata: Path, index_path: Path) -> None:
    """Merge the blocks' inverted lists, in block order, into OnDiskInvertedLists at `ivfdata` (each list
    holds its entries in row order, as an in-memory add in row order leaves them, so searches return the
    same neighbours in the same order), and write the index naming them to `index_path`.

    As faiss.contrib.ondisk.merge_ondisk, but the blocks stay owned by their indexes (freed on return
    instead of leaked), and the file is synced before index_path is written."""
    if ivfdata.name != IVFDATA_NAME:  # index.faiss records the name; read_index looks for it beside itself
        raise ValueError(f"the lists' file must be named {IVFDATA_NAME}, got {ivfdata.name}")
    index = read_index(trained_path)
    ivf = faiss.extract_index_ivf(index)
    if index.ntotal != 0:
        raise RuntimeError(f"{trained_path} holds {index.ntotal} keys; merging needs the empty trained index")
    parts = [read_index(p, mmap=True) for p in blocks]  # mmap: the lists need not fit in memory
    lists = faiss.InvertedListsPtrVector()
    for part in parts:
        lists.push_back(faiss.extract_index_ivf(part).invlists)
    ivfdata.unlink(missing_ok=True)  # a killed merge's file: start it over
    on_disk = faiss.OnDiskInvertedLists(ivf.nlist, ivf.code_size, str(ivfdata))
    ntotal = on_disk.merge_from_multiple(lists.data(), lists.size(), False)
    index.ntotal = ivf.ntotal = ntotal
    ivf.replace_invlists(on_disk, True)
    on_disk.this.disown()  # the index owns it now
    # index.faiss records the lists' file name: a bare name, so the index is the same bytes wherever it was
    # built (read_index finds the file beside it; the merged lists are written and no longer reopened).
    on_disk.filename = IVFDATA_NAME
    write_index(index, index_path)
    del index, ivf, parts, lists  # unmaps the lists (their pages reach the file)
    with open(ivfdata, "rb+") as f:
        os.fsync(f.fileno())


TRAINED_NAME = "trained.faiss"
"""The empty trained index in a build's work directory (train once; every block copies it)."""


def add_on_disk(keys: np.ndarray, chunk: int, index_path: Path, work: Path, progress: bool = True,
                add_blocks: Callable[[Path, np.ndarray, list[tuple[int, int]], list[Path]], None] | None = None) -> None:
    """The add stage of an on-disk build: add keys (N, d) block by block into work/blocks (a block once
    written is kept: a killed build redoes only the others), merge them into IVFDATA_NAME beside
    `index_path`, then write `index_path` (its presence marks the stage done). work holds TRAINED_NAME.
    add_blocks(work, keys, ranges, paths): writes the missing blocks elsewhere first (in parallel); any it
    left missing are added here."""
    blocks_dir = work / "blocks"
    blocks_dir.mkdir(exist_ok=True)
    ranges = block_ranges(keys.shape[0], chunk)
    blocks = [blocks_dir / f"block-{b:05d}.faiss" for b in range(len(ranges))]
    if add_blocks is not None:  # e.g. Ray tasks (datastore.ray_build): blocks are independent
        add_blocks(work, keys, ranges, blocks)
    for (lo, hi), path in tqdm(list(zip(ranges, blocks)), desc="add blocks", unit="block", file=sys.stderr,
                               disable=not progress):
        if not path.exists():
            add_block(work / TRAINED_NAME, keys, lo, hi, chunk, path)
    merge_blocks_into(index_path, work, blocks)


def merge_blocks_into(index_path: Path, work: Path, blocks: list[Path]) -> None:
    """Merge added blocks (in row order) into IVFDATA_NAME beside `index_path`, then write `index_path`."""
    merged = work / IVFDATA_NAME
    merge_on_disk(work / TRAINED_NAME, blocks, merged, work / "merged.faiss")
    merged.replace(index_path.parent / IVFDATA_NAME)  # the lists first: index_path is the stage's mark
    (work / "merged.faiss").replace(index_path)


def index_footprint(manifest) -> str:
    """What searching the index holds in memory vs reads from disk, from the manifest's file sizes:
    index.faiss is loaded whole (unless --mmap); an on-disk index's lists (IVFDATA_NAME) stay mapped."""
    from datastore.manifest import INDEX_NAME

    resident = manifest.files[INDEX_NAME].bytes
    lists = manifest.files.get(IVFDATA_NAME)
    if lists is None:
        return f"{resident / 2**20:.1f} MiB resident (in memory), 0 MiB on disk"
    return (f"{resident / 2**20:.1f} MiB resident (quantizer and list directory), {lists.bytes / 2**20:.1f} MiB "
            f"on disk ({IVFDATA_NAME}, memory-mapped: a search reads the lists it probes)")


def write_index(index: faiss.Index, path: Path) -> None:
    """Write to `path` atomically and durably (faiss writes the temporary file itself; atomic_path fsyncs it)."""
    with atomic_path(path, durable=True) as tmp:
        faiss.write_index(index, str(tmp))


BLAS_MIN_QUERIES = 4
"""Queries per search call from which FAISS computes brute-force distances with BLAS.

faiss scans query by query while queries * d < faiss.cvar.distance_compute_blas_threshold (128,000 by
default: below ~222 queries of d 576), each query reading every key, while one BLAS call costs a fixed
setup plus a small cost a query. The two cross at 3-4 queries whatever N (both costs grow with N * d), so
RetoMaton's and adaptive retrieval's smaller search calls (tens of queries) save time only with this set;
without it each of their searches costs more per query than plain kNN-LM's 1,024-query calls."""


BLAS_MIN_KEYS = 65_536
"""Indexes of fewer keys are searched with FAISS's own threshold: a scan of them is cheap either way, and
the query by query path gives each query the same distances whatever else is in its call (a BLAS product
rounds by how the call is blocked), which tests that compare a remote search with a local one bit for bit
rely on."""


class _BlasThreshold:
    """FAISS's distance_compute_blas_threshold is one process-wide global (faiss.cvar), read by every brute-
    force distance computation. blas_calls lowers it for the duration of a large index's search and puts
    back what it was when the last overlapping such search ends (a count under a lock: searches of several
    threads, as the retrieval server makes, overlap without one restoring under another). What stays true
    of the global: while a large index's search runs, any other FAISS search that runs at the same moment
    in another thread of the process (a small index, memlm.memory.knn_store_faiss's Flat scans) also takes
    the BLAS path above BLAS_MIN_QUERIES queries, so its distances may differ by float32 rounding; searches
    that do not overlap one are not affected."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        """Large-index searches running now."""
        self.saved = 0
        """The threshold before the first of them, restored after the last."""

    @contextmanager
    def lowered(self, d: int) -> Iterator[None]:
        with self.lock:
            if self.users == 0:
                self.saved = faiss.cvar.distance_compute_blas_threshold
                # Overlapping searches of indexes of another d keep the first's value (moves the switch only).
                faiss.cvar.distance_compute_blas_threshold = BLAS_MIN_QUERIES * d
            self.users += 1
        try:
            yield
        finally:
            with self.lock:
                self.users -= 1
                if self.users == 0:
                    faiss.cvar.distance_compute_blas_threshold = self.saved


_BLAS = _BlasThreshold()


@contextmanager
def blas_calls(index: faiss.Index) -> Iterator[None]:
    """Around one search of `index`: calls of BLAS_MIN_QUERIES queries or more compute distances with BLAS
    when the index holds BLAS_MIN_KEYS keys or more (FAISS's own threshold otherwise, and after the call;
    _BlasThreshold says what the global means for searches of other threads meanwhile). Inside, a query's
    distances may differ by float32 rounding with what else is in its call."""
    if index.ntotal < BLAS_MIN_KEYS:
        yield
        return
    with _BLAS.lowered(index.d):
        yield


def read_index(path: Path, mmap: bool = False) -> faiss.Index:
    """Load an index; with mmap the codes stay on disk and pages come in as searches touch them. The
    inverted lists of an on-disk index (IVFDATA_NAME beside `path`) are always mapped, from beside `path`.
    Search it inside blas_calls (Datastore.search does)."""
    if (Path(path).parent / IVFDATA_NAME).exists():
        # IO_FLAG_MMAP includes IO_FLAG_SKIP_IVF_DATA, which leaves OnDiskInvertedLists unreadable
        # (measured: faiss 1.15.1 segfaults on the first search); its lists are mapped anyway.
        flags = faiss.IO_FLAG_READ_ONLY if mmap else 0
    else:
        flags = faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY if mmap else 0
    return faiss.read_index(str(path), flags | faiss.IO_FLAG_ONDISK_SAME_DIR)


class LiveRows:
    """The rows a search may return: a bitmap over the index's N rows (bit i set: row i is live), as a
    FAISS ID selector. Removed documents' rows are cleared: every search of the index carries
    it in its parameters, so FAISS itself never returns them and a top-k holds k live rows, exactly as an
    index without them (no over-fetch and filter)."""

    def __init__(self, live: np.ndarray):
        """live: (N,) bool."""
        self.live = np.ascontiguousarray(live, dtype=bool)  # (N,)
        self.bitmap = np.packbits(self.live, bitorder="little")  # (ceil(N / 8),) uint8, FAISS's bit order
        self.selector = faiss.IDSelectorBitmap(self.live.shape[0], faiss.swig_ptr(self.bitmap))


def check_selectable(index: faiss.Index) -> None:
    """Refuse an index whose search takes no ID selector (a plain PQ index), so removal cannot hide rows."""
    inner = faiss.downcast_index(index.index) if isinstance(index, faiss.IndexPreTransform) else index
    if faiss.try_extract_index_ivf(inner) is None and not isinstance(inner, (faiss.IndexFlat, faiss.IndexHNSW)):
        raise MemlmError(f"the index ({type(inner).__name__}) takes no ID selector, so removed documents cannot be "
                         "hidden from its searches; run memlm datastore compact DIR to drop them")


def search_params(index: faiss.Index, nprobe: int | None, live: LiveRows | None = None) -> faiss.SearchParameters | None:
    """Per-call search parameters (thread-safe: the index itself is never changed): nprobe for IVF indexes,
    and the live rows' selector when the datastore has removed documents (check_selectable first)."""
    inner = faiss.downcast_index(index.index) if isinstance(index, faiss.IndexPreTransform) else index
    ivf = faiss.try_extract_index_ivf(inner)
    if live is None and (nprobe is None or ivf is None):
        return None
    if ivf is not None:
        params = faiss.SearchParametersIVF(nprobe=int(nprobe if nprobe is not None else ivf.nprobe))
    elif isinstance(inner, faiss.IndexHNSW):
        params = faiss.SearchParametersHNSW()
    else:
        params = faiss.SearchParameters()
    if live is not None:
        params.sel = live.selector
    if isinstance(index, faiss.IndexPreTransform):  # e.g. "OPQ64,IVF4096,PQ64": parameters nest
        outer = faiss.SearchParametersPreTransform()
        outer.index_params = params
        outer.referenced_objects = [params]  # keep the inner object alive as long as the outer one
        return outer
    return params
