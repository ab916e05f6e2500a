"""How kNN-LM mixes its distributions: a constant lambda and T, or a small model that sets them per token
from the retrieval (He et al. 2021, "Efficient Nearest Neighbor Language Models"; Drozdov et al. 2022), over
the datastore's neighbours alone or with a continuous cache of the document's past (Grave et al. 2017):

    p(y) = w_LM p_LM(y) + w_kNN p_kNN(y; T_kNN) [+ w_cache p_cache(y; T_cache)],   the w summing to 1

Features per token (`token_features`): the LM's distribution_features (memlm.retrieval.adaptive: entropy,
top-3 log-probabilities, top-1/top-2 margin), then for each source its nearest and mean neighbour distance,
the share of neighbours storing its top token, that token's probability, its entropy, its probability of the
LM's top token and whether the two top tokens agree (and, for the cache, how many entries it holds). A
source without neighbours has NaN there, which the model reads as the fitted mean.

`ConstantInterpolation` holds fixed weights and temperatures (lambda and T of the grid search, for the
datastore alone: exactly `interpolate` at that lambda); `LearnedInterpolation` is an MLP from the
standardised features to the weights (softmax) and, optionally, a factor on each base temperature. Both
are fitted on a tuning split (memlm.jobs.interpolation_eval) and saved as one JSON file (`save_method`);
`served_knn` opens such a file for Score (checked against the model and the datastore it was fitted with),
which mixes each chunk of tokens with `ServedInterpolation` as evaluation does.

Shape legend: n tokens, k neighbours of a source, V vocab, F features, S sources, H hidden units.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from memlm.errors import MemlmError
from memlm.retrieval.adaptive import distribution_features
from memlm.retrieval.knnlm import (
    NEG_INF,
    KNNLMConfig,
    interpolate,
    knn_log_distribution,
    knn_logprob_from_matches,
    knn_mixture,
)
from memlm.retrieval.searcher import Neighbors

SOURCES = ("knn", "cache")
"""The distributions mixed with the LM's: the datastore's neighbours, the document's own past."""
LM_FEATURES = 6
"""Columns of `lm_features`: the 5 distribution_features, then the LM's top token id."""
SOURCE_FEATURES = 7
"""Columns of `source_features` per source (the cache adds its entry count)."""
PROBABILITY_FLOOR = 1e-6
"""Floor of a source's probability of the LM's top token before its log (0 when no neighbour stores it)."""
LM_WEIGHT_FLOOR = 0.05
"""Least weight a learned model gives the LM: a token whose features lie where the fit saw none loses at most
log(1 / 0.05) = 3 nats against the base."""
FEATURE_CLIP = 4.0
"""Standardised features are clipped to +-4 (a feature far outside the fitted range, such as an empty cache
the fit never saw, does not swing the weights)."""
LOG_TEMPERATURE_RANGE = 3.0
"""A learned temperature stays within exp(+-3) of its base temperature."""
FORMAT = 1
"""Version of the saved JSON."""


def lm_features(logprobs: torch.Tensor) -> torch.Tensor:
    """(n, V) float32 log-probabilities -> (n, 6): distribution_features, then the argmax id as a float
    (exact below 2^24), read where the neighbours are known to compare the top tokens."""
    top = logprobs.argmax(dim=-1, keepdim=True).float()  # (n, 1)
    return torch.cat([distribution_features(logprobs), top], dim=-1)  # (n, 6)


def source_features(distances: torch.Tensor, values: torch.Tensor, lm_top: torch.Tensor, temperature: float,
                    with_count: bool) -> torch.Tensor:
    """(n, 7) (+1 with_count) features of one source's neighbours: distances (n, k) float32 (inf where
    missing), values (n, k) int64 (-1 where missing), lm_top (n,) int64 the LM's top token, at `temperature`.
    NaN where a token has no neighbours (the count, when asked, is 0 there)."""
    n, k = distances.shape
    valid = torch.isfinite(distances) & (values >= 0)  # (n, k)
    count = valid.sum(dim=1)  # (n,)
    has = count > 0  # (n,)
    d = distances.float().masked_fill(~valid, math.inf)  # (n, k)
    nearest = d.min(dim=1).values  # (n,)
    mean = d.masked_fill(~valid, 0.0).sum(dim=1) / count.clamp(min=1)  # (n,)
    logits = (-d / temperature).masked_fill(~valid, NEG_INF)  # (n, k)
    norm = torch.logsumexp(logits, dim=1, keepdim=True)  # (n, 1)
    w = torch.where(valid, torch.exp(logits - norm.masked_fill(~has[:, None], 0.0)), torch.zeros_like(d))  # (n, k)
    # Sum the weights of equal tokens: sort each row by token, then one group per run of equal tokens.
    v = values.masked_fill(~valid, -1)  # (n, k)
    sv, order = v.sort(dim=1)  # (n, k)
    sw, sval = w.gather(1, order), valid.gather(1, order).float()  # (n, k)
    start = torch.ones_like(sv, dtype=torch.bool)
    start[:, 1:] = sv[:, 1:] != sv[:, :-1]
    group = start.long().cumsum(dim=1) - 1  # (n, k) group index of each sorted neighbour
    mass = torch.zeros(n, k).scatter_add_(1, group, sw)  # (n, k) probability of each group's token
    members = torch.zeros(n, k).scatter_add_(1, group, sval)  # (n, k) neighbours storing it
    token = torch.full((n, k), -1, dtype=torch.long).scatter_(1, group, sv)  # (n, k) the group's token
    top = mass.argmax(dim=1, keepdim=True)  # (n, 1)
    top_mass = mass.gather(1, top)[:, 0]  # (n,)
    top_share = members.gather(1, top)[:, 0] / count.clamp(min=1)  # (n,)
    top_token = token.gather(1, top)[:, 0]  # (n,)
    entropy = -(mass * torch.log(mass.clamp(min=torch.finfo(torch.float32).tiny))).sum(dim=1)  # (n,)
    p_lm_top = (w * (v == lm_top[:, None])).sum(dim=1)  # (n,)
    cols = [torch.log1p(nearest), torch.log1p(mean), top_share, top_mass, entropy,
            torch.log(p_lm_top.clamp(min=PROBABILITY_FLOOR)), (top_token == lm_top).float()]
    out = torch.stack(cols, dim=1).masked_fill(~has[:, None], math.nan)  # (n, 7)
    if with_count:
        out = torch.cat([out, torch.log1p(count.float())[:, None]], dim=1)  # (n, 8)
    return out


def token_features(lm: torch.Tensor, neighbours: list[tuple[torch.Tensor, torch.Tensor]],
                   temperatures: tuple[float, ...]) -> torch.Tensor:
    """The model's input (n, F): lm (n, 6) from `lm_features` (without its top-token column), then
    source_features of each source's (distances, values) at its base temperature (the cache, second,
    with its count)."""
    lm_top = lm[:, LM_FEATURES - 1].long()  # (n,)
    parts = [lm[:, : LM_FEATURES - 1].float()]
    for s, ((d, v), t) in enumerate(zip(neighbours, temperatures)):
        parts.append(source_features(d, v, lm_top, t, with_count=s > 0))
    return torch.cat(parts, dim=1)  # (n, F)


def n_features(sources: int) -> int:
    """F of token_features for 1 or 2 sources."""
    return LM_FEATURES - 1 + SOURCE_FEATURES * sources + (sources > 1)


def mixture(lm: torch.Tensor, sources: list[torch.Tensor], weights: tuple[float, ...] | torch.Tensor) -> torch.Tensor:
    """log sum_s w_s p_s of the targets, (n,) float32: lm (n,) log p_LM, sources [(n,)] log p of each other
    source, weights (S+1,) floats or (n, S+1) float64 (the LM's first). With one source this is
    `interpolate` at lambda = the second weight, bit for bit; a weight of 0 drops its term exactly."""
    if len(sources) == 1:
        lam = weights[1] if isinstance(weights, tuple) else weights[:, 1]
        return interpolate(lm, sources[0], lam)
    w = torch.as_tensor(weights, dtype=torch.float64)
    w = w.expand(lm.shape[0], -1) if w.dim() == 1 else w  # (n, S+1)
    with torch.no_grad():
        log_w = torch.log(w).float()  # (n, S+1), -inf where a weight is 0
    terms = torch.stack([lm.float(), *[s.float() for s in sources]], dim=1) + log_w  # (n, S+1)
    terms = terms.masked_fill(w == 0, NEG_INF)
    out = torch.logsumexp(terms, dim=1)  # (n,)
    return torch.where(torch.isneginf(terms).all(dim=1), torch.full_like(out, NEG_INF), out)


class Plan:
    """A method's weights and temperatures for a batch of tokens."""

    def __init__(self, weights: tuple[float, ...] | torch.Tensor, temperatures: list[float | torch.Tensor]) -> None:
        self.weights = weights  # (S+1,) floats or (n, S+1) float64
        self.temperatures = temperatures  # per source: a float or (n, 1) float32


def final_logprob(plan: Plan, lm: torch.Tensor, matches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """log p of the targets (n,) under a plan: lm (n,) log p_LM, matches per source (distances (n, k),
    neighbour value == target (n, k) bool)."""
    logps = [knn_logprob_from_matches(d, m, t) for (d, m), t in zip(matches, plan.temperatures)]
    return mixture(lm, logps, plan.weights)


@dataclass(frozen=True)
class ConstantInterpolation:
    """The same weights and temperatures for every token."""

    sources: tuple[str, ...]
    """Which distributions besides the LM's, in order ("knn", then "cache" if any)."""
    weights: tuple[float, ...]
    """(w_LM, w_kNN[, w_cache]), summing to 1; with the datastore alone, (1 - lambda, lambda)."""
    temperatures: tuple[float, ...]
    """T of each source."""

    needs_features = False

    @property
    def method(self) -> str:
        return "constant" + ("+cache" if "cache" in self.sources else "")

    @property
    def base_temperatures(self) -> tuple[float, ...]:
        """The temperatures its features are computed at: its own."""
        return self.temperatures

    def plan(self, features: torch.Tensor | None) -> Plan:
        return Plan(self.weights, list(self.temperatures))

    def parameters_record(self) -> dict[str, Any]:
        return {"weights": list(self.weights), "temperatures": list(self.temperatures),
                **({"lambda": self.weights[1], "temperature": self.temperatures[0]} if len(self.sources) == 1 else {})}


class LearnedInterpolation(nn.Module):
    """Weights (and optionally temperature factors) per token from token_features (n, F): standardised (NaN
    -> 0, the fitted mean) and clipped, then Linear-Tanh-Linear (hidden 0: one Linear); the first S+1 outputs
    are the weights' logits (LM_WEIGHT_FLOOR on the LM, the rest by softmax, in float64), the next S the log
    factors on the base temperatures (clamped to LOG_TEMPERATURE_RANGE)."""

    needs_features = True

    def __init__(self, sources: tuple[str, ...], temperatures: tuple[float, ...], hidden: int,
                 learn_temperature: bool) -> None:
        super().__init__()
        self.sources, self.base_temperatures = tuple(sources), tuple(float(t) for t in temperatures)
        self.hidden, self.learn_temperature = hidden, learn_temperature
        S, F = len(sources), n_features(len(sources))
        self.register_buffer("mean", torch.zeros(F))
        self.register_buffer("std", torch.ones(F))
        out = S + 1 + S * learn_temperature
        layers = [nn.Linear(F, hidden), nn.Tanh(), nn.Linear(hidden, out)] if hidden else [nn.Linear(F, out)]
        self.net = nn.Sequential(*layers)

    @property
    def method(self) -> str:
        return "learned" + ("+cache" if "cache" in self.sources else "")

    def outputs(self, features: torch.Tensor) -> torch.Tensor:
        """(n, F) -> (n, S+1 [+S]) raw outputs (differentiable)."""
        x = ((features.float() - self.mean) / self.std).nan_to_num(nan=0.0)  # (n, F)
        return self.net(x.clamp(-FEATURE_CLIP, FEATURE_CLIP))

    def log_weights(self, out: torch.Tensor) -> torch.Tensor:
        """(n, S+1) log weights from raw outputs: LM_WEIGHT_FLOOR on the LM, the rest by softmax (differentiable)."""
        S = len(self.sources)
        log_rest = math.log1p(-LM_WEIGHT_FLOOR) + torch.log_softmax(out[:, : S + 1], dim=1)  # (n, S+1)
        floor = torch.full_like(log_rest[:, :1], math.log(LM_WEIGHT_FLOOR))
        return torch.cat([torch.logaddexp(log_rest[:, :1], floor), log_rest[:, 1:]], dim=1)

    def plan_from(self, out: torch.Tensor) -> Plan:
        S = len(self.sources)
        weights = (1.0 - LM_WEIGHT_FLOOR) * torch.softmax(out[:, : S + 1].double(), dim=1)  # (n, S+1)
        weights[:, 0] += LM_WEIGHT_FLOOR
        if not self.learn_temperature:
            return Plan(weights, list(self.base_temperatures))
        log_f = out[:, S + 1 :].clamp(-LOG_TEMPERATURE_RANGE, LOG_TEMPERATURE_RANGE)  # (n, S)
        temps = [(t * torch.exp(log_f[:, s : s + 1].double())).float() for s, t in enumerate(self.base_temperatures)]
        return Plan(weights, temps)  # temperatures (n, 1) each

    @torch.no_grad()
    def plan(self, features: torch.Tensor | None) -> Plan:
        assert features is not None
        return self.plan_from(self.outputs(features))

    def parameters_record(self) -> dict[str, Any]:
        return {"base_temperatures": list(self.base_temperatures), "hidden": self.hidden,
                "learn_temperature": self.learn_temperature,
                "state": {k: v.tolist() for k, v in self.state_dict().items()}}


Method = ConstantInterpolation | LearnedInterpolation


def method_record(method: Method) -> dict[str, Any]:
    """What a method is, as JSON: its name, sources and fitted parameters."""
    return {"format": FORMAT, "method": method.method, "sources": list(method.sources), **method.parameters_record()}


def save_method(method: Method, path: Path, settings: dict[str, Any]) -> Path:
    """Write the method and the settings it was fitted under (model, datastore, k, cache, documents) to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**method_record(method), "settings": settings}, indent=1) + "\n")
    return path


def load_method(path: Path) -> tuple[Method, dict[str, Any]]:
    """(method, settings) of a file written by save_method; refused in one line when it is not one."""
    try:
        raw = json.loads(Path(path).read_text())
        if raw.get("format") != FORMAT:
            raise MemlmError(f"{path} is not an interpolation file of this memlm (format {raw.get('format')})")
        sources = tuple(raw["sources"])
        if raw["method"].startswith("constant"):
            method: Method = ConstantInterpolation(sources, tuple(raw["weights"]), tuple(raw["temperatures"]))
        else:
            method = LearnedInterpolation(sources, tuple(raw["base_temperatures"]), raw["hidden"],
                                          raw["learn_temperature"])
            method.load_state_dict({k: torch.tensor(v) for k, v in raw["state"].items()})
            method.eval()
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise MemlmError(f"{path} is not an interpolation file written by memlm eval --lambda auto ({e})") from None
    if any(s not in SOURCES for s in sources) or sources[:1] != ("knn",):
        raise MemlmError(f"{path}: unknown sources {list(sources)}")
    return method, raw.get("settings", {})


# -- serving ---------------------------------------------------------------------------------------

CHECKED_SETTINGS = ("model_fingerprint", "key_layer", "datastore_corpus_fingerprint")
"""What a saved method's settings must share with the model and datastore it is served with."""


@dataclass(frozen=True, eq=False)
class ServedInterpolation:
    """A saved method as Score mixes it, with the document cache it was fitted with (read over the text's own
    earlier positions, memlm.jobs.interpolation_eval.DocumentCache, from each text's start)."""

    method: Method
    """The fitted weights (and temperatures)."""
    cache_size: int
    """Earlier positions of the text the cache holds."""
    cache_k: int
    """Nearest of them each token reads."""

    @property
    def has_cache(self) -> bool:
        return "cache" in self.method.sources

    def plan(self, lm: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor]]) -> Plan:
        """The tokens' weights and temperatures: lm (n, 6) lm_features, sources per method source (distances
        (n, k) float32, inf where missing; values (n, k) int64, -1 there)."""
        m = self.method
        features = token_features(lm, sources, m.base_temperatures) if m.needs_features else None  # (n, F)
        return m.plan(features)


def plan_rows(plan: Plan, lo: int, hi: int) -> Plan:
    """The plan of tokens lo .. hi - 1."""
    w = plan.weights if isinstance(plan.weights, tuple) else plan.weights[lo:hi]
    return Plan(w, [t if isinstance(t, float) else t[lo:hi] for t in plan.temperatures])


def log_distribution(plan: Plan, lm_logprobs: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor]]
                     ) -> torch.Tensor:
    """The full mixed log-distribution (r, V) float32 on lm_logprobs' device, for greedy flags and top-n:
    lm_logprobs (r, V), sources per method source (distances (r, k), values (r, k)), plan of these r tokens."""
    r, V = lm_logprobs.shape
    w = torch.as_tensor(plan.weights, dtype=torch.float64)
    w = w.expand(r, -1) if w.dim() == 1 else w  # (r, S+1)
    log_w = torch.log(w).float().to(lm_logprobs.device)  # (r, S+1), -inf where a weight is 0
    out = lm_logprobs.float() + log_w[:, :1]  # (r, V)
    for s, ((d, v), t) in enumerate(zip(sources, plan.temperatures)):
        dense = knn_log_distribution(Neighbors(d, v, v), V, t).to(lm_logprobs.device)  # (r, V)
        out = torch.logaddexp(out, dense + log_w[:, s + 1 : s + 2])
    return out


def next_token_logprobs(lm_logprobs: torch.Tensor, neighbors: Neighbors, knn: KNNLMConfig) -> torch.Tensor:
    """The kNN-LM next-token log-distribution (Q, V) for generation: knn's saved interpolation over the LM and
    the neighbours (Q, k) when it has one (the document cache is Score's only), else its constant knn_mixture."""
    served = knn.interpolation
    if served is None:
        return knn_mixture(lm_logprobs, neighbors, knn.temperature, knn.lmbda)
    if served.has_cache:
        raise MemlmError(f"the {served.method.method} interpolation mixes a document cache, which generation does not keep")
    sources = [(torch.from_numpy(np.asarray(neighbors.distances, dtype=np.float32)),
                torch.from_numpy(np.asarray(neighbors.values).astype(np.int64)))]  # (Q, k) each
    plan = served.plan(lm_features(lm_logprobs.float()).cpu(), sources)
    return log_distribution(plan, lm_logprobs, sources)


def served_knn(knn: KNNLMConfig, path: Path, *, model_fingerprint: str, key_layer: str,
               corpus_fingerprint: str) -> KNNLMConfig:
    """`knn` with a saved interpolation in force: its k, and a constant datastore-only method's lambda and T
    (the constant mixture of those, bit for bit), or the method itself (`interpolation`). A file fitted with
    another model, key layer or datastore is refused in one line naming the setting."""
    method, settings = load_method(path)
    have = {"model_fingerprint": model_fingerprint, "key_layer": key_layer,
            "datastore_corpus_fingerprint": corpus_fingerprint}
    for name in CHECKED_SETTINGS:
        if settings.get(name) != have[name]:
            raise MemlmError(f"{path} was fitted with {name} {settings.get(name)!r}, not this server's {have[name]!r}")
    try:
        k, cache_size, cache_k = int(settings["k"]), int(settings["cache_size"]), int(settings["cache_k"])
    except (KeyError, TypeError, ValueError) as e:
        raise MemlmError(f"{path} does not record its k and cache settings ({e})") from None
    if isinstance(method, ConstantInterpolation) and method.sources == ("knn",):
        return replace(knn, k=k, lmbda=method.weights[1], temperature=method.temperatures[0], interpolation=None)
    return replace(knn, k=k, interpolation=ServedInterpolation(method, cache_size, cache_k))


# -- fitting ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FitConfig:
    """How the weights (and temperatures) are fitted: full-batch AdamW on the tuning tokens' mixture NLL."""

    hidden: int = 8
    """Hidden units of the learned model (0: linear)."""
    learn_temperature: bool = False
    """Also learn a per-token factor on each source's temperature."""
    steps: int = 60
    """Full-batch steps (few: stopping early is the regulariser that held up on held-apart tuning tokens)."""
    lr: float = 5e-3
    """AdamW learning rate."""
    weight_decay: float = 1e-2
    """AdamW weight decay on the learned model's weight matrices (the tuning split is small)."""
    seed: int = 0
    """Initialisation seed."""


TRAIN_LOGPROB_FLOOR = -1e4
"""log p of a target no neighbour predicts, in the fit's loss (exp of it is 0; -inf has no gradient)."""
_FAR = -1e30
"""A finite stand-in for -inf logits in the fit, whose gradients would be NaN."""


def trainable_logprob(distances: torch.Tensor, matches: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """knn_logprob_from_matches with gradients towards the temperature (a float or (n, 1)): (n,) float32,
    TRAIN_LOGPROB_FLOOR where no neighbour matches."""
    valid = torch.isfinite(distances)  # (n, k)
    logits = (-distances.masked_fill(~valid, 0.0) / temperature).masked_fill(~valid, _FAR)  # (n, k)
    norm = torch.logsumexp(logits, dim=1)  # (n,)
    num = torch.logsumexp(logits.masked_fill(~matches, _FAR), dim=1)  # (n,)
    has = (matches & valid).any(dim=1)  # (n,)
    return torch.where(has, num - norm, torch.full_like(num, TRAIN_LOGPROB_FLOOR))


def mixture_nll(log_weights: torch.Tensor, temperatures: list[float | torch.Tensor], lm: torch.Tensor,
                matches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Mean -log sum_s w_s p_s over the tokens (differentiable): log_weights (n or 1, S+1), lm (n,)."""
    logps = [trainable_logprob(d, m, t) for (d, m), t in zip(matches, temperatures)]
    terms = torch.stack([lm.float(), *logps], dim=1) + log_weights  # (n, S+1)
    return -torch.logsumexp(terms, dim=1).mean()


def fit_learned(init: ConstantInterpolation, features: torch.Tensor, lm: torch.Tensor,
                matches: list[tuple[torch.Tensor, torch.Tensor]], config: FitConfig) -> LearnedInterpolation:
    """A LearnedInterpolation fitted on the tokens' token_features (n, F) (computed at init's temperatures),
    lm (n,) and per-source matches, starting from `init` exactly (zero output weights, its weights as biases)."""
    torch.manual_seed(config.seed)
    model = LearnedInterpolation(init.sources, init.temperatures, config.hidden, config.learn_temperature)
    x = features.float()
    mean = torch.nanmean(x, dim=0).nan_to_num(nan=0.0)  # (F,)
    std = torch.nanmean((x - mean).pow(2), dim=0).nan_to_num(nan=1.0).sqrt().clamp(min=1e-6)  # (F,)
    model.mean.copy_(mean)
    model.std.copy_(std)
    last = model.net[-1]
    S = len(init.sources)
    with torch.no_grad():
        last.weight.zero_()
        last.bias.zero_()
        rest = torch.tensor(init.weights, dtype=torch.float64)  # the softmax part that gives init's weights
        rest[0] = max(float(rest[0]) - LM_WEIGHT_FLOOR, 0.0)
        last.bias[: S + 1] = torch.log((rest / (1.0 - LM_WEIGHT_FLOOR)).clamp(min=1e-4)).float()
    decay = [p for name, p in model.net.named_parameters() if name.endswith("weight")]
    rest = [p for name, p in model.net.named_parameters() if not name.endswith("weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=config.lr)
    # At fixed temperatures each source's log p of the target is one (n,) column, computed once.
    fixed = None if config.learn_temperature else torch.stack(
        [lm.float(), *[trainable_logprob(d, m, t) for (d, m), t in zip(matches, init.temperatures)]], dim=1)  # (n, S+1)
    for _ in range(config.steps):
        opt.zero_grad()
        out = model.outputs(x)  # (n, S+1 [+S])
        log_w = model.log_weights(out)  # (n, S+1)
        if fixed is not None:
            loss = -torch.logsumexp(fixed + log_w, dim=1).mean()
        else:
            log_f = out[:, S + 1 :].clamp(-LOG_TEMPERATURE_RANGE, LOG_TEMPERATURE_RANGE)  # (n, S)
            temps = [t * torch.exp(log_f[:, s : s + 1]) for s, t in enumerate(init.temperatures)]
            loss = mixture_nll(log_w, temps, lm, matches)
        loss.backward()
        opt.step()
    return model.eval()
