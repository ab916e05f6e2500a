"""SPALM rows in the engine (Yogatama et al. 2021): an XL row whose next-token logits come
from SPALM's head instead of the decoder's.

The rules are memlm.memory.spalm.spalm_forward's at the one searched position of a step (the last prompt
token, then every generated token, as memlm.jobs.spalm_scoring.spalm_step): the final hidden state h (the
final norm's output, memlm.memory.spalm.final_hidden) and the kNN key of each ready row; the k nearest
next tokens of the key; their output embeddings aggregated by attention and mixed with h by the head's
gate; logits = lm_head(z). The rows of a step search once per distinct search options (of the largest k
asked: a row that asked fewer keeps its nearest k, sorted results, as memlm.engine.sampling.search_rows).

Shape legend: B ready rows, C model width, k neighbours, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from memlm.engine.requests import (
    EngineConfig,
    GenerationRequest,
    ScoreRequest,
    SpalmSettings,
)
from memlm.engine.rows import Row
from memlm.errors import MemlmError
from memlm.memory.spalm import SpalmHead, final_hidden
from memlm.model.decoder import Decoder, DecoderState, LMOutput
from memlm.retrieval.searcher import Searcher, search_keys


class Engine(Protocol):
    """What SPALM rows use of memlm.engine.engine.Engine (a protocol: that module imports this one)."""

    model: Decoder
    spalm_head: SpalmHead | None
    """The SPALM head of an engine of memory kind "spalm"; None otherwise."""
    searcher: Searcher | None

    def release(self, row: Row) -> None: ...

    def fail(self, row: Row, error: Exception) -> None: ...


def neighbour_tokens(searcher: Searcher, keys: torch.Tensor, settings: Sequence[SpalmSettings]) -> np.ndarray:
    """keys: (B, C) -> (B, k) int64 the next tokens of each row's nearest k_i entries, -1 where there is none
    (k the largest k_i). One search per distinct search options."""
    B = keys.shape[0]
    k = max(s.k for s in settings)
    tokens = np.full((B, k), -1, dtype=np.int64)  # (B, k): -1 = no neighbour
    for options in {s.options for s in settings}:
        rows = [i for i, s in enumerate(settings) if s.options == options]
        nb = search_keys(searcher, keys[rows], max(settings[i].k for i in rows), options)  # (Q, k') arrays
        for q, i in enumerate(rows):
            ki = settings[i].k
            tokens[i, :ki] = np.where(nb.ids[q, :ki] >= 0, nb.values[q, :ki], -1)  # the row's nearest ki
    return tokens


def head_of(model: Decoder, head: SpalmHead, h: torch.Tensor, tokens: np.ndarray) -> torch.Tensor:
    """h: (B, C) final hidden states, tokens: (B, k) neighbour tokens (-1: none) -> SPALM logits (B, V)."""
    found = torch.from_numpy(tokens).to(h.device)[:, None]  # (B, 1, k)
    z, _ = head(h[:, None], found, found >= 0, model.lm_head.weight)  # (B, 1, C)
    return model.lm_head(z)[:, 0]  # (B, V)


def check_engine(config: EngineConfig, head: SpalmHead | None, searcher: Searcher | None) -> None:
    """An engine of memory kind "spalm" has a head and a searcher; a head belongs to such an engine only."""
    spalm = config.memory is not None and config.memory.kind == "spalm"
    if spalm != (head is not None):
        raise MemlmError("memory spalm generates with a SPALM head (spalm_head), and only it takes one")
    if spalm and searcher is None:
        raise MemlmError("SPALM generation needs a datastore: this engine has no searcher")


def check_request(engine: Engine, request: GenerationRequest | ScoreRequest) -> None:
    """A SPALM engine takes SPALM generations only (Score rows read the decoder's logits: memlm.jobs.spalm_scoring
    scores SPALM), and gives them its head."""
    spalm = engine.spalm_head is not None
    if isinstance(request, ScoreRequest) and spalm:
        raise MemlmError("a SPALM engine does not score: SPALM scores come from memlm.jobs.spalm_scoring")
    if isinstance(request, GenerationRequest) and spalm != (request.spalm is not None):
        raise MemlmError("SPALM settings go with an engine of memory spalm, and it takes only those")
    if isinstance(request, GenerationRequest) and spalm and request.speculative:
        raise MemlmError("speculative drafts do not combine with SPALM generation")


def forward(engine: Engine, idx: torch.Tensor, state: DecoderState, logits_from: int) -> LMOutput:
    """The engine's forward pass: the decoder's LMOutput; in a SPALM engine its logits are the final hidden
    states (B, T - logits_from, C) instead (head_logits turns the ready rows' into logits), and the base
    output head does not run (memlm.memory.spalm.final_hidden)."""
    if engine.spalm_head is None:
        return engine.model(idx, state=state, logits_from=logits_from)
    h, key, _ = final_hidden(engine.model, idx, state)  # (B, T, C) each
    return LMOutput(h[:, logits_from:], key, None)


def head_logits(engine: Engine, ready: list[Row], logits: torch.Tensor, keys: torch.Tensor,
                ) -> tuple[list[Row], torch.Tensor, torch.Tensor]:
    """The ready rows' next-token logits: SPALM's (from the hidden states `logits` carries in a SPALM engine),
    else `logits` as they are. When the rows' search fails, each row is searched alone once and only the rows
    whose own search fails end with its error (each handle raises it); the others go on."""
    if engine.spalm_head is None or not ready:
        return ready, logits, keys
    settings = [r.handle.request.spalm for r in ready]
    try:
        tokens = neighbour_tokens(engine.searcher, keys, settings)  # (B, k)
    except Exception as e:  # noqa: BLE001 - retried row by row: one row's fault ends that row only
        tokens = np.full((len(ready), max(s.k for s in settings)), -1, dtype=np.int64)  # (B, k)
        keep = []
        for i, row in enumerate(ready):
            try:
                if len(ready) == 1:
                    raise e
                mine = neighbour_tokens(engine.searcher, keys[i : i + 1], settings[i : i + 1])  # (1, k_i)
            except Exception as own:  # noqa: BLE001 - delivered to the request it ends, with its message
                engine.fail(row, own)
                continue
            tokens[i, : mine.shape[1]] = mine[0]
            keep.append(i)
        ready, logits, keys, tokens = [ready[i] for i in keep], logits[keep], keys[keep], tokens[keep]
        if not ready:
            return [], logits, keys
    return ready, head_of(engine.model, engine.spalm_head, logits, tokens), keys  # (B, V)
