"""Servers size torch's and FAISS's thread pools together and spin briefly when idle (memlm.cli.threads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from memlm.cli import build_parser
from memlm.cli.threads import SERVER_SPIN_COUNT, apply_threads, command_word, set_wait_policy, usable_cores

ROOT = Path(__file__).resolve().parents[2]


def test_the_command_word_skips_global_options():
    assert command_word(["--cpu-gemm", "onednn", "serve", "lm", "--model", "tiny"]) == "serve"
    assert command_word(["serve", "retrieval"]) == "serve"
    assert command_word(["eval", "--model", "tiny"]) == "eval"
    assert command_word(["--help"]) is None


def test_threads_size_torch_and_faiss_together(monkeypatch):
    import faiss
    import torch

    before = torch.get_num_threads(), faiss.omp_get_max_threads()
    try:
        assert apply_threads(1) == 1
        assert (torch.get_num_threads(), faiss.omp_get_max_threads()) == (1, 1)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert apply_threads(None) == usable_cores() == len(os.sched_getaffinity(0))
        assert torch.get_num_threads() == faiss.omp_get_max_threads() == usable_cores()
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert apply_threads(None) is None  # the environment's choice stands
    finally:
        torch.set_num_threads(before[0])
        faiss.omp_set_num_threads(before[1])


@pytest.mark.parametrize("server", ["lm", "retrieval", "router"])
def test_every_server_takes_threads(server):
    required = {"lm": ["--model", "tiny"], "retrieval": [], "router": ["--shard", "127.0.0.1:1"]}[server]
    args = build_parser().parse_args(["serve", server, *required, "--threads", "3"])
    assert args.threads == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", server, *required, "--threads", "0"])


def test_servers_spin_briefly_unless_the_environment_chose(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    set_wait_policy(["eval", "--model", "tiny"])
    assert "GOMP_SPINCOUNT" not in os.environ
    set_wait_policy(["--cpu-gemm", "mkl", "serve", "retrieval"])
    assert os.environ["GOMP_SPINCOUNT"] == SERVER_SPIN_COUNT
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the environment's own choice stands
    set_wait_policy(["serve", "lm"])
    assert "GOMP_SPINCOUNT" not in os.environ


def test_the_policy_is_set_before_torch_loads():
    # libgomp reads its wait settings once, when torch loads it: importing memlm.cli must set them first.
    code = """
import importlib.abc, os, sys
class AtTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            print(os.environ.get("GOMP_SPINCOUNT"))
            sys.meta_path.remove(self)
sys.meta_path.insert(0, AtTorch())
sys.argv = ["memlm", "serve", "lm"]
import memlm.cli
"""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == SERVER_SPIN_COUNT
