"""How many compute threads a command runs, and how long its idle OpenMP threads spin before they sleep.

torch's intra-op pool and FAISS's OpenMP pool are sized together from the cores this process may use
(`os.sched_getaffinity`, so a pinned or containerised process counts its own cores, not the machine's).
Servers spin only briefly between parallel regions (GOMP_SPINCOUNT): a thread that spins long holds a core that
another process on the same machine (a second server, a training run) needs; a passive wait (no spin) gives the
cores back but costs a third of the decode speed of a machine the server has to itself (docs/decisions/openmp-wait.md).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
SPIN_COUNT_ENV = "GOMP_SPINCOUNT"
SERVER_SPIN_COUNT = "10000"
"""Spins of an idle OpenMP thread of a server before it sleeps (libgomp's own default is 300000)."""
SERVER_COMMANDS = ("serve",)
"""Commands whose OpenMP threads spin SERVER_SPIN_COUNT times unless the environment set a wait of its own."""
GLOBAL_OPTIONS_WITH_VALUES = ("--cpu-gemm",)
"""Options before the command word that take a value (skipped when looking for the command)."""


def usable_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def command_word(argv: Sequence[str]) -> str | None:
    """The subcommand of a `memlm` command line (`serve` in `memlm --cpu-gemm mkl serve lm ...`)."""
    skip = False
    for token in argv:
        if skip:
            skip = False
        elif token in GLOBAL_OPTIONS_WITH_VALUES:
            skip = True
        elif not token.startswith("-"):
            return token
    return None


def set_wait_policy(argv: Sequence[str]) -> None:
    """Before torch and FAISS load their OpenMP runtimes (which read the wait once, at load): servers spin
    SERVER_SPIN_COUNT times before sleeping unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is already set."""
    if command_word(argv) in SERVER_COMMANDS and not {WAIT_POLICY_ENV, SPIN_COUNT_ENV} & set(os.environ):
        os.environ[SPIN_COUNT_ENV] = SERVER_SPIN_COUNT


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    from memlm.cli.options import positive_int  # here: this module loads before torch, options after it

    parser.add_argument("--threads", type=positive_int, default=None, metavar="N",
                        help="compute threads of torch and FAISS together (default: the cores this process may use)")


def apply_threads(threads: int | None) -> int | None:
    """Size torch's intra-op pool and FAISS's OpenMP pool to `threads`; None: to usable_cores(), unless
    OMP_NUM_THREADS already sized both. The count set, or None when the environment's stands."""
    if threads is None and "OMP_NUM_THREADS" in os.environ:
        return None
    import faiss
    import torch

    n = threads or usable_cores()
    torch.set_num_threads(n)
    faiss.omp_set_num_threads(n)
    return n
