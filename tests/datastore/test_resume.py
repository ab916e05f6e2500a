"""A build killed with SIGKILL at random moments and run again equals an uninterrupted build:
byte-identical keys, values and provenance (docs, positions), and the same search results:
the build is resumable and idempotent."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from datastore import Datastore
from datastore.manifest import DOCS_NAME, KEYS_NAME, POSITIONS_NAME, VALUES_NAME

WORKER = Path(__file__).with_name("build_worker.py")
ROOT = Path(__file__).resolve().parents[2]
SLEEP = "0.1"  # seconds per forward batch: 17 batches, so encoding lasts ~2 s


def start(out: Path, sleep: str = SLEEP) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(WORKER), str(out), sleep], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    line = proc.stdout.readline()  # blocks until imports are done (bounded by the worker's own run)
    assert line.strip() == "ready", proc.stderr.read()
    return proc


def finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err


def test_sigkill_at_random_moments_then_resume_is_byte_identical(tmp_path):
    reference = tmp_path / "reference"
    finish(start(reference, sleep="0"))  # never killed: no need to slow it (the sleep changes no float)

    resumed = tmp_path / "resumed"
    rng = random.Random(1234)
    kills = 0
    for attempt in range(3):
        proc = start(resumed)
        time.sleep(rng.uniform(0.1, 1.6))
        if proc.poll() is not None:  # finished before the kill
            finish(proc)
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        kills += 1
        if (resumed / "manifest.json").exists():  # killed after the manifest: the build is finished
            break
    else:
        finish(start(resumed))
    assert kills >= 1  # at least one build really was interrupted

    for name in (KEYS_NAME, VALUES_NAME, DOCS_NAME, POSITIONS_NAME):
        assert (resumed / name).read_bytes() == (reference / name).read_bytes(), name
    a, b = Datastore.open(reference), Datastore.open(resumed)
    xq = np.asarray(a.keys[::37], dtype=np.float32)
    na, nb = a.search(xq, 10), b.search(xq, 10)
    np.testing.assert_array_equal(na.ids, nb.ids)
    np.testing.assert_array_equal(na.distances, nb.distances)
    np.testing.assert_array_equal(na.values, nb.values)
    np.testing.assert_array_equal(a.provenance(na.ids).docs, b.provenance(nb.ids).docs)
    np.testing.assert_array_equal(a.provenance(na.ids).positions, b.provenance(nb.ids).positions)
    assert a.manifest.files == b.manifest.files  # index bytes identical too (same checksums)
