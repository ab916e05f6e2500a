"""`memlm train-gate`, library side: fit adaptive retrieval's gate (memlm.retrieval.adaptive) on a tuning
split, in one pass of the LM and the searcher over it.

The pass gives, per tuning token, the gate's inputs (distribution features and key), log p_LM(target) and
its neighbours; lambda and T are tuned on the same pass when asked (memlm.jobs.knnlm_eval.tune), and the
gate is fitted to how much kNN-LM at that lambda and T gains on each token (memlm.retrieval.adaptive.fit_gate). A separate command from `memlm train` because nothing of
the LM trains and it needs a datastore; evaluation refuses a gate fitted on any evaluated document
(GateSettings.fitted_documents, checked by the command line where the gate is opened).

Shape legend: n tuning tokens, k neighbours, F gate features, d key dimension.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from memlm.errors import MemlmError
from memlm.jobs.knnlm_eval import TuningData, tune
from memlm.jobs.token_scores import knn_final
from memlm.jobs.windows import WindowConfig, score_documents
from memlm.model.decoder import Decoder
from memlm.retrieval.adaptive import (
    GateConfig,
    GateSettings,
    RetrievalGate,
    distribution_features,
    fit_gate,
    score_quantiles,
)
from memlm.retrieval.knnlm import KNNLMConfig, knn_logprob_from_matches
from memlm.retrieval.searcher import Searcher


class GateData(NamedTuple):
    """What one pass over the tuning split gives."""

    tuning: TuningData  # log p_LM, distances (n, k), matches (n, k)
    distribution: torch.Tensor  # (n, 5) float32 distribution_features
    keys: torch.Tensor  # (n, d) float32 CPU keys


def collect_gate_data(model: Decoder, token_docs: Sequence[list[int]], searcher: Searcher, window: WindowConfig,
                      knn: KNNLMConfig, boundary_token: int, progress: bool = True) -> GateData:
    """One forward and one search per group of windows over the tuning documents."""
    lm, dist, match, features, keys = [], [], [], [], []
    total = sum(len(d) for d in token_docs)
    stream = score_documents(model, token_docs, window, boundary_token, with_logprobs=True,
                             lm_features=distribution_features)
    with tqdm(total=total, desc="train-gate: collect", unit="tok", file=sys.stderr, disable=not progress) as bar:
        for s in stream:
            xq = s.keys.float().cpu().numpy()  # (n, d)
            nb = searcher.search(xq, knn.k, knn.search_options)
            lm.append(s.lm_logprob.float())
            dist.append(torch.from_numpy(nb.distances.astype(np.float32)))
            match.append(torch.from_numpy(nb.values.astype(np.int64)) == s.targets[:, None])
            features.append(s.features.float().cpu())
            keys.append(s.keys.detach().float().cpu())
            bar.update(xq.shape[0])
    if not lm:
        raise MemlmError("the tuning split has no tokens; pass another --split")
    return GateData(TuningData(torch.cat(lm), torch.cat(dist), torch.cat(match)), torch.cat(features), torch.cat(keys))


HELD_OUT = 0.2
"""Share of the tuning tokens kept out of the fit: the score quantiles (--adaptive-fraction) and the
reported accuracy come from them, so that an overfitted gate does not promise fractions it misses."""


def held_out_split(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fit, held) token indices: a seeded random HELD_OUT share held out (at least one token each side)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))  # (n,)
    h = min(n - 1, max(1, round(HELD_OUT * n)))
    return order[h:], order[:h]


def train_gate(model: Decoder, token_docs: Sequence[list[int]], fingerprints: Sequence[str], searcher: Searcher,
               window: WindowConfig, knn: KNNLMConfig, boundary_token: int, config: GateConfig, *,
               model_fingerprint: str, tune_data: str, progress: bool = True) -> tuple[RetrievalGate, GateSettings]:
    """Fit the gate on `token_docs` (whose document fingerprints are `fingerprints`, recorded so that no
    evaluation of them uses it). knn: k and search options; lambda/T None are tuned on the same pass."""
    data = collect_gate_data(model, token_docs, searcher, window, knn, boundary_token, progress)
    lmbda, temperature = knn.lmbda, knn.temperature
    if knn.needs_tuning:
        tuned = tune(data.tuning, fixed_lmbda=knn.lmbda, fixed_temperature=knn.temperature)
        lmbda, temperature = tuned.lmbda, tuned.temperature
    lm = data.tuning.lm_logprob  # (n,)
    knn_lp = knn_logprob_from_matches(data.tuning.distances, data.tuning.matches, temperature)  # (n,)
    gain = knn_final(lm, knn_lp, lmbda) - lm  # (n,) nats retrieval adds (> 0: it helps)
    helps = gain > 0
    fit, held = held_out_split(helps.shape[0], config.seed)
    gate = fit_gate(data.distribution[fit], data.keys[fit], lm[fit], knn_lp[fit], float(lmbda), config)
    x = gate.inputs(data.distribution[held], data.keys[held], config.use_key)  # (h, F)
    scores = gate.scores(x)  # (h,) scores of tokens the fit did not see: honest quantiles
    helps_held = helps[held]
    info = searcher.info()
    settings = GateSettings(
        model_fingerprint=model_fingerprint, key_layer=model.config.key_description,
        datastore_corpus_fingerprint=info.corpus_fingerprint, k=knn.k, temperature=float(temperature),
        lmbda=float(lmbda), config=config, n_features=int(x.shape[1]),
        fitted_documents=tuple(fingerprints), tune_data=tune_data, tokens=int(helps.shape[0]),
        positive_rate=float(helps.float().mean()), accuracy=float(((scores >= scores.median()) == helps_held).float().mean()),
        score_quantiles=score_quantiles(scores), key_dim=int(gate.projection.shape[0]),
    )
    return gate, settings
