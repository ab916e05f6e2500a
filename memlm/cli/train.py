"""`memlm train`: its flags and the TrainConfig they make (the training loop is memlm.jobs.train).

Option groups are memlm.cli.options' (memory, and the memorizing layer's --knn-* options); a memorizing
option given with another --memory kind is refused in one line there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from memlm.model.memory_config import MemoryConfig
from memlm.cli.options import (
    KNN_OPTIONS,
    KNN_TRAIN_OPTIONS,
    MEMORY_OPTIONS,
    add_options,
    memory_config,
    positive_int,
)


def cmd_train(args: argparse.Namespace) -> None:
    from memlm.jobs.train import TrainConfig, train

    config = TrainConfig(
        model=args.model, init=args.init, memory=memory_config(args, MemoryConfig()), batch_size=args.batch_size,
        steps=args.steps, lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay, grad_clip=args.grad_clip, compressor_only=args.compressor_only,
        eval_every=args.eval_every, checkpoint_every=args.checkpoint_every, out_dir=args.out,
        log_every=args.log_every, seed=args.seed, device=args.device, data=args.data,
        train_split=args.split, eval_split=args.eval_split, max_train_tokens=args.max_train_tokens,
        max_eval_tokens=args.max_eval_tokens, knn_train=args.knn_train,
        datastore=args.datastore, spalm_k=args.k, freeze_embeddings=bool(args.freeze_embeddings), head_lr=args.head_lr,
        spalm_train_top=args.spalm_train_top,
    )
    if config.memory.kind == "spalm":  # SPALM's run takes the opened datastore
        from memlm.jobs.spalm_train import train_spalm

        result = train_spalm(config, open_spalm_train_datastore(config), resume_from=args.resume)
    else:
        result = train(config, resume_from=args.resume)
    summary = {
        "step": result.step,
        "tokens": result.tokens,
        "final_loss": result.losses[-1] if result.losses else None,
        "evals": result.evals,
        "checkpoint": result.checkpoint,
    }
    print(json.dumps(summary, indent=2, default=str))


def open_spalm_train_datastore(config: Any) -> Any:
    """The datastore of a SPALM run (config.datastore), opened here: the library takes it as a Searcher."""
    if config.memory.kind != "spalm":
        return None
    from datastore import Datastore

    return Datastore.open(Path(config.datastore), device=None if config.device == "auto" else config.device)


def add_train_parser(sub: Any) -> None:
    p = sub.add_parser("train", help="train a model (from scratch or SmolLM2) with XL / compressive / memorizing memory")
    p.add_argument("--model", default="tiny", help="preset (scratch) or anything `eval --model` takes (pretrained)")
    p.add_argument("--init", default="scratch", choices=["scratch", "pretrained"])
    p.add_argument("--data", required=True, help="corpus (long documents are read in order)")
    p.add_argument("--split", default=None, help="training documents")
    p.add_argument("--eval-split", default=None, help="evaluation documents (periodic evaluation)")
    p.add_argument("--max-train-tokens", type=int, default=None)
    p.add_argument("--max-eval-tokens", type=int, default=None)
    p.add_argument("--out", default=None, help="checkpoint directory (config, weights, tokenizer, optimizer)")
    p.add_argument("--resume", default=None, help="checkpoint directory to continue from")
    add_options(p, f"memory carried across segments (default --memory {MemoryConfig.kind}; the segment is the "
                "truncated-backpropagation unit)", MEMORY_OPTIONS)
    add_options(p, "memorizing fine-tuning (--memory memorizing --init pretrained)", KNN_TRAIN_OPTIONS)
    spalm = p.add_argument_group("SPALM (--memory spalm --init pretrained: Yogatama et al. 2021)")
    spalm.add_argument("--datastore", default=None, help="datastore directory: SPALM's long-term memory")
    add_options(p, "SPALM neighbours (--memory spalm)", KNN_OPTIONS, ("k",))
    spalm.add_argument("--freeze-embeddings", action="store_true", default=None,
                       help="train the SPALM gate only, not the output embedding W")
    spalm.add_argument("--spalm-train-top", type=positive_int, default=None, metavar="N",
                       help="also train the top N decoder blocks and the final norm, only what lies after the "
                            "datastore's key layer (that layer's block: its feed-forward; default: none)")
    p.add_argument("--compressor-only", action="store_true", help="freeze the model, train the conv compressor")
    p.add_argument("--batch-size", type=positive_int, default=4, help="independent document streams")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--head-lr", type=float, default=None,
                   help="peak learning rate of the memory's gate (--memory spalm: w_g, b; memorizing: the kNN "
                        "attention's gate and scale), same schedule scaled by HEAD_LR/LR (default: --lr)")
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.set_defaults(func=cmd_train)
