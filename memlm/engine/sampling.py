"""The next token of every ready row at once: log-softmax, kNN-LM mixture per row, sampling.

The rules (with memlm.jobs.decoding's filtering): kNN-LM mixes the full distribution
log p = logaddexp(log(1 - lambda) + log p_LM, log(lambda) + log p_kNN) (Khandelwal et al. 2020);
temperature 0 is greedy; otherwise top-k then top-p (`filter_logits`) then one draw from the request's
own torch.Generator, so a seeded request draws the same tokens whatever else is in the batch; ids beyond
the tokenizer's vocabulary are never drawn. Rows are batched; only the kNN mixtures and the draws loop
over rows (each has its own settings and generator); greedy rows without kNN-LM take the argmax
(`argmax_rows`) and one logsumexp. The neighbours come from one search per step for every kNN row
(`search_rows`, of the largest k asked: a row that asked fewer keeps its nearest k, exactly what a search of
its own k returns, results being sorted by distance). The chosen ids and their
log-probs come back to the host in one transfer per step.

Shape legend: B ready rows, Q rows with kNN-LM, V vocab, C key width, k neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from memlm.jobs.decoding import SamplingConfig, filter_logits, scale_logits
from memlm.jobs.windows import WorkStopped
from memlm.retrieval.interpolation import next_token_logprobs
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.searcher import Neighbors, Searcher, search_keys


class Choices(NamedTuple):
    """The step's tokens, host-side lists of length B."""

    tokens: list[int]
    logprobs: list[float]
    """Final log-probability of each chosen token (the kNN-LM mixture when on), nats."""
    base_logprobs: list[float]
    """Its log-probability under the base LM alone, nats."""
    errors: list[Exception | None]
    """What failed in a row's own choice (its draw); None for the rows that have a token. A failed row's token
    and log-probs are placeholders: the engine ends that row with its error, the others go on."""


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The argmax of each row of x (R, V), (R,) int64 on x's device: the first maximal index, as torch.argmax's (NaN
    counts as the largest, as there). A CPU float32 x is read by numpy one row at a time (each row is contiguous in
    memory, also in a view x[:, :decodable]), since torch's CPU argmax over a vocabulary is slow: SmolLM2's 49,152
    logits, one row, about 17x slower than numpy's (a plain greedy kNN-LM step takes two argmaxes, a speculative
    verifying pass several). Elsewhere torch's own."""
    if x.dim() != 2:
        raise ValueError(f"argmax_rows takes rows (R, V), got shape {tuple(x.shape)}")
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(-1) == 1:
        return torch.from_numpy(np.array([row.argmax() for row in x.detach().numpy()], dtype=np.int64))
    return x.argmax(dim=-1)


def search_rows(searcher: Searcher, keys: torch.Tensor, knn: Sequence[KNNLMConfig | None]) -> list[Neighbors | None]:
    """The neighbours of every row with kNN-LM: keys (B, C) -> per row Neighbors (1, its k), None for rows
    without. One search per distinct set of search options (nprobe, re-ranking): one per step in practice."""
    out: list[Neighbors | None] = [None] * len(knn)
    for options in {c.search_options for c in knn if c is not None}:
        rows = [i for i, c in enumerate(knn) if c is not None and c.search_options == options]
        k = max(knn[i].k for i in rows)
        nb = search_keys(searcher, keys[rows], k, options)  # (Q, k)
        for q, i in enumerate(rows):
            out[i] = Neighbors(*(a[q : q + 1, : knn[i].k] for a in nb))  # (1, k_i): the row's nearest k_i
    return out


class RowSearch(NamedTuple):
    """search_each's answer: per query its neighbours, and the error of each row whose search failed."""

    found: list[Neighbors | None]
    """Per query (1, its k); None for a query without kNN-LM or of a row in `errors`."""
    errors: dict[int, Exception]
    """Row (an owner of queries) -> what its search raised; the rows not in it have their neighbours."""


def search_each(searcher: Searcher, keys: torch.Tensor, knn: Sequence[KNNLMConfig | None],
                owners: Sequence[int]) -> RowSearch:
    """search_rows for the queries of several rows (owners: per query, the row it belongs to) with one row's fault
    ending that row only: when the batched search raises, each row's queries are searched alone once, and only
    the rows whose own search raises fail (an outage fails them all; a circuit breaker in the searcher keeps
    the retries short). A search stopped because its callers gave up (WorkStopped) is not retried."""
    try:
        return RowSearch(search_rows(searcher, keys, knn), {})
    except Exception as e:  # noqa: BLE001 - retried row by row below
        first = e
    rows: dict[int, list[int]] = {}
    for q, (c, o) in enumerate(zip(knn, owners)):
        if c is not None:
            rows.setdefault(o, []).append(q)
    found: list[Neighbors | None] = [None] * len(knn)
    if len(rows) == 1 or isinstance(first, WorkStopped):
        return RowSearch(found, dict.fromkeys(rows, first))
    errors: dict[int, Exception] = {}
    for o, mine in rows.items():
        try:
            got = search_rows(searcher, keys[mine], [knn[q] for q in mine])
        except Exception as e:  # noqa: BLE001 - this row ends with it; the others go on
            errors[o] = e
            continue
        for q, nb in zip(mine, got):
            found[q] = nb
    return RowSearch(found, errors)


def choose_tokens(
    logits: torch.Tensor, sampling: Sequence[SamplingConfig], generators: Sequence[torch.Generator],
    decodable: int, knn: Sequence[KNNLMConfig | None], neighbors: Sequence[Neighbors | None],
) -> Choices:
    """logits: (B, V) of the rows' last positions; per row its sampling, generator, kNN settings and
    neighbours (search_rows; None for a row without kNN-LM). A row whose own choice raises is in Choices.errors."""
    x = logits.float()  # (B, V)
    # Greedy rows without kNN-LM need no distribution: the argmax of the logits, and the chosen token's
    # log-prob from one logsumexp (no (B, V) log-softmax written and read back: at 32 rows in bfloat16 that
    # was a tenth of a decode step). The other rows take the full log_softmax.
    tokens = argmax_rows(x[:, :decodable])  # (B,)
    base = x.gather(1, tokens[:, None])[:, 0] - x.logsumexp(dim=-1)  # (B,)
    final = base.clone()  # (B,)
    full = [i for i, (s, c) in enumerate(zip(sampling, knn)) if s.temperature != 0 or c is not None]
    lm_lp = F.log_softmax(x[full], dim=-1) if full else None  # (S, V)
    errors: list[Exception | None] = [None] * len(sampling)
    for j, i in enumerate(full):
        try:
            tokens[i], final[i], base[i] = _choose_row(lm_lp[j], sampling[i], generators[i], decodable, knn[i],
                                                       neighbors[i])
        except Exception as e:  # noqa: BLE001 - this row ends with it (Choices.errors); the others go on
            errors[i] = e
    both = torch.stack([final, base]).double()  # (2, B)
    host = torch.cat([tokens.double()[None], both]).cpu()  # (3, B): the one transfer (ids < 2^53 are exact)
    return Choices([int(t) for t in host[0]], host[1].tolist(), host[2].tolist(), errors)


def _choose_row(lm_lp: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator, decodable: int,
                knn: KNNLMConfig | None, neighbors: Neighbors | None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row's token from its base log-probs lm_lp (V,): (token, its final log-prob, its base log-prob), 0-d."""
    final_lp = lm_lp  # (V,)
    if neighbors is not None:
        final_lp = next_token_logprobs(lm_lp[None], neighbors, knn)[0]  # (V,)
    choice = final_lp
    if decodable < final_lp.shape[-1]:
        choice = final_lp.clone()
        choice[decodable:] = float("-inf")
    if sampling.temperature == 0:
        token = argmax_rows(choice[None])[0]
    else:
        scaled = filter_logits(scale_logits(choice, sampling.temperature), sampling.top_k, sampling.top_p)  # (V,)
        token = torch.multinomial(scaled.softmax(-1), 1, generator=generator)[0]
    return token, final_lp[token], lm_lp[token]
