"""Adaptive retrieval (He, Neubig and Berg-Kirkpatrick 2021, "Efficient Nearest Neighbor Language Models",
jxhe/efficient-knnlm): a small network over cheap features of the LM predicts whether retrieval will help
the next token, and the search is skipped where it will not (the token keeps the base distribution,
lambda 0 for it).

Features (per token): the LM distribution's entropy, its top-3 log-probabilities and the top-1/top-2
margin (He et al.'s "conf" and "ent"), and optionally the kNN key itself (their "ctxt", the context
vector). The label is "the kNN-LM log-prob of the target beats the base's" (for lambda in (0, 1):
p_kNN(target) > p_LM(target)), and each token weighs in the loss as much as retrieval gains or loses on it
(|log p_kNN-LM - log p_LM| in nats at the tuned lambda): skipping the searches that matter little is what
keeps perplexity. Measured on SOTU (3,000 tuning and 3,000 held-out tokens, SmolLM2, the 81k-key datastore):
at half the searches skipped, perplexity 23.30 with this weighting and distribution features, 24.01 with
class-balanced labels, 23.53 with the key as well (it overfits a tuning split this small), 21.90 for an
oracle; plain kNN-LM 22.89, base 24.48. The gate (a 2-layer MLP, logistic output) is fitted on a tuning
split by memlm.jobs.adaptive_train and saved as a directory, gate.pt beside settings.json (GateSettings);
the evaluation documents must share no document with the ones it was fitted on (checked where opened).

Shape legend: n tokens, V vocab, F features, d key dimension, H hidden units.
"""

from __future__ import annotations

import dataclasses
import json
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


def gate_inputs(distribution: torch.Tensor, keys: torch.Tensor, use_key: bool) -> torch.Tensor:
    """The gate's input (n, F): distribution features (n, 5), then the float32 keys (n, d) if use_key."""
    parts = [distribution.float().cpu()]
    if use_key:
        parts.append(keys.detach().float().cpu())
    return torch.cat(parts, dim=1)  # (n, F)


@dataclass(frozen=True)
class GateConfig:
    """How the gate is made and fitted (`memlm train-gate`)."""

    hidden: int = 32
    """Hidden units of the 2-layer MLP."""
    use_key: bool = False
    """Feed the kNN key (He et al.'s context vector) besides the distribution features (it needs a tuning
    split far larger than the d key features; see the module docstring)."""
    steps: int = 400
    """Full-batch AdamW steps."""
    lr: float = 1e-2
    """AdamW learning rate."""
    weight_decay: float = 1e-3
    """AdamW weight decay (the tuning split is small)."""
    seed: int = 0
    """Initialisation seed."""


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
    """Accuracy at threshold 0.5 on the held-out tuning tokens (memlm.jobs.adaptive_train.HELD_OUT)."""
    score_quantiles: tuple[float, ...]
    """QUANTILES + 1 quantiles of the held-out tuning tokens' scores (for a target fraction saved)."""


class RetrievalGate(nn.Module):
    """P(retrieval helps) from gate inputs (n, F): standardised, then Linear-ReLU-Linear-sigmoid."""

    def __init__(self, n_features: int, hidden: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(n_features))
        self.register_buffer("std", torch.ones(n_features))
        self.net = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.mean) / self.std)[:, 0]  # (n,)

    @torch.inference_mode()
    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """(n, F) -> (n,) float32 probabilities in [0, 1]."""
        return torch.sigmoid(self.logits(x.float()))


def fit_gate(x: torch.Tensor, gain: torch.Tensor, config: GateConfig) -> RetrievalGate:
    """Fit a gate on inputs x (n, F) to gain (n,), the nats retrieval adds to each token's log-prob: label
    gain > 0, weight |gain| (full batch BCE)."""
    torch.manual_seed(config.seed)
    gate = RetrievalGate(x.shape[1], config.hidden)
    gate.mean.copy_(x.mean(dim=0))
    gate.std.copy_(x.std(dim=0).clamp(min=1e-6))
    y = (gain > 0).float()  # (n,)
    weight = gain.abs().clamp(max=GAIN_CAP).float()  # (n,) a token matters as much as it gains or loses
    weight = weight / weight.mean() if float(weight.sum()) > 0 else torch.ones_like(weight)
    opt = torch.optim.AdamW(gate.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    for _ in range(config.steps):
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(gate.logits(x), y, weight=weight)
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
    raw["config"] = GateConfig(**raw["config"])
    raw["fitted_documents"] = tuple(raw["fitted_documents"])
    raw["score_quantiles"] = tuple(raw["score_quantiles"])
    settings = GateSettings(**raw)
    gate = RetrievalGate(settings.n_features, settings.config.hidden)
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
        x = gate_inputs(distribution, keys, self.settings.config.use_key)  # (n, F)
        return self.gate.scores(x) >= self.threshold
