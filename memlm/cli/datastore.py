"""`memlm datastore ...`: build, inspect, add to, remove from and compact datastores (the command line's
datastore group; memlm.cli registers it). Each command imports `datastore` only when it runs, so the
command line starts without FAISS.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from memlm.model.hf_model import KEY_MODULE_HELP
from memlm.cli.options import WEIGHTS_OPTIONS, WINDOW_OPTIONS, add_options, positive_int


def cmd_datastore_build(args: argparse.Namespace) -> None:
    from datastore import build_datastore
    from datastore.ray_build import RayOptions
    from memlm.errors import MemlmError

    if args.workers is not None and args.ray is None:
        raise MemlmError("--workers sets the Ray build's workers: pass --ray local|auto|ADDRESS too")

    out = build_datastore(
        model=args.model, data=args.data, out=Path(args.out), split=args.split, max_tokens=args.max_tokens,
        index=args.index, context=args.context, stride=args.stride, batch_size=args.batch_size,
        device=args.device, dtype=args.dtype, overwrite=args.overwrite, nprobe=args.nprobe,
        progress=not args.quiet, num_shards=args.shards, key_module=args.key_module, on_disk=args.on_disk,
        ray=None if args.ray is None else RayOptions(address=args.ray, workers=args.workers), weights=args.weights,
        allow_pickle_weights=bool(args.allow_pickle_weights),
    )
    print(out)


def cmd_datastore_info(directory: str, verify: bool) -> None:
    from datastore import datastore_info

    print(datastore_info(Path(directory), verify=verify))


def cmd_datastore_docs(directory: str, where: str | None) -> None:
    from datastore import datastore_docs

    print(datastore_docs(Path(directory), where))


def cmd_datastore_add(args: argparse.Namespace) -> None:
    from datastore import add_to_datastore

    add_to_datastore(Path(args.directory), args.data, split=args.split, model=args.model, device=args.device,
                     dtype=args.dtype, progress=not args.quiet)


def cmd_datastore_remove(directory: str, doc_ids: list[str] | None, where: str | None) -> None:
    from datastore.removal import remove_documents

    remove_documents(Path(directory), doc_ids, where)


def cmd_datastore_compact(directory: str, quiet: bool) -> None:
    from datastore.removal import compact

    compact(Path(directory), progress=not quiet)



def add_datastore_parser(sub: Any) -> None:
    p = sub.add_parser("datastore", help="build and inspect kNN-LM datastores")
    dsub = p.add_subparsers(dest="datastore_command", required=True, metavar="ACTION")
    b = dsub.add_parser("build", help="corpus -> (key, next token) pairs -> FAISS index; resumable (run it again)")
    b.add_argument("--model", required=True, help="preset, .gguf file, HF or memlm checkpoint dir")
    b.add_argument("--key-module", default=None, metavar="PATH", help=KEY_MODULE_HELP)
    b.add_argument("--data", required=True, help="fetched corpus name or a .txt/.jsonl/.json/.parquet file")
    b.add_argument("--out", required=True, help="datastore directory to write")
    b.add_argument("--split", default=None, help="documents to use (see memlm eval --help)")
    b.add_argument("--max-tokens", type=int, default=None, help="cap on tokens stored")
    b.add_argument("--index", default=None, help='FAISS factory string, e.g. "IVF4096,PQ64" (default: chosen from N and d)')
    b.add_argument("--nprobe", type=positive_int, default=None, help="default IVF lists probed at search time")
    b.add_argument("--batch-size", type=positive_int, default=4, help="windows per forward pass")
    b.add_argument("--device", default="auto", help="auto, cpu or cuda")
    b.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    b.add_argument("--overwrite", action="store_true", help="replace a finished datastore in --out")
    b.add_argument("--shards", type=int, default=1,
                   help="write N datastores over contiguous document runs (for memlm serve router)")
    b.add_argument("--on-disk", action="store_true",
                   help="keep the IVF index's inverted lists in a memory-mapped file (index.ivfdata) for "
                        "building and serving indexes larger than memory (needs an IVF --index)")
    b.add_argument("--ray", default=None, metavar="local|auto|ADDRESS",
                   help="encode (and add --on-disk blocks) on Ray workers: local starts Ray here, auto joins the "
                        "running cluster, else its HOST:PORT; the datastore written is the same")
    b.add_argument("--workers", type=positive_int, default=None,
                   help="Ray encoder actors (default: one per GPU, else one per CPU of the cluster)")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    add_options(b, "windows the keys are computed with", WINDOW_OPTIONS)
    add_options(b, "model", WEIGHTS_OPTIONS)
    b.set_defaults(func=cmd_datastore_build)
    i = dsub.add_parser("info", help="print a datastore's manifest")
    i.add_argument("directory")
    i.add_argument("--verify", action="store_true", help="check every file as opening the datastore does "
                   "(sizes, SHA-256, arrays, index); without it nothing is verified")
    i.set_defaults(func=lambda a: cmd_datastore_info(a.directory, a.verify))
    d = dsub.add_parser("docs", help="list a datastore's documents (index, doc_id, tokens, metadata)")
    d.add_argument("directory")
    d.add_argument("--where", default=None, help="documents whose metadata pass this --split expression, "
                   "e.g. 'president=Lincoln' or 'year>=1990[:5]'")
    d.set_defaults(func=lambda a: cmd_datastore_docs(a.directory, a.where))
    a = dsub.add_parser("add", help="encode new documents with the datastore's model and windows; commits a "
                        "new generation (resumable: run it again)")
    a.add_argument("directory")
    a.add_argument("--data", required=True, help="fetched corpus name or a .txt/.jsonl/.json/.parquet file")
    a.add_argument("--split", default=None, help="documents to add (see memlm eval --help); ones already "
                   "present (same text) are skipped")
    a.add_argument("--model", default=None, help="default: the datastore's model (another one is refused)")
    a.add_argument("--device", default="auto", help="auto, cpu or cuda")
    a.add_argument("--dtype", default=None, help="default: the dtype the datastore was built in")
    a.add_argument("--quiet", action="store_true", help="no progress bars")
    a.set_defaults(func=cmd_datastore_add)
    r = dsub.add_parser("remove", help="make documents' entries unreachable at once (new generation); "
                        "compact frees them")
    r.add_argument("directory")
    which = r.add_mutually_exclusive_group(required=True)
    which.add_argument("--doc-id", nargs="+", default=None, help="doc_id(s) as memlm datastore docs lists them")
    which.add_argument("--where", default=None, help="documents whose metadata pass this --split expression")
    r.set_defaults(func=lambda a: cmd_datastore_remove(a.directory, a.doc_id, a.where))
    c = dsub.add_parser("compact", help="drop removed documents' entries from disk (new generation)")
    c.add_argument("directory")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(func=lambda a: cmd_datastore_compact(a.directory, a.quiet))
