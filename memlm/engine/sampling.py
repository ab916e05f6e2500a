"""The next token of every ready row at once: log-softmax, kNN-LM (one search for all rows), sampling.

The rules are memlm.jobs.generate's (`_next_token`): kNN-LM mixes the full distribution
log p = logaddexp(log(1 - lambda) + log p_LM, log(lambda) + log p_kNN) (Khandelwal et al. 2020);
temperature 0 is greedy; otherwise top-k then top-p (`filter_logits`) then one draw from the request's
own torch.Generator, so a seeded request draws the same tokens whatever else is in the batch; ids beyond
the tokenizer's vocabulary are never drawn. Rows are batched; only the draws loop over rows (each needs
its own generator). The chosen ids and their log-probs come back to the host in one transfer per step.

Shape legend: B ready rows, V vocab, C key width, k neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from memlm.jobs.generate import SamplingConfig, filter_logits
from memlm.retrieval.knnlm import KNNLMConfig, interpolate, knn_log_distribution
from memlm.retrieval.searcher import Searcher, search_keys


class Choices(NamedTuple):
    """The step's tokens, host-side lists of length B."""

    tokens: list[int]
    logprobs: list[float]
    """Final log-probability of each chosen token (the kNN-LM mixture when on), nats."""
    base_logprobs: list[float]
    """Its log-probability under the base LM alone, nats."""


def choose_tokens(
    logits: torch.Tensor, keys: torch.Tensor, sampling: Sequence[SamplingConfig],
    generators: Sequence[torch.Generator], decodable: int, searcher: Searcher | None, knn: KNNLMConfig | None,
) -> Choices:
    """logits: (B, V), keys: (B, C) of the rows' last positions; one SamplingConfig and generator per row."""
    V = logits.shape[-1]
    lm_lp = F.log_softmax(logits.float(), dim=-1)  # (B, V)
    final_lp = lm_lp
    if searcher is not None:
        nb = search_keys(searcher, keys, knn.k, knn.search_options)  # (B, k): one search for every row
        knn_lp = knn_log_distribution(nb, V, knn.temperature).to(logits.device)  # (B, V)
        final_lp = interpolate(lm_lp, knn_lp, knn.lmbda)  # (B, V)
    choice = final_lp
    if decodable < V:
        choice = final_lp.clone()
        choice[:, decodable:] = float("-inf")
    tokens = choice.argmax(dim=-1)  # (B,) greedy rows keep these
    for i, (s, gen) in enumerate(zip(sampling, generators)):
        if s.temperature != 0:
            scaled = filter_logits(choice[i] / s.temperature, s.top_k, s.top_p)  # (V,)
            tokens[i] = torch.multinomial(scaled.softmax(-1), 1, generator=gen)[0]
    picked = tokens[:, None]  # (B, 1)
    both = torch.stack([final_lp.gather(1, picked)[:, 0], lm_lp.gather(1, picked)[:, 0]]).double()  # (2, B)
    host = torch.cat([tokens.double()[None], both]).cpu()  # (3, B): the one transfer (ids < 2^53 are exact)
    return Choices([int(t) for t in host[0]], host[1].tolist(), host[2].tolist())
