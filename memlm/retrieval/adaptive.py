"""Adaptive retrieval (He, Neubig and Berg-Kirkpatrick 2021, "Efficient Nearest Neighbor Language Models",
jxhe/efficient-knnlm): a small network over cheap features of the LM predicts whether retrieval will help
the next token, and the search is skipped where it will not (the token keeps the base distribution,
lambda 0 for it).

Features (per token): the LM distribution's entropy, its top-3 log-probabilities and the top-1/top-2
margin (He et al.'s "conf" and "ent"), and a small projection of the kNN key (their "ctxt", the context
vector): its first GateConfig.key_components principal components on the tuning tokens (or, with use_key,
the whole key). The fit (GateConfig.objective):
- "mixture" (the default; He et al.'s objective, jxhe/efficient-knnlm adaptive_retrieval.py): the network
  predicts the interpolation weight lambda(x) of each token and is fitted by the kNN-LM likelihood
  log((1 - lambda(x)) p_LM + lambda(x) p_kNN) of the tuning targets; a token is searched when its
  lambda(x) >= the threshold (the searched tokens keep the tuned constant lambda: He et al.'s "learned
  mask, constant weights"). It learns how much retrieval is worth per token, not only its sign.
- "weighted_label": the label "kNN-LM beats the base on the target" with each token weighing as much as
  retrieval gains or loses on it (|log p_kNN-LM - log p_LM| at the tuned lambda).
Measured on SOTU (SmolLM2, the 81,169-key 1990-2000 datastore, the first 6,000 tokens of 2003+, lambda
0.1 / T 2.19; per-token records replayed offline, skipping the lowest-scored tokens): at half the searches
skipped, +1.75% perplexity vs plain kNN-LM for weighted_label on the 5 distribution features fitted on
the 4,651 tokens of 2001-2002, +0.90% for the entropy alone, +0.76% for "mixture" with 8 key components
(+0.38% fitted on 30,000 tokens of 1980-1989); the whole key with weighted_label +0.98% / +1.89% (it
overfits). The defaults (mixture, 32 components, 16 hidden units, 200 steps) won a 5-fold
cross-validation on the tuning split itself (+1.00% at half skipped on its held-out folds; 8 components
with 32 units and 400 steps +2.17%), never on evaluation tokens; on the evaluation tokens they give
+0.88%. The gate (a 2-layer MLP) is fitted on a tuning split by memlm.jobs.adaptive_train and saved as a
directory, gate.pt beside settings.json (GateSettings); the evaluation documents must share no document
with the ones it was fitted on (checked where opened).

Shape legend: n tokens, V vocab, F features, d key dimension, P key components, H hidden units.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from memlm.errors import MemlmError

GATE_WEIGHTS, GATE_SETTINGS = "gate.pt", "settings.json"
DISTRIBUTION_FEATURES = ("entropy", "logp_top1", "logp_top2", "logp_top3", "margin_top1_top2")
GAIN_CAP = 20.0
"""Largest per-token weight in nats (a target no neighbour predicts at lambda 1 would weigh infinity)."""
QUANTILES = 1000
"""The fitted scores' distribution is kept at QUANTILES + 1 points, for --adaptive-fraction."""


def distribution_features(logprobs: torch.Tensor) -> torch.Tensor:
    """(n, V) float32 log-probabilities -> (n, 5) DISTRIBUTION_FEATURES (float32, on their device)."""
    entropy = -(logprobs.exp() * logprobs.nan_to_num(neginf=0.0)).sum(dim=-1)  # (n,)
    top = logprobs.topk(3, dim=-1).values  # (n, 3)
    return torch.stack([entropy, top[:, 0], top[:, 1], top[:, 2], top[:, 0] - top[:, 1]], dim=-1)  # (n, 5)


def gate_inputs(distribution: torch.Tensor, keys: torch.Tensor, use_key: bool,
                projection: torch.Tensor | None = None) -> torch.Tensor:
    """The gate's input (n, F): distribution features (n, 5), then the keys' projection keys @ projection
    (n, P) when there is one, then the float32 keys (n, d) if use_key."""
    parts = [distribution.float().cpu()]
    if projection is not None and projection.numel():
        parts.append(keys.detach().float().cpu() @ projection)  # (n, P)
    if use_key:
        parts.append(keys.detach().float().cpu())
    return torch.cat(parts, dim=1)  # (n, F)


def key_projection(keys: torch.Tensor, components: int) -> torch.Tensor:
    """(d, P) the first `components` principal directions of the (n, d) keys (P = min(components, n, d))."""
    x = keys.float() - keys.float().mean(dim=0)  # (n, d)
    return torch.linalg.svd(x, full_matrices=False).Vh[:components].T.contiguous()  # (d, P)


@dataclass(frozen=True)
class GateConfig:
    """How the gate is made and fitted (`memlm train-gate`)."""

    hidden: int = 16
    """Hidden units of the 2-layer MLP."""
    use_key: bool = False
    """Feed the whole kNN key (He et al.'s context vector) besides the distribution features (it needs a
    tuning split far larger than the d key features; see the module docstring)."""
    key_components: int = 32
    """Principal components of the key fed besides the distribution features (0: none); the projection is
    fitted on the tuning tokens and saved with the gate. 32 components, 16 hidden units and 200 steps were
    chosen by 5-fold cross-validation on the 2001-2002 tuning split (module docstring)."""
    objective: str = "mixture"
    """"mixture" (He et al.: predict lambda(x) by the kNN-LM likelihood) or "weighted_label" (module docstring)."""
    steps: int = 200
    """Full-batch AdamW steps."""
    lr: float = 1e-2
    """AdamW learning rate."""
    weight_decay: float = 1e-3
    """AdamW weight decay (the tuning split is small)."""
    seed: int = 0
    """Initialisation seed."""

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise MemlmError(f"gate objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.key_components < 0:
            raise MemlmError(f"--key-components must be >= 0, got {self.key_components}")


OBJECTIVES = ("mixture", "weighted_label")


@dataclass(frozen=True)
class GateSettings:
    """settings.json beside gate.pt: what the gate was fitted on, checked where it is opened."""

    model_fingerprint: str
    """The LM whose features it reads."""
    key_layer: str
    """Which activation the keys are (its input when use_key)."""
    datastore_corpus_fingerprint: str
    """The datastore its labels searched."""
    k: int
    """Neighbours per search in the labels."""
    temperature: float
    """kNN temperature of the labels."""
    lmbda: float
    """The kNN-LM lambda of the labels' weights (how much retrieval gains on each token)."""
    config: GateConfig
    """Architecture and fit."""
    n_features: int
    """F, the input width."""
    fitted_documents: tuple[str, ...]
    """Fingerprints of the documents fitted on: an evaluation sharing one is refused."""
    tune_data: str
    """Corpus and split it was fitted on, for the record."""
    tokens: int
    """Tokens fitted on."""
    positive_rate: float
    """Share of those tokens where retrieval helps."""
    accuracy: float
    """How often "score >= the median score" (half the searches saved) is "retrieval helps", on the held-out
    tuning tokens (memlm.jobs.adaptive_train.HELD_OUT)."""
    score_quantiles: tuple[float, ...]
    """QUANTILES + 1 quantiles of the held-out tuning tokens' scores (for a target fraction saved)."""
    key_dim: int = 0
    """d of the key projection saved in gate.pt ((d, P); 0: the gate has none)."""


class RetrievalGate(nn.Module):
    """A score in [0, 1] from gate inputs (n, F): standardised, then Linear-ReLU-Linear-sigmoid ("mixture":
    the predicted lambda(x); "weighted_label": P(retrieval helps)). `projection` (d, P) (shape (0, 0): none)
    is the key's projection its inputs take (gate_inputs)."""

    def __init__(self, n_features: int, hidden: int, key_dim: int = 0, key_components: int = 0) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(n_features))
        self.register_buffer("std", torch.ones(n_features))
        self.register_buffer("projection", torch.zeros(key_dim, key_components if key_dim else 0))
        self.net = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def inputs(self, distribution: torch.Tensor, keys: torch.Tensor, use_key: bool) -> torch.Tensor:
        """gate_inputs with this gate's key projection: (n, 5), (n, d) -> (n, F)."""
        return gate_inputs(distribution, keys, use_key, self.projection)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.mean) / self.std)[:, 0]  # (n,)

    @torch.inference_mode()
    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """(n, F) -> (n,) float32 probabilities in [0, 1]."""
        return torch.sigmoid(self.logits(x.float()))


KNN_LOGPROB_FLOOR = -1e4
"""log p_kNN of a target no neighbour predicts, in the mixture loss (exp of it is 0; -inf has no gradient)."""


def fit_gate(distribution: torch.Tensor, keys: torch.Tensor, lm: torch.Tensor, knn: torch.Tensor, lmbda: float,
             config: GateConfig) -> RetrievalGate:
    """Fit a gate on the tuning tokens' distribution features (n, 5) and keys (n, d) to their log p_LM (n,)
    and log p_kNN (n,) of the target (full batch AdamW): "mixture" maximises the kNN-LM likelihood with the
    predicted lambda(x); "weighted_label" fits the sign of the gain at `lmbda`, weighted by its size."""
    torch.manual_seed(config.seed)
    projection = key_projection(keys, config.key_components) if config.key_components else None  # (d, P)
    x = gate_inputs(distribution, keys, config.use_key, projection)  # (n, F)
    gate = RetrievalGate(x.shape[1], config.hidden, keys.shape[1] if projection is not None else 0,
                         projection.shape[1] if projection is not None else 0)
    if projection is not None:
        gate.projection.copy_(projection)
    gate.mean.copy_(x.mean(dim=0))
    gate.std.copy_(x.std(dim=0).clamp(min=1e-6))
    lm, knn = lm.float(), knn.float().clamp(min=KNN_LOGPROB_FLOOR)  # (n,), (n,)
    gain = torch.logaddexp(lm + math.log1p(-lmbda), knn + math.log(lmbda)) - lm if 0 < lmbda < 1 else knn - lm
    y = (gain > 0).float()  # (n,)
    weight = gain.abs().clamp(max=GAIN_CAP)  # (n,) a token matters as much as it gains or loses
    weight = weight / weight.mean() if float(weight.sum()) > 0 else torch.ones_like(weight)
    opt = torch.optim.AdamW(gate.net.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    for _ in range(config.steps):
        opt.zero_grad()
        o = gate.logits(x)  # (n,) logit of lambda(x) / of P(helps)
        if config.objective == "mixture":  # He et al. 2021: -log((1 - lambda) p_LM + lambda p_kNN)
            loss = -torch.logaddexp(lm + nn.functional.logsigmoid(-o), knn + nn.functional.logsigmoid(o)).mean()
        else:
            loss = nn.functional.binary_cross_entropy_with_logits(o, y, weight=weight)
        loss.backward()
        opt.step()
    return gate.eval()


def score_quantiles(scores: torch.Tensor) -> tuple[float, ...]:
    """QUANTILES + 1 quantiles of scores (n,)."""
    qs = torch.linspace(0, 1, QUANTILES + 1, dtype=torch.float64)
    return tuple(float(v) for v in torch.quantile(scores.double(), qs))


def threshold_for_fraction(settings: GateSettings, fraction: float) -> float:
    """The score threshold that skips about `fraction` of the searches, from the fitted tokens' score
    distribution (a token searches when its score >= the threshold); fraction 0 is threshold 0 (always)."""
    if not 0.0 <= fraction < 1.0:
        raise MemlmError(f"--adaptive-fraction must be in [0, 1), got {fraction}")
    if fraction == 0.0:
        return 0.0
    q = torch.tensor(settings.score_quantiles, dtype=torch.float64)
    pos = fraction * QUANTILES
    lo = int(pos)
    return float(q[lo] + (q[min(lo + 1, QUANTILES)] - q[lo]) * (pos - lo))


def save_gate(gate: RetrievalGate, settings: GateSettings, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    torch.save(gate.state_dict(), out / GATE_WEIGHTS)
    (out / GATE_SETTINGS).write_text(json.dumps(dataclasses.asdict(settings), indent=2) + "\n")
    return out


def load_gate(directory: Path) -> tuple[RetrievalGate, GateSettings]:
    """A gate directory written by save_gate; refused in one line when it is not one."""
    path = Path(directory)
    if not (path / GATE_WEIGHTS).is_file() or not (path / GATE_SETTINGS).is_file():
        raise MemlmError(f"{path} is not a retrieval gate (memlm train-gate writes {GATE_WEIGHTS} and {GATE_SETTINGS})")
    raw = json.loads((path / GATE_SETTINGS).read_text())
    known = {f.name for f in dataclasses.fields(GateConfig)}
    if set(raw["config"]) != known or set(raw) != {f.name for f in dataclasses.fields(GateSettings)}:
        raise MemlmError(f"{path} was written by another version of memlm train-gate; fit the gate again")
    raw["config"] = GateConfig(**raw["config"])
    raw["fitted_documents"] = tuple(raw["fitted_documents"])
    raw["score_quantiles"] = tuple(raw["score_quantiles"])
    settings = GateSettings(**raw)
    gate = RetrievalGate(settings.n_features, settings.config.hidden, settings.key_dim, settings.config.key_components)
    gate.load_state_dict(torch.load(path / GATE_WEIGHTS, map_location="cpu", weights_only=True))
    return gate.eval(), settings


@dataclass(frozen=True)
class AdaptiveConfig:
    """Adaptive retrieval in an evaluation: the gate and the score a token needs to be searched."""

    gate: RetrievalGate
    """The fitted gate."""
    settings: GateSettings
    """Its settings.json."""
    threshold: float
    """Search when the gate's score >= threshold (0: always, plain kNN-LM)."""

    def allowed(self, distribution: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """(n,) bool: the tokens that may search, from their distribution features (n, 5) and keys (n, d)."""
        if self.threshold <= 0.0:
            return torch.ones(distribution.shape[0], dtype=torch.bool)
        x = self.gate.inputs(distribution, keys, self.settings.config.use_key)  # (n, F)
        return self.gate.scores(x) >= self.threshold
