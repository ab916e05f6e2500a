"""The Ray build against the local build: same files byte for byte, on a local Ray cluster
of 2 CPUs that the test starts; a worker killed mid-shard is redone; a rerun redoes nothing finished.

Shape legend: N keys, d key dimension, Q queries, k neighbours.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import pytest
import ray
import store_helpers
from store_helpers import PROVENANCE, WINDOW, make_model

from datastore import BuildSettings, Datastore, Manifest, build_from_tokens
from datastore.encode import planned_shards
from datastore.ray_build import RayOptions, build_with_ray

# The model loader travels to the actors by value: the workers cannot import the tests' helper modules.
ray.cloudpickle.register_pickle_by_value(store_helpers)
ray.cloudpickle.register_pickle_by_value(__import__(__name__))
QUIET = {"progress": False, "log": lambda m: None}
OPTIONS = RayOptions(address="local", workers=2)
DATA_FILES = ("keys.f16", "values.i32", "docs.i32", "positions.i32", "documents.jsonl")


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    yield
    ray.shutdown()


def settings(factory: str, on_disk: bool = False) -> BuildSettings:
    # shard_batches 2: 8 windows a shard (n_shards); add_chunk 64: two 1024-row blocks over the 1483 keys.
    return BuildSettings(window=WINDOW, index_factory=factory, nprobe=4, shard_batches=2, add_chunk=64,
                         on_disk=on_disk)


def n_shards(docs) -> int:
    return planned_shards(np.cumsum([0] + [len(d) for d in docs]), WINDOW, 2)


def one_thread_model(seed: int = 0):
    """The tiny model, with torch on one thread: Ray gives each 1-CPU actor one thread, and the local
    build it is compared with must add its floats in the same order."""
    import torch

    torch.set_num_threads(1)
    return make_model(seed)


def killing_model(marker: str, seed: int = 0):
    """The tiny model, whose first forward pass in the process that claims `marker` kills that process
    (SIGKILL, mid-shard): the worker dies once, in the middle of a block of work."""
    model = one_thread_model(seed)

    def die_once(module, args):
        try:
            os.rename(marker, marker + ".claimed")  # exactly one process wins the rename
        except FileNotFoundError:
            return
        os.kill(os.getpid(), 9)

    model.register_forward_pre_hook(die_once)
    return model


def assert_same_datastore(a: Path, b: Path) -> None:
    for name in DATA_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ma, mb = Manifest.read(a), Manifest.read(b)
    assert ma.files == mb.files  # the index too, byte for byte
    xq = np.asarray(Datastore.open(a).keys[::50], dtype=np.float32) + 0.01  # (Q, d)
    ra, rb = Datastore.open(a).search(xq, 8), Datastore.open(b).search(xq, 8)
    for x, y in zip(ra, rb):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def local_builds(tmp_path_factory, docs):
    base = tmp_path_factory.mktemp("local")
    return {on_disk: build_from_tokens(one_thread_model(), docs, base / f"d{on_disk}", PROVENANCE,
                                       settings("IVF16,Flat", on_disk), **QUIET) for on_disk in (False, True)}


@pytest.mark.parametrize("on_disk", [False, True])
def test_the_ray_build_equals_the_local_build(tmp_path, docs, local_builds, on_disk):
    out, stages = build_with_ray(one_thread_model(), one_thread_model, docs, tmp_path / "r", PROVENANCE, settings("IVF16,Flat", on_disk),
                                 OPTIONS, **QUIET)
    assert sorted(stages.encoded) == list(range(n_shards(docs)))
    assert_same_datastore(out, local_builds[on_disk])


def test_a_worker_killed_mid_shard_is_redone_and_the_result_unchanged(tmp_path, docs, local_builds):
    marker = tmp_path / "kill-once"
    marker.write_text("")
    loader = functools.partial(killing_model, str(marker))
    out, stages = build_with_ray(one_thread_model(), loader, docs, tmp_path / "r", PROVENANCE, settings("IVF16,Flat"), OPTIONS,
                                 **QUIET)
    assert (tmp_path / "kill-once.claimed").exists()  # a worker did die
    assert sorted(stages.encoded) == list(range(n_shards(docs)))
    assert_same_datastore(out, local_builds[False])


def test_a_rerun_after_the_driver_died_redoes_only_the_unfinished_shards(tmp_path, docs, local_builds):
    def stop_after_encoding(message: str) -> None:
        if message.startswith("ray: encoded"):
            raise KeyboardInterrupt  # the driver dies with every shard written, before the merge

    out = tmp_path / "r"
    with pytest.raises(KeyboardInterrupt):
        build_with_ray(one_thread_model(), one_thread_model, docs, out, PROVENANCE, settings("IVF16,Flat"), OPTIONS, progress=False,
                       log=stop_after_encoding)
    for path in (out / ".build" / "shards").glob("*-000004.*"):  # shard 4 as if its worker died writing it
        path.unlink()
    out, stages = build_with_ray(one_thread_model(), one_thread_model, docs, out, PROVENANCE, settings("IVF16,Flat"), OPTIONS, **QUIET)
    assert stages.encoded == [4]
    assert_same_datastore(out, local_builds[False])
