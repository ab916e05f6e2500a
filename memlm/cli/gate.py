"""`memlm train-gate`: fit adaptive retrieval's gate (He et al. 2021; memlm.retrieval.adaptive) for a model and
a datastore on a tuning split, and write it as a directory (gate.pt + settings.json) for `memlm eval
--adaptive-gate DIR --adaptive-threshold X | --adaptive-fraction F`.

A command of its own rather than a `memlm train` mode: nothing of the LM trains, and it needs the
datastore's searches for its labels. The documents fitted on are recorded in settings.json and an
evaluation sharing one is refused (memlm.cli.fewer_searches.open_gate), as a tuning split is.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from memlm.errors import MemlmError
from memlm.cli.options import KNN_OPTIONS, add_options, knn_config, positive_int


def add_train_gate_parser(sub: Any) -> None:
    from memlm.retrieval.adaptive import OBJECTIVES, GateConfig

    g = GateConfig()
    p = sub.add_parser("train-gate", help="fit adaptive retrieval's gate (when to search) on a tuning split")
    p.add_argument("--model", required=True, help="the model evaluated with the gate (as `eval --model`)")
    p.add_argument("--datastore", required=True, help="the datastore evaluated with the gate")
    p.add_argument("--data", required=True, help="tuning corpus (never the evaluation documents)")
    p.add_argument("--split", default=None, help="tuning documents, e.g. \"2001<=year<=2002\"")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on tuning tokens")
    p.add_argument("--out", required=True, help="gate directory to write (gate.pt, settings.json)")
    p.add_argument("--hidden", type=positive_int, default=None, help=f"hidden units (default {g.hidden})")
    p.add_argument("--steps", type=positive_int, default=None, help=f"full-batch fit steps (default {g.steps})")
    p.add_argument("--with-key", action="store_true", default=None,
                   help="feed the whole kNN key too (default: the distribution features and the key's projection)")
    p.add_argument("--key-components", type=int, default=None,
                   help=f"principal components of the key fed to the gate, 0 for none (default {g.key_components})")
    p.add_argument("--objective", choices=OBJECTIVES, default=None,
                   help=f"mixture: predict lambda(x) by the kNN-LM likelihood (He et al. 2021); weighted_label: "
                        f"the sign of the gain weighted by its size (default {g.objective})")
    p.add_argument("--batch-size", type=positive_int, default=4, help="windows per forward pass")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_options(p, "kNN-LM (the labels: how much kNN-LM beats the base at this lambda and T)", KNN_OPTIONS)
    p.set_defaults(func=cmd_train_gate)


def cmd_train_gate(args: argparse.Namespace) -> None:
    from datastore import Datastore
    from memlm.cli.eval import load_tokens
    from memlm.jobs.adaptive_train import train_gate
    from memlm.jobs.windows import WindowConfig
    from memlm.model.device import resolve_device
    from memlm.model.tokenizer import document_boundary
    from memlm.model.weights import load_pretrained
    from memlm.retrieval.adaptive import GateConfig, save_gate
    from memlm.retrieval.compat import check_searcher

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise MemlmError(f"--out {out} exists and is not empty; choose a new directory")
    knn = knn_config(args, allow_auto=True)
    base = GateConfig()
    config = dataclasses.replace(base, hidden=args.hidden or base.hidden, steps=args.steps or base.steps,
                                 use_key=bool(args.with_key), objective=args.objective or base.objective,
                                 key_components=base.key_components if args.key_components is None
                                 else args.key_components)
    device = resolve_device(args.device)
    pretrained = load_pretrained(args.model, device=device)
    model, boundary = pretrained.model, document_boundary(pretrained.tokenizer)
    tuning = load_tokens(pretrained.tokenizer, args.data, args.split, args.max_tokens)
    store = Datastore.open(Path(args.datastore), device=str(device))
    info = store.info()
    window = WindowConfig(context=info.context, stride=info.stride, batch_size=args.batch_size)  # the keys' windows
    check_searcher(info, model_fingerprint=pretrained.fingerprint, tokenizer_fingerprint=pretrained.tokenizer.fingerprint,
                   dim=model.config.n_embd, key_layer=model.config.key_description, boundary_token=boundary,
                   context=window.context, stride=window.stride)
    gate, settings = train_gate(model, tuning.token_docs, tuning.fingerprints, store, window, knn, boundary, config,
                                model_fingerprint=pretrained.fingerprint, tune_data=f"{args.data} {args.split or 'all'}",
                                progress=not args.quiet)
    save_gate(gate, settings, out)
    print(f"{out}: fitted on {settings.tokens} tokens of {len(tuning.token_docs)} documents, retrieval helps "
          f"{settings.positive_rate:.1%} of them, accuracy {settings.accuracy:.3f} (T {settings.temperature:g})")
