"""How many compute threads a command runs, and how its idle OpenMP threads wait.

torch's intra-op pool and FAISS's OpenMP pool are sized together from the cores this process may use
(`os.sched_getaffinity`, so a pinned or containerised process counts its own cores, not the machine's).
Servers wait passively: an OpenMP thread that spins between parallel regions holds a core that another
process on the same machine (a second server, a training run) needs, and both slow far below a fair share.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
PASSIVE_COMMANDS = ("serve",)
"""Commands whose OpenMP threads wait passively unless OMP_WAIT_POLICY says otherwise."""
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
    """Before torch and FAISS load their OpenMP runtimes (which read the policy once, at load): servers wait
    passively unless the environment already chose."""
    if command_word(argv) in PASSIVE_COMMANDS:
        os.environ.setdefault(WAIT_POLICY_ENV, "PASSIVE")


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
