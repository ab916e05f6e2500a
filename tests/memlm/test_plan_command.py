"""memlm plan: sizes from the index's own code size and list count, shards that fit,
replicas that carry the target rate, from a figures file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memlm.errors import MemlmError
from memlm.cli.plan import GIB, MEMORY_HEADROOM, MIN_REPLICAS, PlanInputs, make_plan

FIGURES = {"machine": "test", "scan": {"pq_m": 64, "dim": 576, "n": 1000, "nlist": 16, "ns_per_code": 10.0,
                                       "us_per_list": 2.0, "us_per_query_fixed": 50.0, "ns_per_coarse_list": 100.0}}


def inputs(**changes) -> PlanInputs:
    base = {"tokens": 10**9, "dim": 576, "factory": "IVF65536,PQ64", "nprobe": 512, "qps": None,
            "host_memory_gib": 64.0, "cores": 16, "host_disk_gib": 1024.0, "on_disk": False}
    return PlanInputs(**{**base, **changes})


def test_sizes_shards_and_search_time_follow_the_index():
    plan = make_plan(inputs(), FIGURES, nlist=65536, code_bytes=64)
    assert plan.lists_bytes == 10**9 * 72  # 64-byte codes + 8-byte ids per entry
    assert plan.quantizer_bytes == 65536 * 576 * 4
    budget = 64 * GIB * MEMORY_HEADROOM
    assert plan.shards == 2 and plan.resident_bytes_per_shard <= budget  # 67 GiB of lists: one host is too small
    assert make_plan(inputs(host_memory_gib=128.0), FIGURES, 65536, 64).shards == 1
    scanned = 512 * (1e9 / 2) / 65536  # codes one query scans on one shard
    assert plan.query_seconds == pytest.approx(50e-6 + 100e-9 * 65536 + 2e-6 * 512 + 10e-9 * scanned)
    assert plan.qps_per_replica == pytest.approx(16 / plan.query_seconds)
    assert plan.files_bytes == 10**9 * (576 * 2 + 4 + 8)


def test_replicas_carry_the_rate_and_never_drop_below_two():
    plan = make_plan(inputs(), FIGURES, 65536, 64)
    assert plan.replicas == MIN_REPLICAS
    busy = make_plan(inputs(qps=10 * plan.qps_per_replica), FIGURES, 65536, 64)
    assert busy.replicas == 10 and busy.replicas * busy.qps_per_replica >= 10 * plan.qps_per_replica * 0.999


def test_on_disk_lists_keep_only_the_quantizer_resident_and_shard_by_disk():
    plan = make_plan(inputs(on_disk=True), FIGURES, 65536, 64)
    assert plan.shards == 1 and plan.resident_bytes_per_shard == 65536 * 576 * 4
    big = make_plan(inputs(on_disk=True, tokens=10**12), FIGURES, 65536, 64)  # 67 TiB of lists, 0.8 TiB a host
    assert big.shards == 82 and big.lists_bytes / big.shards <= 1024 * GIB * MEMORY_HEADROOM


def test_a_quantizer_larger_than_the_host_is_refused():
    with pytest.raises(MemlmError, match="coarse quantizer alone"):
        make_plan(inputs(host_memory_gib=0.1), FIGURES, 65536, 64)


def test_the_command_prints_the_plan_from_a_figures_file(tmp_path):
    figures = tmp_path / "figures.json"
    figures.write_text(json.dumps(FIGURES))
    run = [sys.executable, "-m", "memlm", "plan", "--tokens", "1e9", "--dim", "576", "--figures", str(figures)]
    out = subprocess.run([*run, "--index", "IVF65536,PQ64", "--qps", "5000"], capture_output=True, text=True,
                         check=True).stdout
    assert "nprobe 512" in out and "shards        " in out and "replicas      " in out, out
    bad = subprocess.run([*run, "--index", "Flat"], check=False, capture_output=True, text=True)
    assert bad.returncode != 0 and "needs an IVF index" in bad.stderr
