"""`memlm train --memory spalm --datastore DIR`: fine-tune SPALM (Yogatama et al. 2021).

The segments, XL memory, schedule, clipping, checkpoints and resume are memlm.jobs.train's (`SpalmRun` is
its `_Run` with another step). What trains: the head (w_g, b, at --head-lr) and the output embedding W (the input
embedding too when tied) unless --freeze-embeddings, and with --spalm-train-top N what of the top N blocks
and the final norm lies after the key layer (memlm.jobs.spalm.spalm_trainable); every other decoder weight
is frozen and stays bit-identical, and the datastore's keys are fixed (the paper keeps the keys of the
pretrained model; with tied embeddings a trained W moves the query keys a little, --freeze-embeddings not).
Per segment, one batched search of the scored positions' kNN keys, as in evaluation (memlm.jobs.spalm).

Leakage guard: when a training document is itself in the datastore, a query's nearest entries are its
own position's and its neighbours' (their values are the answer, or tokens right next to it), and the
gate would learn to copy them. Every neighbour from the query's document within `leakage_window`
positions is dropped (memlm.retrieval.leakage.exclude_nearby, with the datastore's provenance; a
datastore without provenance is refused with its rebuild command). Which datastore document a training
document is goes by identity: its text's fingerprint against the datastore's documents table
(leakage.document_indices; every copy of a text held twice is guarded), so a split written differently
that selects the same documents keeps the guard on. A datastore older than the table falls back to the
corpus fingerprint (the same corpus and split: document i is datastore document i), said in the log.
The head is saved beside the checkpoint (spalm_head.pt) with the fingerprint of the model whose keys the
datastore holds, which `memlm eval --memory spalm` checks the datastore against.

Shape legend: B rows, T segment length, V vocab, Q searched positions, k neighbours.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from memlm.errors import MemlmError
from memlm.jobs.segment_eval import SegmentBatch
from memlm.jobs.spalm import (
    datastore_token_counts,
    evaluate_spalm,
    select_spalm_trainable,
)
from memlm.jobs.train import TrainConfig, _Run
from memlm.memory.spalm import (
    NeighborsFilter,
    SpalmHead,
    load_spalm_head,
    save_spalm_head,
    spalm_forward,
)
from memlm.retrieval.leakage import copy_level, document_indices, exclude_nearby
from memlm.retrieval.searcher import Neighbors, Provenance, SearcherInfo, SearchOptions


class SpalmDatastore(Protocol):
    """What SPALM training reads from its datastore: a Searcher with each entry's provenance and values
    (datastore.Datastore answers it)."""

    values: Any  # (N,) int32 next tokens

    def search(self, xq: np.ndarray, k: int, options: SearchOptions | None = None) -> Neighbors: ...

    def info(self) -> SearcherInfo: ...

    def provenance(self, ids: np.ndarray) -> Provenance: ...

    def documents(self) -> Sequence[Any]:
        """The documents table in index order, records with a `fingerprint` (datastore.DocumentRecord);
        raises MemlmError for a datastore format that predates it."""
        ...


def datastore_fingerprints(store: SpalmDatastore) -> list[str] | None:
    """The fingerprint of each datastore document in index order, or None for a datastore whose format
    predates the documents table (datastore.Datastore.documents refuses those in one line)."""
    try:
        records = store.documents()
    except MemlmError:  # the only refusal of documents() once opened: the format predates the table
        return None
    return [r.fingerprint for r in records]


def leakage_window(info: SearcherInfo) -> int:
    """How near (in positions) an entry of the query's own document leaks: the datastore's window length,
    the farthest an entry's key can have seen the query's answer from (keys see `context` tokens back)."""
    return info.context


def leakage_filter(store: SpalmDatastore, query_docs: torch.Tensor, query_positions: torch.Tensor,
                   window: int) -> NeighborsFilter:
    """The guard of one segment: its searched positions' documents and positions (Q,) (datastore order,
    boundary = position 0) bound to exclude_nearby over the store's provenance."""

    def guard(nb: Neighbors) -> Neighbors:
        return exclude_nearby(nb, store.provenance(nb.ids), query_docs, query_positions, window)

    return guard


def batch_provenance(batch: SegmentBatch, row_doc: Sequence[int], row_end: Sequence[int],
                     doc_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(docs, positions) (Q,) of a segment's scored targets, row-major: row r's document in datastore order
    (doc_ids[stream index]) and each target's index in [boundary, *document] (the stream's row_offset
    after the batch is the end of the row's inputs: target t of a row with n scored is at end - n + t + 1)."""
    mask = batch.mask  # (B, T)
    B, T = mask.shape
    n = mask.sum(dim=1)  # (B,)
    docs = torch.tensor([doc_ids[d] if d >= 0 else -1 for d in row_doc], dtype=torch.long)  # (B,)
    start = torch.tensor(list(row_end), dtype=torch.long) - n  # (B,)
    pos = start[:, None] + torch.arange(T)[None, :] + 1  # (B, T)
    return docs[:, None].expand(B, T)[mask], pos[mask]  # (Q,), (Q,)


class SpalmRun(_Run):
    """memlm.jobs.train's run with the SPALM head: its step, its evaluation and spalm_head.pt."""

    def __init__(self, config: TrainConfig, resume_from: Path | None, log: Callable[[str], None],
                 store: SpalmDatastore | None) -> None:
        from memlm.memory.spalm import SPALM_DEFAULT_K
        from memlm.retrieval.compat import check_searcher

        if store is None:
            raise MemlmError("--memory spalm needs its datastore opened (memlm train --datastore DIR)")
        super().__init__(config, resume_from, log)
        self.store, self.k = store, config.spalm_k or SPALM_DEFAULT_K
        self.head, self.keys_fingerprint = self._head()
        info = store.info()
        check_searcher(info, model_fingerprint=self.keys_fingerprint, tokenizer_fingerprint=self.tokenizer.fingerprint,
                       dim=self.model.config.n_embd, key_layer=self.model.config.key_description,
                       boundary_token=self.boundary)
        # The decoder is frozen but for W and what --spalm-train-top N allows above the key layer: the query
        # keys stay the pretrained model's, as the datastore's are (spalm_trainable says why).
        trained = select_spalm_trainable(self.model, config.spalm_train_top, config.freeze_embeddings)
        self.opt = self._spalm_optimizer()
        self.head_ids = {id(p) for p in self.head.parameters()}  # on --head-lr (TrainConfig.lr_scale)
        self.window = leakage_window(info)
        log(f"spalm: k {self.k}, {'frozen' if config.freeze_embeddings else 'trained'} embeddings, "
            f"trained blocks {' '.join(t.rstrip('.') for t in trained) or 'none'}, head lr "
            f"{config.lr * config.lr_scale(True):.3g}")

    def _head(self) -> tuple[SpalmHead, str]:
        if self.resume_from is None:
            return SpalmHead(self.model.config.n_embd).to(self.device), self.fingerprint
        saved = load_spalm_head(self.resume_from, self.device)
        if saved is None:
            raise MemlmError(f"{self.resume_from} has no SPALM head (spalm_head.pt)")
        return saved

    def _document_indices(self, stream_docs: Sequence[Sequence[int]]) -> tuple[list[list[int]], str]:
        """Each training document's datastore document indices (leakage.document_indices) and how they
        were found, for the log line. stream_docs: the non-empty training documents, in stream order."""
        from memlm.data.documents import corpus_fingerprint, load_tokenized

        cfg, table = self.config, datastore_fingerprints(self.store)
        if table is None:  # an older datastore: document i of the same corpus and split is its document i
            same = cfg.data is not None and corpus_fingerprint(cfg.data, cfg.train_split) == self.store.info().corpus_fingerprint
            return ([[i] for i, d in enumerate(self.train_docs) if len(d) > 0] if same else [[] for _ in stream_docs],
                    "by corpus fingerprint (the datastore predates the documents table; rebuild it to match documents)")
        # The fingerprints are over the texts: tokenize the corpus again and check it gave these documents.
        corpus = load_tokenized(cfg.data, cfg.train_split, self.tokenizer, cfg.max_train_tokens) if cfg.data else None
        if corpus is None or corpus.token_docs != [list(d) for d in stream_docs]:
            return [[] for _ in stream_docs], "the training documents are token lists, not --data's texts: none to match"
        found = document_indices(table, corpus.fingerprints)
        return found, f"{sum(1 for f in found if f)} of {len(found)} training documents in the datastore, by fingerprint"

    def _spalm_optimizer(self) -> torch.optim.AdamW:
        cfg = self.config
        params = [p for p in self.model.parameters() if p.requires_grad]
        # Matrices decay, norm gains do not (memlm.jobs.train._optimizer's split); the gate's w_g and b are
        # never decayed (decay would pull the gate to 0.5).
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
                  {"params": list(self.head.parameters()), "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=cfg.betas)

    def _start(self, train_docs: Sequence[Sequence[int]]) -> None:
        super()._start(train_docs)
        self.train_docs = train_docs  # the stream skips empty documents; datastore document order counts them
        self.doc_ids, how = self._document_indices([d for d in train_docs if len(d) > 0])  # by stream index
        self.guarded = any(self.doc_ids)
        if self.guarded:
            self.store.provenance(np.full((1, 1), -1, dtype=np.int64))  # refuses a datastore without provenance now
        self.log(f"spalm: leakage guard {'on (window ' + str(self.window) + ')' if self.guarded else 'off'}: {how}")

    def _train_step(self) -> tuple[float, float, int]:
        """One optimizer step of SPALM on the next batch: (LM loss, 0.0, tokens scored)."""
        device, model = self.device, self.model
        batch = self._begin_step()
        guard = self._guard(batch) if self.guarded else None
        inputs, targets, mask = (t.to(device) for t in (batch.inputs, batch.targets, batch.mask))  # (B, T) each
        state = self.state.reset_rows(batch.reset.to(device))
        with self._autocast():
            out = spalm_forward(model, self.head, inputs, state, self.store, self.k, mask, neighbors_filter=guard)
        loss = F.cross_entropy(out.logits.float()[mask], targets[mask])  # mean over scored tokens
        self._optimize(loss)
        self.opt.zero_grad(set_to_none=True)
        self.state = out.state
        self.step += 1
        return float(loss.detach()), 0.0, int(batch.mask.sum())

    def _guard(self, batch: SegmentBatch) -> NeighborsFilter:
        """The leakage guard of one batch: one exclude_nearby pass per datastore copy of its documents."""
        levels = max(len(d) for d in self.doc_ids)
        passes = []
        for level in range(levels):
            docs, positions = batch_provenance(batch, self.stream.row_doc, self.stream.row_offset,
                                               copy_level(self.doc_ids, level))
            passes.append(leakage_filter(self.store, docs, positions, self.window))

        def guard(nb: Neighbors) -> Neighbors:
            for one in passes:
                nb = one(nb)
            return nb

        return guard

    def evaluate(self, eval_docs: Sequence[Sequence[int]] | None) -> None:
        if not eval_docs:
            return
        counts = datastore_token_counts(self.store, self.model.config.vocab_size)
        r = evaluate_spalm(self.model, self.head, eval_docs, self.config.memory, self.store, self.k,
                           boundary_token=self.boundary, token_counts=counts,
                           batch_size=self.config.batch_size)
        self.model.train()
        r["step"] = self.step
        self.evals.append(r)
        self.log(f"eval step {self.step}: perplexity {r['perplexity']:.3f}, gate {r['gate_mean']:.3f} over "
                 f"{r['tokens']} tokens")

    def write_modules(self, tmp: Path) -> None:
        save_spalm_head(self.head, tmp, self.keys_fingerprint)


def train_spalm(
    config: TrainConfig,
    searcher: SpalmDatastore,
    train_docs: Sequence[Sequence[int]] | None = None,
    eval_docs: Sequence[Sequence[int]] | None = None,
    resume_from: str | Path | None = None,
    log: Callable[[str], None] | None = None,
    stop_at: int | None = None,
) -> Any:
    """memlm.jobs.train.train for --memory spalm (the same arguments): the run with SPALM's step over
    `searcher`, the opened datastore of config.datastore (the library never opens a datastore itself)."""
    from memlm.jobs.train import train

    if searcher is None:
        raise MemlmError("--memory spalm needs its opened datastore (memlm train opens --datastore)")
    return train(config, train_docs, eval_docs, resume_from, log, stop_at,
                 make_run=lambda cfg, resume, run_log: SpalmRun(cfg, resume, run_log, searcher))
