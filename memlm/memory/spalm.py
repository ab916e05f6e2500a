"""SPALM (Yogatama et al. 2021, "Adaptive Semiparametric Language Models").

Short-term memory is the Transformer-XL memory of every layer (memlm.memory.xl); long-term memory is the
kNN datastore that kNN-LM reads (the same Searcher, the same keys: the datastore's key layer, by default
the input of the last layer's feed-forward block, memlm.model.config.ModelConfig.key_description). Only
the head differs from kNN-LM: instead of interpolating two distributions, the retrieved next tokens'
embeddings are aggregated by attention and mixed with the final hidden state by a learned gate
(section 3 of the paper):

    y_k = W[v_k]                           the output embeddings of the k retrieved next tokens
    m_t = sum_k softmax_k(y_k . h_t) y_k    h_t: final hidden state (after the final norm, before lm_head)
    g_t = sigmoid(w_g . h_t + b)
    z_t = (1 - g_t) m_t + g_t h_t           logits = lm_head(z_t)

W is the output embedding matrix (the input embedding when tied, as in the paper). A row without any
valid neighbour takes g_t = 1, so z_t = h_t: exactly the base model's logits; so does g_t forced to 1
(b = +inf). The learned parameters (`SpalmHead`: w_g and b) live outside the Decoder's state_dict, like
the memorizing layer's KnnAttention, and are saved beside a checkpoint (spalm_head.pt).

Shape legend: B batch rows, T segment tokens, k neighbours, C model width, V vocab, Q searched positions.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from memlm.model.decoder import Decoder, DecoderState
from memlm.retrieval.searcher import Neighbors, Searcher, SearchOptions, search_keys

SPALM_DEFAULT_K = 8
"""Neighbours per token when --k is unset. SPALM reads k embeddings per token (a (k, C) gather and
attention), not a distribution over k entries as kNN-LM (KNNLMConfig.k = 1024), so a handful suffices."""


SPALM_HEAD_FILE = "spalm_head.pt"
"""The SpalmHead parameters beside a checkpoint (memlm.model.checkpoint layout)."""
GATE_BIAS_INIT = 4.0
"""Initial gate bias: g = sigmoid(4) = 0.982 with w_g = 0, so training starts next to the base model
(z ~ h) and the gate learns how much to trust the retrieved tokens (as the memorizing gate does)."""


class SpalmHead(nn.Module):
    """SPALM's gate: w_g (C,) and a bias b; g = sigmoid(w_g . h + b)."""

    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.n_embd = n_embd
        self.w_g = nn.Parameter(torch.zeros(n_embd))  # (C,)
        self.bias = nn.Parameter(torch.tensor(GATE_BIAS_INIT))  # ()

    def gate(self, h: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
        """h (B, T, C), has (B, T) bool (a valid neighbour exists) -> g (B, T); 1 where has is False."""
        g = torch.sigmoid(h @ self.w_g.to(h.dtype) + self.bias.to(h.dtype))  # (B, T)
        return torch.where(has, g, torch.ones_like(g))

    def forward(self, h: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor,
                embedding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h (B, T, C) final hidden states, tokens (B, T, k) int64 retrieved next tokens (any value where
        not valid), valid (B, T, k) bool, embedding W (V, C) -> (z (B, T, C), g (B, T))."""
        if h.shape[-1] != self.n_embd or embedding.shape[-1] != self.n_embd:
            raise ValueError(f"SPALM head made for width {self.n_embd}, got h {h.shape[-1]}, W {embedding.shape[-1]}")
        y = F.embedding(tokens.clamp(min=0), embedding).to(h.dtype)  # (B, T, k, C)
        scores = torch.einsum("btc,btkc->btk", h, y)  # (B, T, k)
        # A finite fill keeps rows without neighbours finite (their weights are zeroed, their gate is 1).
        scores = scores.masked_fill(~valid, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores.float(), dim=-1).to(h.dtype) * valid  # (B, T, k)
        m = torch.einsum("btk,btkc->btc", weights, y)  # (B, T, C)
        g = self.gate(h, valid.any(dim=-1))  # (B, T)
        z = (1 - g)[..., None] * m + g[..., None] * h  # (B, T, C); g = 1 gives h exactly
        return z, g

    def check_model(self, n_embd: int) -> None:
        """Refuse a head made for another model width (one line naming both)."""
        if self.n_embd != n_embd:
            raise ValueError(f"SPALM head made for width {self.n_embd}, the model has {n_embd}")


def save_spalm_head(head: SpalmHead, directory: str | Path, keys_fingerprint: str) -> Path:
    """Write spalm_head.pt into `directory`: parameters, width, and the fingerprint of the model whose keys
    the datastore holds (training may change the decoder's own fingerprint; the keys stay fixed)."""
    path = Path(directory) / SPALM_HEAD_FILE
    torch.save({"n_embd": head.n_embd, "state_dict": head.state_dict(), "keys_fingerprint": keys_fingerprint}, path)
    return path


def load_spalm_head(directory: str | Path, device: torch.device | str = "cpu") -> tuple[SpalmHead, str] | None:
    """(the SpalmHead saved beside a checkpoint, the keys' model fingerprint it was trained with), or None."""
    path = Path(directory) / SPALM_HEAD_FILE
    if not path.is_file():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=True)
    head = SpalmHead(int(saved["n_embd"]))
    head.load_state_dict(saved["state_dict"])
    return head.to(device), str(saved["keys_fingerprint"])


class SpalmOutput(NamedTuple):
    """One SPALM segment: logits of every position, the gate, and the decoder's new memory state."""

    logits: torch.Tensor  # (B, T, V)
    gate: torch.Tensor  # (B, T) g_t (1 where no neighbour, and at positions not searched)
    state: DecoderState | None
    has_neighbours: torch.Tensor  # (B, T) bool
    # The segment's search (after the filter): rows the searched positions, row-major; search_k columns,
    # nearest first, of which the head read the first k (kNN-LM reads them all: memlm.jobs.spalm).
    neighbors: Neighbors | None = None  # (Q, search_k) arrays


NeighborsFilter = Callable[[Neighbors], Neighbors]
"""Applied to a segment's neighbours (rows: the searched positions, row-major) before the head reads them,
e.g. the leakage guard (memlm.retrieval.leakage.exclude_nearby with the positions' documents bound)."""


def final_hidden(model: Decoder, idx: torch.Tensor, state: DecoderState | None) -> tuple[torch.Tensor, torch.Tensor, DecoderState | None]:
    """Run the decoder on a segment without its output head: (h (B, T, C) the final norm's output, the
    kNN key (B, T, C), the new state). h is read by a forward hook on model.norm, so the decoder stays
    untouched (lm_head's input is exactly this tensor); logits_from=T skips the base output head."""
    captured: list[torch.Tensor] = []
    hook = model.norm.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        out = model(idx, state, logits_from=idx.shape[1])
    finally:
        hook.remove()
    return captured[-1], out.knn_key, out.state  # (B, T, C), (B, T, C)


def spalm_forward(
    model: Decoder, head: SpalmHead, idx: torch.Tensor, state: DecoderState | None, searcher: Searcher, k: int,
    search_mask: torch.Tensor, options: SearchOptions | None = None, neighbors_filter: NeighborsFilter | None = None,
    search_k: int | None = None,
) -> SpalmOutput:
    """One segment of SPALM: the decoder with its (XL) memory, ONE batched search of the kNN keys of the
    positions in search_mask (B, T) bool, and the head over the retrieved tokens.

    idx: (B, T) token ids. Retrieval is not differentiable: the keys are detached (search_keys) and the
    datastore's keys are fixed; gradients reach h (the decoder), W and the head.
    search_k: neighbours searched per position (>= k; None: k), returned in SpalmOutput.neighbors; the
    head reads the k nearest of them (a search's rows are sorted), so SPALM + kNN-LM searches once."""
    search_k = k if search_k is None else search_k
    if search_k < k:
        raise ValueError(f"search_k {search_k} is less than the head's k {k}")
    h, key, new_state = final_hidden(model, idx, state)  # (B, T, C) each
    B, T = idx.shape
    tokens = torch.full((B, T, k), -1, dtype=torch.long, device=h.device)  # (B, T, k)
    flat = search_mask.to(h.device).reshape(-1)  # (B*T,)
    nb = Neighbors(np.zeros((0, search_k), np.float32), np.zeros((0, search_k), np.int64),
                   np.zeros((0, search_k), np.int32))  # (0, search_k): nothing searched
    if bool(flat.any()):
        nb = search_keys(searcher, key.reshape(B * T, -1)[flat], search_k, options)  # (Q, search_k) arrays
        if neighbors_filter is not None:
            nb = neighbors_filter(nb)
        found = np.where(nb.ids[:, :k] >= 0, nb.values[:, :k], -1).astype(np.int64)  # (Q, k)
        tokens = tokens.reshape(B * T, k)
        tokens[flat] = torch.from_numpy(found).to(h.device)
        tokens = tokens.reshape(B, T, k)  # (B, T, k)
    valid = tokens >= 0  # (B, T, k)
    z, g = head(h, tokens, valid, model.lm_head.weight)  # (B, T, C), (B, T)
    return SpalmOutput(model.lm_head(z), g, new_state, valid.any(dim=-1), nb)  # logits (B, T, V)
