"""A datastore build distributed with Ray: the same stages and files as datastore.build,
with the two stages that split into independent units run by Ray workers.

    tokenize  the driver, as the local build (the corpus is read once, in order)
    encode    encoder actors (one per GPU where the cluster has GPUs, else one CPU each) take the missing
              shards from a queue; each shard is encoded alone (datastore.encode.encode_shard), so the keys
              are byte-identical to the in-order build's
    merge, train  the driver (one trained index: trained once on the same seeded sample)
    add       with --on-disk, Ray tasks add the blocks into per-block inverted lists in parallel; the driver
              merges them on disk (datastore.index.merge_on_disk); without it the driver adds in order
    manifest  the driver

Shared storage: workers read the tokens from and write the shards and blocks to the output directory, so
every worker must see it (one machine, or a shared file system). Faults: an actor that dies mid-shard is
restarted by Ray and its shard given again (max_restarts / max_task_retries); shard files are written
atomically, so a killed shard leaves nothing and a finished one is never redone, by this run or by a
rerun of the same command after the driver itself was killed (Ray's own fault tolerance, no home-made
scheduler: DESIGN.md, "Distribution").

Shape legend: N keys, d key dimension.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from datastore import index as index_lib
from datastore.build import BuildSettings, BuildSource, Documents, build_from_tokens
from datastore.shards import VALUE_DTYPE, read_array, shard_paths
from memlm.errors import MemlmError
from memlm.model.decoder import Decoder

ModelLoader = Callable[[], Decoder]
"""Builds the model in a worker (pickled to every actor: a function of names, never the weights)."""


@dataclass(frozen=True)
class RayOptions:
    """Where the Ray build runs and on how many workers."""

    address: str = "local"
    """"local": start a Ray instance on this machine (or use the one this process already started);
    "auto": join the cluster running here (`ray start --head`); else the cluster's HOST:PORT."""
    workers: int | None = None
    """Encoder actors; None: one per GPU of the cluster, or one per CPU when it has no GPU."""
    retries: int = 3
    """Restarts of a dead actor, and tries of its shard on the restarted one, before the build fails."""

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.workers}")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _Encoder:
    """A Ray actor: the model, and the tokens of the build in progress (read from the shared work dir)."""

    def __init__(self, load_model: ModelLoader, work: str, settings: BuildSettings, boundary_token: int):
        self.model = load_model()
        self.work = Path(work)
        self.tokens = read_array(self.work / "tokens.i32", VALUE_DTYPE)  # (N,)
        self.offsets = read_array(self.work / "doc_offsets.i64", np.dtype("<i8"), mmap=False)  # (docs + 1,)
        self.settings = settings
        self.boundary_token = boundary_token

    def encode(self, shard: int) -> tuple[int, int]:
        """Encode shard `shard` unless it is complete; returns (shard, process id) when encoded, (shard, 0) not."""
        from datastore.encode import encode_shard

        shards_dir = self.work / "shards"
        if all(p.exists() for p in shard_paths(shards_dir, shard)):
            return shard, 0
        encode_shard(self.model, self.tokens, self.offsets, self.settings.window, self.settings.shard_batches,
                     self.boundary_token, shards_dir, shard)
        return shard, os.getpid()


def _add_block(trained: str, keys_path: str, dim: int, lo: int, hi: int, chunk: int, path: str) -> None:
    """A Ray task: one block of an on-disk index (datastore.index.add_block)."""
    from datastore.shards import KEY_DTYPE

    if not Path(path).exists():
        keys = read_array(Path(keys_path), KEY_DTYPE, width=dim)  # (N, d) memmap
        index_lib.add_block(Path(trained), keys, lo, hi, chunk, Path(path))


class RayStages:
    """datastore.encode.ParallelStages on a Ray cluster."""

    def __init__(self, load_model: ModelLoader, settings: BuildSettings, boundary_token: int, options: RayOptions,
                 log: Callable[[str], None] = _stderr):
        self._load_model = load_model
        self._settings = settings
        self._boundary_token = boundary_token
        self._options = options
        self._log = log
        self.encoded: list[int] = []
        """Shards this run encoded (the others were complete), in the order they finished."""

    def encode(self, work: Path, n_shards: int) -> None:
        import ray
        from ray.util import ActorPool

        missing = [s for s in range(n_shards) if not all(p.exists() for p in shard_paths(work / "shards", s))]
        if not missing:
            return
        _connect(self._options)
        gpus = int(ray.cluster_resources().get("GPU", 0))
        workers = self._options.workers or gpus or max(1, int(ray.cluster_resources().get("CPU", 1)))
        workers = min(workers, len(missing))
        actor = ray.remote(num_gpus=1 if gpus else 0, num_cpus=0 if gpus else 1,
                           max_restarts=self._options.retries, max_task_retries=self._options.retries)(_Encoder)
        actors = [actor.remote(self._load_model, str(work), self._settings, self._boundary_token)
                  for _ in range(workers)]
        t0 = time.perf_counter()
        try:
            pool = ActorPool(actors)
            for shard, pid in pool.map_unordered(lambda a, s: a.encode.remote(s), missing):
                if pid:
                    self.encoded.append(shard)
        except ray.exceptions.RayError as e:
            raise MemlmError(f"ray build: a worker failed {self._options.retries + 1} times: "
                             f"{str(e).strip().splitlines()[-1]}; run the same command again to resume") from None
        finally:
            for a in actors:
                ray.kill(a)
        self._log(f"ray: encoded {len(self.encoded)} of {n_shards} shards on {workers} "
                  f"{'GPU' if gpus else 'CPU'} worker(s) in {time.perf_counter() - t0:.1f} s "
                  f"({n_shards - len(missing)} were complete)")

    def add_blocks(self, work: Path, keys: np.ndarray, ranges: list[tuple[int, int]], paths: list[Path]) -> None:
        import ray

        todo = [(r, p) for r, p in zip(ranges, paths) if not p.exists()]
        if len(todo) <= 1:
            return  # one block: the driver adds it (no task to ship)
        _connect(self._options)
        task = ray.remote(num_cpus=1, max_retries=self._options.retries)(_add_block)
        keys_path = str(Path(keys.filename)) if isinstance(keys, np.memmap) else None
        if keys_path is None:
            raise RuntimeError("parallel adds read the keys from their file: pass the keys memmap")
        refs = [task.remote(str(work / index_lib.TRAINED_NAME), keys_path, keys.shape[1], lo, hi,
                            self._settings.add_chunk, str(p)) for (lo, hi), p in todo]
        ray.get(refs)
        self._log(f"ray: added {len(todo)} index blocks in parallel")


def _connect(options: RayOptions) -> None:
    """Join (or start) the Ray cluster of `options`, once per process."""
    try:
        import ray
    except ImportError:
        raise MemlmError("--ray needs Ray: pip install 'ray>=2.60' (or the dev extra)") from None
    if ray.is_initialized():
        return
    # The workers import memlm and datastore from where this driver does (one machine or a shared tree).
    root = str(Path(__file__).resolve().parent.parent)
    runtime = {"env_vars": {"PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}}
    if options.address == "local":
        cpus = options.workers or os.cpu_count() or 1
        ray.init(num_cpus=cpus, include_dashboard=False, runtime_env=runtime, logging_level="WARNING")
    else:
        ray.init(address=options.address, runtime_env=runtime, logging_level="WARNING")


def build_with_ray(model: Decoder, load_model: ModelLoader, documents: Documents, out: Path, source: BuildSource,
                   settings: BuildSettings, options: RayOptions, *, overwrite: bool = False, progress: bool = True,
                   log: Callable[[str], None] = _stderr) -> tuple[Path, RayStages]:
    """build_from_tokens with its encode and (on-disk) add stages on Ray workers; the datastore written is the
    same, byte for byte. model: this process's copy (the build's identity: key layer, dimension, dtype,
    device); load_model builds the same model in every encoder actor. Returns (out, the stages: what this run
    encoded)."""
    stages = RayStages(load_model, settings, source.boundary_token, options, log)
    path = build_from_tokens(model, documents, out, source, settings, overwrite=overwrite, progress=progress,
                             log=log, parallel=stages)
    return path, stages


def load_model_by_name(name: str, device: str, dtype: str, key_module: str | None,
                       weights: str | None = None, allow_pickle_weights: bool = False) -> Decoder:
    """The model `memlm datastore build --model NAME` encodes with, loaded in a worker (a ModelLoader when
    bound with functools.partial: the names travel to the actors, never the weights; pickled weights only
    where the build allows them, as in the driver)."""
    from memlm.model.device import resolve_device
    from memlm.model.weight_formats import resolve_format
    from memlm.model.weights import load_pretrained

    torch_device = resolve_device(device)
    fmt = resolve_format(weights, dtype, torch_device)
    return load_pretrained(name, device=torch_device, dtype=fmt.dtype, key_module=key_module,
                           weights=fmt.weights, allow_pickle=allow_pickle_weights).model
