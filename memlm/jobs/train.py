"""`memlm train`: segment-recurrent training with a Transformer-XL, compressive or memorizing memory.

Long documents are read in order, segment after segment, with the memory carried across segments
(truncated backpropagation through time: the memory is stored detached, so gradients stay inside the
segment, as in Dai et al. 2019). Batch rows are independent document streams (memlm.jobs.segment_eval).

Modes:
- from scratch on a preset ("tiny", "small"), seeded random init; or from pretrained weights (anything
  memlm.model.weights.load_pretrained accepts: "smollm2-135m", a .gguf, a HF directory, a checkpoint);
- compressor only: the model is frozen and only the Conv1d compressor (memlm.memory.compressive) trains, by
  the attention-reconstruction loss (Rae et al. 2019), which always trains it with a compressive memory;
- memorizing (Wu et al. 2022): KnnAttention (per-head gate and scale) trains beside the model;
  fine-tuning trains the gate alone (--knn-train gate, the decoder bit-identical) or also the blocks from
  the memorizing layer up (top); knn_attention.pt beside the checkpoint (memlm.jobs.memorizing);
- SPALM (Yogatama et al. 2021; memlm.jobs.spalm_train): the XL memory plus the SPALM head over a
  datastore that the caller opens and passes in; the head, W and optionally the top blocks train.

AdamW (weight decay on matrices only), linear warmup then cosine decay to min_lr, gradient-norm clipping,
bfloat16 autocast on CUDA, periodic segment-recurrent evaluation, checkpoints (memlm.model.checkpoint) that
carry the model config, this TrainConfig and the TextSettings (boundary token, memory, segment, sink
tokens) that `memlm eval` and `serve lm` reproduce, and exact resume (optimizer, step, data position, memory).

Shape legend: B rows, T segment length, V vocab.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from memlm.errors import MemlmError
from memlm.jobs.memorizing import (
    close_memory,
    fresh_knn_attention,
    knn_parameters,
    open_memory,
    recorded_memory,
    resolved_knn_train,
    restore_memory,
    save_knn_attention,
    saved_knn_attention,
    select_trainable,
)
from memlm.jobs.segment_eval import SegmentStream, evaluate_memory
from memlm.memory.compressive import CompressiveMemory, Compressor
from memlm.model.memory_config import MemoryConfig
from memlm.memory.reconstruction import attention_reconstruction_loss, capture_queries
from memlm.model.checkpoint import TextSettings
from memlm.model.config import PRESETS
from memlm.model.decoder import Decoder
from memlm.model.device import resolve_device
from memlm.model.tokenizer import document_boundary

TRAINER_FILE = "trainer.pt"
COMPRESSOR_FILE = "compressor.pt"


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; stored in every checkpoint (extra.json["train_config"])."""

    model: str = "tiny"
    """Preset name (with init="scratch"), or anything load_pretrained accepts (init="pretrained")."""
    init: str = "scratch"
    """"scratch": seeded random weights of the preset; "pretrained": load `model`."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Memory carried across segments during training and evaluation, with the segment length T (the unit
    of truncated backpropagation); defaults are MemoryConfig's, the same as `memlm eval` and `serve lm`."""
    batch_size: int = 4
    """Rows B: independent document streams."""
    steps: int = 200
    """Optimizer steps in total (a resumed run continues up to this step)."""
    lr: float = 1e-3
    """Peak learning rate (after warmup)."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Linear warmup from 0 to lr."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, on matrices only (not norms, biases)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    compressor_only: bool = False
    """Freeze the model; train only the conv compressor by the reconstruction loss."""
    reconstruction_weight: float = 1.0
    """Weight of the attention-reconstruction loss (it reaches only the compressor)."""
    eval_every: int = 0
    """Evaluate every this many steps (0: only at the end, when eval documents are given)."""
    checkpoint_every: int = 0
    """Write the checkpoint every this many steps (0: only at the end, when out_dir is set)."""
    out_dir: str | None = None
    """Checkpoint directory (memlm.model.checkpoint layout plus trainer.pt, compressor.pt)."""
    log_every: int = 10
    """Log a progress line every this many steps."""
    seed: int = 0
    """Seed of the random init (scratch)."""
    device: str = "auto"
    """"auto" (cuda when available), "cpu" or "cuda[:N]" (memlm.model.device.resolve_device)."""
    data: str | None = None
    """Corpus spec for memlm.data.documents.load_documents (when no token lists are passed)."""
    train_split: str | None = None
    """Split expression of the training documents."""
    eval_split: str | None = None
    """Split expression of the evaluation documents (None: no evaluation from the corpus)."""
    max_train_tokens: int | None = None
    """Read at most this many training tokens from the corpus (documents in order)."""
    max_eval_tokens: int | None = None
    """Read at most this many evaluation tokens."""
    knn_train: str | None = None
    """Memorizing fine-tuning (init "pretrained"): "gate" (only the KnnAttention parameters) or "top" (and
    the decoder blocks from the memorizing layer up); None: memlm.jobs.memorizing.DEFAULT_KNN_TRAIN. Must be
    None otherwise (from scratch everything trains)."""
    datastore: str | None = None
    """SPALM (memory kind "spalm", memlm.jobs.spalm_train): the datastore directory, recorded; the command
    line opens it and passes it to `train`. Required by SPALM, refused otherwise."""
    spalm_k: int | None = None
    """SPALM: neighbours per token; None: memlm.memory.spalm.SPALM_DEFAULT_K."""
    freeze_embeddings: bool = False
    """SPALM: train the head only (w_g, b), not the output embedding W."""
    spalm_train_top: int | None = None
    """SPALM: also train the top N decoder blocks and the final norm, as far as the keys allow (memlm.jobs.spalm.
    spalm_trainable: nothing that makes the datastore's key); None: none."""
    head_lr: float | None = None
    """Peak learning rate of the memory's gate (SPALM's w_g, b; the memorizing layer's KnnAttention), on the
    same schedule scaled by head_lr / lr; None: lr. A gate starting saturated (sigmoid(4)) barely moves at
    an lr made for W (2e-4) in a few hundred steps. Only with --memory spalm or memorizing."""

    def __post_init__(self) -> None:
        if self.init not in ("scratch", "pretrained"):
            raise MemlmError(f"init must be 'scratch' or 'pretrained', got {self.init!r}")
        if self.init == "scratch" and self.model not in PRESETS:
            raise MemlmError(f"training from scratch needs a preset ({', '.join(sorted(PRESETS))}), got {self.model!r}")
        if self.compressor_only and not (self.memory.kind == "compressive" and self.memory.compress_fn == "conv"):
            raise MemlmError("--compressor-only needs --memory compressive --compress-fn conv")
        if self.batch_size < 1 or self.steps < 0:
            raise MemlmError("batch_size must be >= 1, steps >= 0")
        resolved_knn_train(self.memory, self.init, self.knn_train)  # refuses a knn_train that does not apply
        if self.head_lr is not None and (self.memory.kind not in ("spalm", "memorizing") or min(self.head_lr, self.lr) <= 0):
            raise MemlmError(f"--head-lr (> 0, with --lr > 0) applies to --memory spalm or memorizing, not {self.memory.kind}")
        if self.memory.kind == "spalm" or (self.datastore, self.spalm_k, self.spalm_train_top) != (None,) * 3 or self.freeze_embeddings:
            from memlm.jobs.spalm import check_spalm_train

            check_spalm_train(self.memory, self.init, self.datastore, self.spalm_k, self.freeze_embeddings, self.spalm_train_top)

    @property
    def trains(self) -> str:
        """What the LM loss trains: memlm.jobs.memorizing.TRAIN_ALL, "gate" or "top" (resolved_knn_train)."""
        return resolved_knn_train(self.memory, self.init, self.knn_train)

    def lr_scale(self, head: bool) -> float:
        """The factor on lr_at of a parameter group: head_lr / lr for the memory's gate (head), else 1."""
        return self.head_lr / self.lr if head and self.head_lr is not None else 1.0

    @property
    def segment(self) -> int:
        """Tokens per segment T (memory.segment)."""
        return self.memory.segment

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        d = dict(d)
        memory = dict(d["memory"])
        if "segment" in d:  # checkpoints written before the segment moved into MemoryConfig
            memory["segment"] = d.pop("segment")
        d["memory"] = MemoryConfig(**memory)
        d["betas"] = tuple(d["betas"])
        return cls(**d)


@dataclass(frozen=True)
class TrainResult:
    step: int
    """Steps done in total (including those before a resume)."""
    losses: list[float]
    """Language-modelling loss (nats/token) of each step run in this call."""
    reconstruction_losses: list[float]
    """Attention-reconstruction loss of each step (0 without compression)."""
    evals: list[dict[str, Any]]
    """evaluate_memory results, each with its "step"."""
    tokens: int
    """Training tokens scored in this call."""
    checkpoint: str | None
    """Where the last checkpoint was written."""
    model: Decoder
    """The trained model (train mode)."""
    compressor: Compressor | None
    """The trained conv compressor, when the memory has one."""
    knn_attention: Any = None
    """The trained KnnAttention module (memlm.memory.memorizing), with a memorizing memory."""


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr over warmup_steps, then cosine decay to min_lr at cfg.steps."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def _optimizer(model: Decoder, compressor: Compressor | None, knn_attention: Any, cfg: TrainConfig) -> torch.optim.AdamW:
    groups = []
    if not cfg.compressor_only:
        params = [p for p in model.parameters() if p.requires_grad]
        # Decay matrices (embeddings, projections); not norm gains (nanoGPT's split).
        groups.append({"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay})
        groups.append({"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0})
    if compressor is not None:
        groups.append({"params": list(compressor.parameters()), "weight_decay": 0.0})
    # Gate logits and retrieval scales: per-head scalars, never decayed (decay would pull the gate to 0.5).
    groups.append({"params": knn_parameters(knn_attention), "weight_decay": 0.0})
    groups = [g for g in groups if g["params"]]
    fused = {"fused": True} if model.device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, **fused)


def load_compressor(directory: str | Path, device: str | torch.device = "cpu") -> Compressor | None:
    """The trained compressor saved beside a checkpoint, or None when the run had none."""
    path = Path(directory) / COMPRESSOR_FILE
    if not path.is_file():
        return None
    from memlm.model.config import ModelConfig

    saved = torch.load(path, map_location="cpu", weights_only=True)
    comp = Compressor(ModelConfig.from_dict(json.loads(saved["model_config"])), int(saved["rate"]),
                      saved.get("space", "kv"))
    comp.load_state_dict(saved["state_dict"])
    return comp.to(device)


def _load_data(cfg: TrainConfig, tokenizer: Any) -> tuple[list[list[int]], list[list[int]] | None]:
    from memlm.data.documents import load_documents, tokenize_documents

    if cfg.data is None:
        raise MemlmError("no training data: pass --data (a corpus name or file)")
    train = list(tokenize_documents(load_documents(cfg.data, cfg.train_split), tokenizer, cfg.max_train_tokens))
    evals = None
    if cfg.eval_split is not None:
        evals = list(tokenize_documents(load_documents(cfg.data, cfg.eval_split), tokenizer, cfg.max_eval_tokens))
    return train, evals


def train(
    config: TrainConfig,
    train_docs: Sequence[Sequence[int]] | None = None,
    eval_docs: Sequence[Sequence[int]] | None = None,
    resume_from: str | Path | None = None,
    log: Callable[[str], None] | None = None,
    stop_at: int | None = None,
    make_run: Callable[[TrainConfig, Path | None, Callable[[str], None]], _Run] | None = None,
) -> TrainResult:
    """Train per `config`; token lists (one per document) may be given instead of config.data.

    resume_from: a checkpoint directory written by this function; training continues from its step,
        optimizer state, data position and memory, exactly as if it had not stopped. Its memory
        (with the segment) and batch size must equal config's.
    log: called with one line per progress report (default: stderr).
    stop_at: stop after this global step (checkpoint written as at the end) although the schedule runs
        to config.steps: a time-boxed piece of a longer run, to be continued with resume_from.
    make_run: builds the run in place of this module's (memlm.jobs.spalm_train.train_spalm passes SPALM's,
        which needs the opened datastore: the library never opens a datastore itself).
    """
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    resume = Path(resume_from) if resume_from is not None else None
    if config.memory.kind == "spalm" and make_run is None:
        raise MemlmError("--memory spalm trains through memlm.jobs.spalm_train.train_spalm (it takes the datastore)")
    run = (make_run or _Run)(config, resume, log)
    if train_docs is None:
        train_docs, corpus_eval = _load_data(config, run.tokenizer)
        eval_docs = eval_docs if eval_docs is not None else corpus_eval
    return run.run(train_docs, eval_docs, stop_at)


def _model_for(config: TrainConfig, resume_from: Path | None, device: torch.device) -> tuple[Any, dict | None]:
    """The Pretrained to train (a resumed checkpoint, or config.model) and the saved trainer state."""
    from memlm.model.checkpoint import load_checkpoint, read_extra
    from memlm.model.weights import load_pretrained

    if resume_from is None:
        return load_pretrained(config.model, device), None
    extra = read_extra(resume_from)
    if "train_config" not in extra or not (resume_from / TRAINER_FILE).is_file():
        raise MemlmError(f"{resume_from} is not a checkpoint of memlm train (no trainer state)")
    saved = TrainConfig.from_dict(extra["train_config"])
    for name in ("memory", "batch_size", "compressor_only", "knn_train", "datastore", "spalm_k", "freeze_embeddings",
                 "spalm_train_top"):
        if getattr(saved, name) != getattr(config, name):
            raise MemlmError(f"cannot resume: checkpoint has {name}={getattr(saved, name)}, run asks {getattr(config, name)}")
    state = torch.load(resume_from / TRAINER_FILE, map_location=device, weights_only=True)
    return load_checkpoint(resume_from, device), state


class _Run:
    """One training run: model, compressor, optimizer, data stream and memory, and the loop over steps."""

    def __init__(self, config: TrainConfig, resume_from: Path | None, log: Callable[[str], None]) -> None:
        from memlm.model.weights import random_model

        self.config, self.resume_from, self.log = config, resume_from, log
        self.device = resolve_device(config.device)
        pre, self.trainer_state = _model_for(config, resume_from, self.device)
        self.fingerprint = pre.fingerprint  # of the weights loaded (SPALM checks its datastore's keys against it)
        self.model, self.tokenizer = pre.model, pre.tokenizer
        if config.init == "scratch" and resume_from is None:
            self.model = random_model(self.model.config, config.seed, self.device, torch.float32)
        self.model.train()
        self.compressor = self._compressor()
        self.knn_attention = self._knn_attention()
        select_trainable(self.model, config.memory, config.trains)  # --knn-train gate|top freeze the rest
        if config.compressor_only:
            self.model.requires_grad_(False)
        # The one document-boundary rule: train, eval, the datastore builder and the server agree.
        self.boundary = document_boundary(self.tokenizer)
        self.opt = _optimizer(self.model, self.compressor, self.knn_attention, config)
        self.head_ids = {id(p) for p in knn_parameters(self.knn_attention)}  # the gate's, on head_lr (a subclass sets its own)
        self.evals: list[dict[str, Any]] = []
        self.step = 0

    def _compressor(self) -> Compressor | None:
        mcfg = self.config.memory
        if not (mcfg.kind == "compressive" and mcfg.compress_fn == "conv"):
            return None
        if self.resume_from is None:
            # Space "x": training memories re-project keys and values, so they keep and compress layer inputs.
            return Compressor(self.model.config, mcfg.compress_rate, space="x").to(self.device)
        loaded = load_compressor(self.resume_from, self.device)
        if loaded is None:
            raise MemlmError(f"{self.resume_from} has no {COMPRESSOR_FILE}")
        return loaded

    def _knn_attention(self) -> Any:
        """The memorizing layer's parameters: fresh (gate near 0: training starts at the base model), or
        the resumed checkpoint's."""
        if self.config.memory.kind != "memorizing":
            return None
        if self.resume_from is None:
            return fresh_knn_attention(self.model)
        loaded = saved_knn_attention(self.resume_from, self.device)
        if loaded is None:
            raise MemlmError(f"{self.resume_from} has no saved kNN attention (knn_attention.pt)")
        return loaded

    def _start(self, train_docs: Sequence[Sequence[int]]) -> None:
        """Data stream and memory, fresh or restored from the trainer state."""
        cfg, vocab = self.config, self.model.config.vocab_size
        if any(t < 0 or t >= vocab for d in train_docs for t in d):
            raise MemlmError(f"training tokens must be in [0, {vocab}) for model {self.model.config.name}")
        saved = self.trainer_state
        self.stream = SegmentStream(train_docs, cfg.batch_size, cfg.segment, self.boundary, loop=True,
                                    position=saved["data_position"] if saved is not None else None)
        # reproject: Transformer-XL computes the memory's keys and values with the current weights, so that
        # W_k and W_v learn from attention to the memory (memlm.memory.xl.XLMemory explains what breaks without).
        # --knn-train gate freezes every W_k and W_v: cached keys are the same keys, for less work.
        self.state = open_memory(self.model, cfg.memory, cfg.batch_size, compressor=self.compressor,
                                 knn_attention=self.knn_attention, reproject=cfg.trains != "gate")
        if saved is not None:
            self.opt.load_state_dict(saved["optimizer"])
            if saved["memory"] is not None:
                self.state = restore_memory(saved["memory"], self.model, cfg.memory, cfg.batch_size,
                                            compressor=self.compressor, knn_attention=self.knn_attention)
            self.step = int(saved["step"])
        # Clip the model and the compressor each on its own norm: they minimise different losses (LM vs
        # attention reconstruction), and one global norm let the compressor's gradients shrink the model's
        # steps (a conv-compressive run trained worse than one without memory).
        compressor_ids = {id(p) for p in self.compressor.parameters()} if self.compressor is not None else set()
        trainable = [p for g in self.opt.param_groups for p in g["params"]]
        self.clip_groups = [grp for grp in ([p for p in trainable if id(p) not in compressor_ids],
                                            [p for p in trainable if id(p) in compressor_ids]) if grp]

    def _begin_step(self) -> Any:
        """Set this step's learning rate and take the next batch (a SegmentBatch; the stream loops)."""
        for g in self.opt.param_groups:  # a group is all gate or none (_optimizer, SpalmRun)
            g["lr"] = lr_at(self.step, self.config) * self.config.lr_scale(id(g["params"][0]) in self.head_ids)
        batch = self.stream.next_batch()
        assert batch is not None  # loop=True never runs dry
        return batch

    def _autocast(self) -> Any:
        """bf16 autocast on CUDA; nothing on CPU."""
        if self.device.type == "cuda":
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _optimize(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss`, clip each clip group on its own norm, take the optimizer step (the caller
        zeroes the gradients)."""
        loss.backward()
        if self.config.grad_clip > 0:
            for grp in self.clip_groups:
                torch.nn.utils.clip_grad_norm_(grp, self.config.grad_clip)
        self.opt.step()

    def _train_step(self) -> tuple[float, float, int]:
        """One optimizer step on the next batch: (LM loss, reconstruction loss, tokens scored)."""
        cfg, device, model = self.config, self.device, self.model
        batch = self._begin_step()
        inputs, targets, mask = (t.to(device) for t in (batch.inputs, batch.targets, batch.mask))  # (B, T) each
        state = self.state.reset_rows(batch.reset.to(device)) if self.state is not None else None
        compressing = cfg.memory.kind == "compressive"
        with self._autocast(), (capture_queries(model) if compressing else contextlib.nullcontext([])) as queries:
            out = model(inputs, state)
        lm_loss = F.cross_entropy(out.logits.float()[mask], targets[mask])  # mean over scored tokens
        rec = torch.zeros((), device=device)
        if compressing and isinstance(out.state, CompressiveMemory):
            rec = attention_reconstruction_loss(out.state, queries, model)
        loss = ((0.0 if cfg.compressor_only else lm_loss)
                + cfg.reconstruction_weight * (rec if self.compressor is not None else 0.0))
        if torch.is_tensor(loss) and loss.requires_grad:
            self._optimize(loss)
        self.opt.zero_grad(set_to_none=True)
        self.state = out.state
        self.step += 1
        return float(lm_loss.detach()), float(rec.detach()), int(batch.mask.sum())

    def evaluate(self, eval_docs: Sequence[Sequence[int]] | None) -> None:
        if not eval_docs:
            return
        r = evaluate_memory(self.model, eval_docs, self.config.memory, boundary_token=self.boundary,
                            batch_size=self.config.batch_size, compressor=self.compressor, reproject=True,
                            knn_attention=self.knn_attention)
        self.model.train()
        r["step"] = self.step
        self.evals.append(r)
        self.log(f"eval step {self.step}: perplexity {r['perplexity']:.3f} over {r['tokens']} tokens")

    def save(self) -> str:
        """The checkpoint: model, tokenizer, TextSettings, TrainConfig, trainer state (and the compressor)."""
        from memlm.model.checkpoint import save_checkpoint

        cfg, model, compressor = self.config, self.model, self.compressor
        assert cfg.out_dir is not None
        extra = {"train_config": cfg.to_dict(), "step": self.step, "data_position": self.stream.position(),
                 "last_eval": self.evals[-1] if self.evals else None}

        def write(tmp: Path) -> None:
            torch.save({"optimizer": self.opt.state_dict(), "step": self.step, "data_position": self.stream.position(),
                        "memory": None if self.state is None else self.state.state_dict()}, tmp / TRAINER_FILE)
            self.write_modules(tmp)
            if compressor is not None:
                torch.save({"state_dict": compressor.state_dict(), "rate": compressor.rate, "space": compressor.space,
                            "model_config": json.dumps(model.config.to_dict())}, tmp / COMPRESSOR_FILE)
            if self.knn_attention is not None:
                save_knn_attention(self.knn_attention, tmp)

        return str(save_checkpoint(cfg.out_dir, model, self.tokenizer, extra, write_files=write,
                                   settings=TextSettings(boundary_token=self.boundary, memory=recorded_memory(
                                       cfg.memory, model.config.n_layer))))

    def write_modules(self, tmp: Path) -> None:
        """Learned modules beside the decoder that a subclass saves into the checkpoint (SPALM's head)."""

    def run(self, train_docs: Sequence[Sequence[int]], eval_docs: Sequence[Sequence[int]] | None,
            stop_at: int | None) -> TrainResult:
        cfg = self.config
        self._start(train_docs)
        losses: list[float] = []
        rec_losses: list[float] = []
        tokens, checkpoint = 0, None
        t_log, tok_log = time.perf_counter(), 0
        last = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
        while self.step < last:
            lm_loss, rec, n_tok = self._train_step()
            tokens += n_tok
            tok_log += n_tok
            losses.append(lm_loss)
            rec_losses.append(rec)
            step = self.step
            if cfg.log_every and (step % cfg.log_every == 0 or step == cfg.steps):
                now = time.perf_counter()
                self.log(f"step {step}/{cfg.steps} loss {lm_loss:.4f} rec {rec:.3g} lr {lr_at(step - 1, cfg):.2e} "
                         f"epoch {self.stream.epoch} tok/s {tok_log / max(now - t_log, 1e-9):.0f}")
                t_log, tok_log = now, 0
            if cfg.eval_every and step % cfg.eval_every == 0 and step < last:
                self.evaluate(eval_docs)
            if cfg.out_dir and cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < last:
                checkpoint = self.save()
        self.evaluate(eval_docs)
        if cfg.out_dir:
            checkpoint = self.save()
            self.log(f"checkpoint written to {checkpoint}")
        close_memory(self.state)  # the run's kNN store (saved above with the trainer state when local)
        return TrainResult(self.step, losses, rec_losses, self.evals, tokens, checkpoint, self.model, self.compressor,
                           self.knn_attention)
