"""Segment-recurrent evaluation over long documents (Transformer-XL style) and the segment stream it shares
with training.

A document is cut into consecutive segments of S tokens; each segment is run once, attending to the
memory left by the earlier segments of its document (none / XL / compressive / memorizing, memlm.memory), so every
token is scored exactly once at the cost of one segment plus the memory, instead of re-encoding a
sliding window per scored token (the Transformer-XL paper's evaluation speedup).

As in memlm.jobs.windows, each document is preceded by one boundary token (memlm.model.tokenizer.document_boundary) so its
first real token is predicted too; inputs are sequence[:-1], targets sequence[1:].

Batch rows are independent streams of documents: when a row's document ends, the row takes the next
document and its memory row is reset (`reset_rows`), so no state crosses a document boundary. The last
segment of a document is right-padded; padding is never scored, real tokens never attend to it (it
comes later, under the causal mask), and it leaves the memory with the reset that follows.

Shape legend: B rows, T segment length, V vocab, Q scored tokens of a batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from memlm.errors import MemlmError
from memlm.jobs.token_scores import score_chunk
from memlm.memory.compressive import Compressor
from memlm.model.memory_config import MemoryConfig
from memlm.model.decoder import Decoder
from memlm.model.device import synchronize

if TYPE_CHECKING:
    from memlm.memory.memorizing import KnnAttention
    from memlm.memory.knn_store import KeyValueMemoryFactory


class SegmentBatch(NamedTuple):
    inputs: torch.Tensor  # (B, T) int64 token ids (padding: the boundary token)
    targets: torch.Tensor  # (B, T) int64 next tokens
    mask: torch.Tensor  # (B, T) bool, True where a real target is scored
    reset: torch.Tensor  # (B,) bool, True where this segment starts a new document (or the row is idle)


class SegmentStream:
    """Deals the segments of documents to B rows, in document order, each row one document at a time.

    loop=False: every document once; rows with nothing left idle (mask all False) until all are done.
    loop=True: documents repeat in order forever (training); `epoch` counts passes.
    `position()` / `position=` save and restore where the stream is (for resuming training).
    """

    def __init__(
        self,
        docs: Sequence[Sequence[int]],
        batch_size: int,
        segment: int,
        boundary_token: int,
        loop: bool = False,
        position: dict[str, Any] | None = None,
    ) -> None:
        if segment < 1:
            raise MemlmError(f"--segment must be at least 1, got {segment}")
        self.docs = [d for d in docs if len(d) > 0]
        if not self.docs:
            raise MemlmError("no non-empty documents to evaluate or train on")
        self.batch_size = batch_size
        self.segment = segment
        self.boundary_token = boundary_token
        self.loop = loop
        if position is None:
            self.row_doc = [-1] * batch_size  # document index per row, -1: idle
            self.row_offset = [0] * batch_size  # next input position within the row's document
            self.next_doc = 0
            self.epoch = 0
        else:
            self.row_doc = list(position["row_doc"])
            self.row_offset = list(position["row_offset"])
            self.next_doc = int(position["next_doc"])
            self.epoch = int(position["epoch"])

    def position(self) -> dict[str, Any]:
        return {"row_doc": list(self.row_doc), "row_offset": list(self.row_offset),
                "next_doc": self.next_doc, "epoch": self.epoch}

    def _take_doc(self) -> int:
        if self.next_doc >= len(self.docs):
            if not self.loop:
                return -1
            self.next_doc = 0
            self.epoch += 1
        d = self.next_doc
        self.next_doc += 1
        return d

    def next_batch(self) -> SegmentBatch | None:
        B, T = self.batch_size, self.segment
        inputs = torch.full((B, T), self.boundary_token, dtype=torch.long)
        targets = torch.full((B, T), self.boundary_token, dtype=torch.long)
        mask = torch.zeros(B, T, dtype=torch.bool)
        reset = torch.zeros(B, dtype=torch.bool)
        any_real = False
        for r in range(B):
            d = self.row_doc[r]
            if d < 0 or self.row_offset[r] >= len(self.docs[d]):  # the row's document is finished
                d = self._take_doc()
                self.row_doc[r], self.row_offset[r] = d, 0
                reset[r] = True
            if d < 0:
                continue
            tokens = self.docs[d]
            n_inputs = len(tokens)  # boundary + tokens has len(tokens) + 1 entries, inputs drop the last
            lo = self.row_offset[r]
            hi = min(lo + T, n_inputs)
            # sequence = [boundary, *tokens]; inputs sequence[lo:hi], targets sequence[lo+1:hi+1]
            seq_in = [self.boundary_token, *tokens[: hi - 1]] if lo == 0 else list(tokens[lo - 1 : hi - 1])
            inputs[r, : hi - lo] = torch.tensor(seq_in, dtype=torch.long)
            targets[r, : hi - lo] = torch.tensor(tokens[lo:hi], dtype=torch.long)
            mask[r, : hi - lo] = True
            self.row_offset[r] = hi
            any_real = True
        if not any_real:
            return None
        return SegmentBatch(inputs, targets, mask, reset)


def attention_cost(memory: MemoryConfig, segment: int, n_layer: int) -> dict[str, float]:
    """The attention span and cost that a segment-recurrent run pays per query (full memory)."""
    slots = memory.memory_slots
    past = 0 if memory.kind == "none" else memory.history_tokens - memory.sink_tokens
    return {
        "memory_slots": slots,  # keys besides the segment, per query and layer
        "attention_span": slots + segment,  # most keys one query attends to
        "mean_keys_per_query": slots + (segment + 1) / 2,  # causal segment: on average half of it
        "history_tokens": memory.history_tokens,  # earlier tokens one layer's memory covers
        # Each layer can look `past` tokens further back than the one below (Dai et al. 2019, O(N x L)).
        "effective_reach": past * n_layer + segment,
    }


def evaluate_segments(
    model: Decoder,
    token_docs: Sequence[Sequence[int]],
    segment: int,
    memory: str = MemoryConfig.kind,
    *,
    boundary_token: int,
    mem_len: int = MemoryConfig.mem_len,
    cmem_len: int = MemoryConfig.cmem_len,
    compress_rate: int = MemoryConfig.compress_rate,
    compress_fn: str = MemoryConfig.compress_fn,
    sink_tokens: int = MemoryConfig.sink_tokens,
    batch_size: int = 1,
    compressor: Compressor | None = None,
    reproject: bool | None = None,
) -> dict[str, Any]:
    """`evaluate_memory` with the memory given field by field (defaults: MemoryConfig's).

    boundary_token: prepended to every document; callers with a tokenizer pass
        memlm.model.tokenizer.document_boundary(tokenizer). Required: no second home for that rule.
    """
    try:
        mcfg = MemoryConfig(memory, mem_len, cmem_len, compress_rate, compress_fn, sink_tokens, segment)
    except ValueError as e:
        raise MemlmError(str(e)) from None
    return evaluate_memory(model, token_docs, mcfg, boundary_token=boundary_token, batch_size=batch_size,
                           compressor=compressor, reproject=reproject)


def evaluate_memory(
    model: Decoder,
    token_docs: Sequence[Sequence[int]],
    memory: MemoryConfig,
    *,
    boundary_token: int,
    batch_size: int = 1,
    compressor: Compressor | None = None,
    reproject: bool | None = None,
    knn_attention: KnnAttention | None = None,
    service: KeyValueMemoryFactory | None = None,
    gate_trained: bool = True,
) -> dict[str, Any]:
    """Segment-recurrent perplexity of `model` over `token_docs` (token ids per document).

    memory: kind "none" (each memory.segment-token segment alone), "xl", "compressive" or "memorizing",
        with its sizes.
    boundary_token: prepended to every document (memlm.model.tokenizer.document_boundary).
    reproject: the memory keeps layer inputs and re-projects keys and values (memlm.memory.xl.XLMemory);
        None: only when the conv compressor compresses layer inputs (one trained by memlm train). For
        fixed weights it changes nothing for XL or mean pooling (projection is linear), only the cost.
    knn_attention, service: the memorizing layer's parameters and the retrieval-service memory factory
        (memlm.jobs.memorizing.open_memory); gate_trained: recorded (False for a fresh, untrained gate).
    Returns perplexity, nll (nats/token), tokens, seconds, tokens_per_s, the settings and the attention cost
    (memorizing: also the kNN memory size, top-k, backend, layer and mean gate per head).
    """
    from memlm.jobs.memorizing import close_memory, memorizing_record, open_memory

    mcfg, segment = memory, memory.segment
    if segment > model.config.max_seq_len:
        raise MemlmError(f"--segment {segment} is longer than the model supports ({model.config.max_seq_len})")
    if mcfg.kind == "compressive" and mcfg.compress_fn == "conv" and compressor is None:
        raise MemlmError("--compress-fn conv needs a trained compressor (a checkpoint from memlm train)")
    device = model.device
    # Rows past the number of documents would only ever be idle (masked) work: one long document with
    # --batch-size 4 ran 4x the forward for the same result.
    batch_size = max(1, min(batch_size, sum(1 for d in token_docs if len(d) > 0)))
    stream = SegmentStream(token_docs, batch_size, segment, boundary_token)
    if reproject is None:
        reproject = compressor is not None and compressor.space == "x"
    state = open_memory(model, mcfg, batch_size, compressor=compressor, knn_attention=knn_attention, service=service,
                        reproject=reproject)
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    n_tokens = 0
    was_training = model.training
    model.eval()
    synchronize(device)
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            while (batch := stream.next_batch()) is not None:
                if state is not None:
                    state = state.reset_rows(batch.reset.to(device))
                out = model(batch.inputs.to(device), state)
                state = out.state
                mask = batch.mask.to(device)  # (B, T)
                scores = score_chunk(out.logits[mask], batch.targets.to(device)[mask])  # (Q,): the real targets
                nll_sum -= scores.base.double().sum()
                n_tokens += int(mask.sum())
    finally:
        close_memory(state)
    synchronize(device)
    seconds = time.perf_counter() - t0
    model.train(was_training)
    nll = float(nll_sum) / max(n_tokens, 1)
    compressive = mcfg.kind == "compressive"
    return {
        "memory": mcfg.kind, "segment": segment, "mem_len": mcfg.mem_len if mcfg.kind != "none" else 0,
        "cmem_len": mcfg.cmem_len if compressive else 0,
        "compress_rate": mcfg.compress_rate if compressive else 0,
        "compress_fn": mcfg.compress_fn if compressive else None,
        "sink_tokens": mcfg.sink_tokens if mcfg.kind != "none" else 0,
        "boundary_token": boundary_token,
        "documents": len(stream.docs), "tokens": n_tokens, "nll": nll, "perplexity": math.exp(nll),
        "seconds": seconds, "tokens_per_s": n_tokens / seconds if seconds > 0 else float("inf"),
        **attention_cost(mcfg, segment, model.config.n_layer),
        **memorizing_record(mcfg, model.config.n_layer, knn_attention, gate_trained),
    }

