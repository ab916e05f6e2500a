"""A datastore build as a subprocess, for the SIGKILL-and-resume test (tests/datastore/test_resume.py).

usage: python build_worker.py OUT [FORWARD_SLEEP_S]
Prints "ready" once imports are done; each forward batch sleeps FORWARD_SLEEP_S so kills land mid-build.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import faiss
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from store_helpers import PROVENANCE, WINDOW, make_docs, make_model  # noqa: E402

from datastore import BuildSettings, build_from_tokens  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    delay = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    torch.set_num_threads(1)  # the same float reductions in every run
    faiss.omp_set_num_threads(1)
    model = make_model()
    forward = model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(delay)
        return forward(*args, **kwargs)

    model.forward = slow_forward  # instance attribute: nn.Module.__call__ finds it
    print("ready", flush=True)
    settings = BuildSettings(window=WINDOW, index_factory="IVF16,PQ8x4", nprobe=4, shard_batches=1)
    build_from_tokens(model, make_docs(), out, PROVENANCE, settings, progress=False, log=lambda m: None)
    print("finished", flush=True)


if __name__ == "__main__":
    main()
