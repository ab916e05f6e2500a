"""Memorizing Transformer memory (Wu et al. 2022, "Memorizing Transformers").

A memorizing memory is the Transformer-XL memory of every layer (memlm.memory.xl: the paper keeps an
XL cache of the previous segment) plus, at one layer (`memorizing_layer`, about three quarters up),
kNN attention over a large FIFO memory of the document's earlier keys and values:

- after each segment, that layer's L2-normalised un-rotated keys and its values are appended to a
  KeyValueMemory (memlm.memory.knn_store) with one stream per (batch row, kv head); the memory
  holds strictly the past, evicts FIFO at knn_mem_size entries and is cleared per row at a document
  boundary (`reset_rows`);
- in the layer, each query head's normalised un-rotated query retrieves the top-k keys of its kv
  head's stream (GQA), attends to them with a learned per-head scale, and a learned per-head gate mixes
  that with the local attention: out_h = g_h * memory_h + (1 - g_h) * local_h (memlm.model.decoder.
  Attention). Rotary: none in the memory branch (see KnnRetrieval.attend).

The learned parameters (`KnnAttention`) live outside the Decoder's state_dict, like the conv
Compressor, and are saved beside a checkpoint (knn_attention.pt). The memory state holds the store:
stores are mutable (a FAISS index or a remote session cannot be copied per step), so a state whose
`update` or `reset_rows` ran is consumed and refuses reuse; the returned state carries on.

Shape legend: B batch rows, T segment tokens, nh query heads, nkv key/value heads, G = nh / nkv query
heads per kv head, hs head size, S = B * nkv streams, Q = G * T queries per stream, k retrieved entries.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from memlm.memory.xl import XLMemory
from memlm.model.config import ModelConfig
from memlm.model.decoder import LayerMemory
from memlm.memory.knn_store import KeyValueMemory

KNN_ATTENTION_FILE = "knn_attention.pt"
"""The KnnAttention parameters beside a checkpoint (memlm.model.checkpoint layout)."""
GATE_INIT = -4.0
"""Initial gate logit: g = sigmoid(-4) = 0.018, so fine-tuning a pretrained model starts next to the
model without memory and the gate learns how much to trust the memory."""
SCALE_INIT = 20.0
"""Initial scale (inverse temperature) of the normalised scores, in [-1, 1] before scaling: a softmax
over cosine similarities needs a large scale to be peaked; 20 as in query-key normalisation (Henry et al.
2020) and lucidrains' memorizing-transformers-pytorch. Learned per head, as its logarithm."""
LOCAL_BACKENDS = ("exact", "faiss", "ivf")
"""Backends whose contents a state_dict can carry (a service memory lives on its server)."""


class KnnAttention(nn.Module):
    """The memorizing layer's parameters: per query head a gate logit and a log scale.

    g_h = sigmoid(gate_logit_h); a gate logit of -inf (or one below about -104 in float32) gives
    g_h = 0 exactly, and then the layer's output is exactly the local attention."""

    def __init__(self, n_head: int, n_kv_head: int, head_dim: int) -> None:
        super().__init__()
        if n_head % n_kv_head != 0:
            raise ValueError(f"n_head ({n_head}) must be a multiple of n_kv_head ({n_kv_head})")
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, head_dim
        self.gate_logit = nn.Parameter(torch.full((n_head,), GATE_INIT))  # (nh,)
        self.log_scale = nn.Parameter(torch.full((n_head,), math.log(SCALE_INIT)))  # (nh,)

    def gate(self) -> torch.Tensor:
        """(nh,) mix weights in [0, 1]."""
        return torch.sigmoid(self.gate_logit)

    def shape(self) -> dict[str, int]:
        return {"n_head": self.n_head, "n_kv_head": self.n_kv_head, "head_dim": self.head_dim}

    def check_model(self, config: ModelConfig) -> None:
        """Refuse a module made for another model shape (one line naming both)."""
        want = {"n_head": config.n_head, "n_kv_head": config.n_kv_head, "head_dim": config.head_dim}
        if self.shape() != want:
            raise ValueError(f"kNN attention made for heads {self.shape()}, the model has {want}")


def new_knn_attention(config: ModelConfig) -> KnnAttention:
    """A fresh KnnAttention for `config`'s heads (gate at GATE_INIT, scale SCALE_INIT)."""
    return KnnAttention(config.n_head, config.n_kv_head, config.head_dim)


def mean_gate(module: KnnAttention) -> list[float]:
    """g_h per query head (for evaluation results)."""
    return [float(g) for g in module.gate().detach().cpu()]


def save_knn_attention(module: KnnAttention, directory: str | Path) -> Path:
    """Write knn_attention.pt (parameters and head shape) into `directory`; returns its path."""
    path = Path(directory) / KNN_ATTENTION_FILE
    torch.save({"shape": module.shape(), "state_dict": module.state_dict()}, path)
    return path


def load_knn_attention(directory: str | Path, device: torch.device | str = "cpu") -> KnnAttention | None:
    """The KnnAttention saved beside a checkpoint, or None when the run had none."""
    path = Path(directory) / KNN_ATTENTION_FILE
    if not path.exists():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=True)
    module = KnnAttention(**saved["shape"])
    module.load_state_dict(saved["state_dict"])
    return module.to(device)


class KnnRetrieval:
    """What the memorizing layer reads: its store, top-k and parameters (memlm.model.decoder.KnnRetrieval)."""

    def __init__(self, store: KeyValueMemory, module: KnnAttention, top_k: int) -> None:
        self.store, self.module, self.top_k = store, module, top_k

    def attend(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (B, nh, T, hs) queries BEFORE rotary -> (memory attention (B, nh, T, hs), gate (B, nh, T)).

        Rotary positions are left out of the memory branch: retrieved keys come from arbitrarily far
        back, where a relative rotation has no meaning the model ever learned (rotary angles at distances
        of 10^4..10^5 tokens are effectively random phases), and Wu et al. 2022 use no positional signal
        for the memory (their keys and queries are normalised and compared by content only). So keys are
        stored un-rotated and the un-rotated query searches and scores them.
        The gate is g_h where the query's stream holds entries and 0 where it holds none (an empty
        memory gives exactly the local attention)."""
        B, nh, T, hs = q.shape
        m = self.module
        nkv, G = m.n_kv_head, nh // m.n_kv_head
        if nh != m.n_head or hs != m.head_dim:
            raise ValueError(f"kNN attention made for {m.n_head} heads of {m.head_dim}, the layer has {nh} of {hs}")
        qn = F.normalize(q, dim=-1).reshape(B * nkv, G * T, hs)  # (S, Q, hs); head h = j * G + g -> kv head j
        got = self.store.search(qn, self.top_k)  # keys, values (S, Q, k, hs), valid (S, Q, k)
        scale = m.log_scale.exp().to(q.dtype).view(1, nkv, G, 1).expand(B, nkv, G, T).reshape(B * nkv, G * T)  # (S, Q)
        scores = torch.einsum("sqd,sqkd->sqk", qn, got.keys) * scale[..., None]  # (S, Q, k)
        # A finite fill keeps all-empty rows finite (uniform weights, then zeroed by `valid`).
        scores = scores.masked_fill(~got.valid, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores.float(), dim=-1).to(q.dtype) * got.valid  # (S, Q, k)
        out = torch.einsum("sqk,sqkd->sqd", weights, got.values)  # (S, Q, hs)
        out = out.reshape(B, nkv, G, T, hs).reshape(B, nh, T, hs)  # (B, nh, T, hs)
        has = got.valid.any(dim=-1).reshape(B, nh, T)  # (B, nh, T)
        gate = m.gate().to(q.dtype)[None, :, None] * has  # (B, nh, T)
        return out, gate


def stream_entries(segment: LayerMemory) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A segment's un-rotated keys and values (B, T, nkv, hs) as store entries: normalised keys (S, T, hs),
    values (S, T, hs), valid (S, T), stream = b * nkv + j. Detached: the memory is non-differentiable."""
    B, T, nkv, hs = segment.k.shape
    keys = F.normalize(segment.k.detach(), dim=-1).transpose(1, 2).reshape(B * nkv, T, hs)  # (S, T, hs)
    values = segment.v.detach().transpose(1, 2).reshape(B * nkv, T, hs)  # (S, T, hs)
    valid = segment.valid[:, None, :].expand(B, nkv, T).reshape(B * nkv, T)  # (S, T)
    return keys, values, valid


class MemorizingMemory:
    """The XL memory of every layer plus the kNN memory of one layer; a DecoderState.

    Batch rows are independent documents: the XL part keeps per-row positions, and `reset_rows` clears
    only those rows' kNN streams. Mutable store, so: a state whose `update` or `reset_rows` ran is
    consumed and refuses reuse (its store has moved on); carry on with the state they return."""

    def __init__(self, xl: XLMemory, layer: int, store: KeyValueMemory, module: KnnAttention, top_k: int,
                 backend: str) -> None:
        B = int(xl.next_pos.shape[0])
        if store.streams != B * module.n_kv_head or store.dim != module.head_dim or store.value_dim != module.head_dim:
            raise ValueError(f"kNN store of {store.streams} streams of {store.dim}/{store.value_dim} does not fit "
                             f"{B} rows x {module.n_kv_head} kv heads of {module.head_dim}")
        self.xl, self.layer, self.store, self.module = xl, layer, store, module
        self.top_k, self.backend = top_k, backend
        self.consumed = False

    def _live(self) -> None:
        if self.consumed:
            raise ValueError("this memorizing memory state was consumed by update() or reset_rows() (its kNN store "
                             "has moved on); use the state they returned")

    def _next(self, xl: XLMemory) -> MemorizingMemory:
        self.consumed = True
        return MemorizingMemory(xl, self.layer, self.store, self.module, self.top_k, self.backend)

    # -- DecoderState protocol --
    def positions(self, batch_size: int, seq_len: int, device: torch.device) -> torch.Tensor:
        self._live()
        return self.xl.positions(batch_size, seq_len, device)  # (B, T)

    def layer_memory(self, layer: int) -> LayerMemory | None:
        self._live()
        local = self.xl.layer_memory(layer)
        if layer != self.layer:
            return local
        if local is None:
            # No local memory yet: an empty one carries the retrieval (attention keeps its causal fast path).
            B, nkv, hs = int(self.xl.next_pos.shape[0]), self.module.n_kv_head, self.module.head_dim
            device = self.xl.next_pos.device
            kv = torch.zeros(B, 0, nkv, hs, device=device)  # (B, 0, nkv, hs)
            local = LayerMemory(kv, kv, torch.zeros(B, 0, device=device), torch.zeros(B, 0, dtype=torch.bool, device=device))
        return local._replace(knn=KnnRetrieval(self.store, self.module, self.top_k))

    def update(self, new_kv: list[LayerMemory]) -> MemorizingMemory:
        """The XL update, and this segment's keys and values appended to the kNN memory (after the
        segment attended: the memory holds strictly the past)."""
        self._live()
        xl = self.xl.update(new_kv)
        self.store.append(*stream_entries(new_kv[self.layer]))
        return self._next(xl)

    def reset_rows(self, mask: torch.Tensor) -> MemorizingMemory:
        """A new document starts in rows where mask (B,) is True: their XL slots and kNN streams are cleared."""
        self._live()
        xl = self.xl.reset_rows(mask)
        rows = mask.bool().cpu()  # (B,)
        if bool(rows.any()):
            self.store.clear(rows.repeat_interleave(self.module.n_kv_head))  # (S,) stream b * nkv + j
        return self._next(xl)

    def knn_sizes(self) -> torch.Tensor:
        """(B, nkv) entries each row's kNN streams hold."""
        return self.store.sizes().view(-1, self.module.n_kv_head)

    def state_dict(self) -> dict:
        """The XL part, the layer, top-k and backend, and the kNN memory's contents for local backends
        (exact, faiss). A "service" memory lives on its server and is not saved: a resumed run starts
        that memory empty (recorded as store None) while the XL part and positions continue."""
        self._live()
        store = self.store.state_dict() if self.backend in LOCAL_BACKENDS else None  # type: ignore[attr-defined]
        return {"kind": "memorizing", "xl": self.xl.state_dict(), "layer": self.layer, "top_k": self.top_k,
                "backend": self.backend, "capacity": self.store.capacity, "store": store}
