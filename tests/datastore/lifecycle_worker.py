"""A datastore change as a subprocess, for the SIGKILL tests of tests/datastore/test_lifecycle.py.

usage: python lifecycle_worker.py OP DIR SLEEP_S     (OP: add, remove or compact)
add: documents B (lifecycle_docs) with each forward batch sleeping SLEEP_S; remove: documents B by doc_id;
compact. In remove and compact every file write first sleeps SLEEP_S, so kills land between the writes
and the commit. Prints "ready" once imports are done and "finished" at the end.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import faiss
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lifecycle_docs import DOCS_B
from store_helpers import PROVENANCE, make_model

from datastore import (
    Datastore,
    generations,
    removal,
)
from datastore.add import add_documents


def slowed(function, delay: float):
    def wrapper(*args, **kwargs):
        time.sleep(delay)
        return function(*args, **kwargs)
    return wrapper


def main() -> None:
    op, out, delay = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    torch.set_num_threads(1)  # the same float reductions in every run
    faiss.omp_set_num_threads(1)
    quiet = {"log": lambda m: None}
    print("ready", flush=True)
    if op == "add":
        model = make_model()
        model.forward = slowed(model.forward, delay)  # instance attribute: nn.Module.__call__ finds it
        add_documents(model, DOCS_B, out, PROVENANCE, shard_batches=2, progress=False, **quiet)
    else:
        removal.write_documents = slowed(removal.write_documents, delay)
        removal.write_array = slowed(removal.write_array, delay)
        generations.atomic_write = slowed(generations.atomic_write, delay)
        if op == "remove":
            records = Datastore.documents_of(out, Datastore.open(out).manifest)
            removal.remove_documents(out, [r.doc_id for r in records[-len(DOCS_B):]], **quiet)
        else:
            removal.compact(out, progress=False, **quiet)
    print("finished", flush=True)


if __name__ == "__main__":
    main()
