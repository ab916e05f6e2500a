"""A loaded model: the causal LM (memlm's Decoder, or a transformers model), its tokenizer and its fingerprint.

Shared by every loader (memlm.model.weights for GGUF files, Hugging Face directories and random
presets; memlm.model.checkpoint for our checkpoints; memlm.model.hf_model for any transformers causal
LM), so that no loader imports another.

`CausalLM` is the seam the kNN-LM paths need (sliding-window scoring, datastore builds, kNN-LM
evaluation, KV-cache generation; memlm.jobs.windows, memlm.engine): memlm's Decoder and
memlm.model.hf_model.HFCausalLM both answer it. Memories that enter attention need the Decoder
itself (`require_decoder`).

Shape legend: B batch, T tokens, C key width.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from memlm.errors import MemlmError
from memlm.files import sha256_file
from memlm.model.config import ModelConfig
from memlm.model.decoder import Decoder, LMOutput
from memlm.model.tokenizer import Tokenizer


class CausalLMConfig(Protocol):
    """What the kNN-LM paths read of a model's configuration (memlm.model.config.ModelConfig and
    memlm.model.hf_model.HFModelConfig)."""

    @property
    def name(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def n_embd(self) -> int:
        """Width C of the kNN key."""
        ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def key_description(self) -> str:
        """Name of the kNN key, recorded in datastore manifests and checked where they are opened."""
        ...


class CausalLM(Protocol):
    """A causal LM that gives logits and the kNN key at every position (memlm.model.decoder.Decoder,
    memlm.model.hf_model.HFCausalLM)."""

    @property
    def config(self) -> CausalLMConfig: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...

    def __call__(self, idx: torch.Tensor, state: Any = None, logits_from: int = 0) -> LMOutput:
        """idx (B, T) int64 -> LMOutput(logits (B, T - logits_from, V), knn_key (B, T, C), state); state: None,
        or a KV cache (memlm.model.decoder.KVCache, empty to start) for incremental decoding."""
        ...


class Pretrained(NamedTuple):
    model: Decoder | CausalLM
    """The model, in eval mode, on the requested device and dtype: memlm's Decoder, or a transformers
    causal LM (memlm.model.hf_model), which serves kNN-LM and plain generation only."""
    tokenizer: Tokenizer
    fingerprint: str
    """sha256 hex identifying the weights (file content, or config + seed for random presets)."""


def model_from_state_dict(
    config: ModelConfig, state_dict: dict[str, torch.Tensor], device: str | torch.device, dtype: torch.dtype, source: str
) -> Decoder:
    """A Decoder in eval mode holding `state_dict` (our parameter names; lm_head.weight optional if tied)."""
    with torch.device("meta"):
        model = Decoder(config)  # no random init of 135M parameters that are overwritten anyway
    expected = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    if config.tie_embeddings:
        expected.discard("lm_head.weight")
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    missing, unexpected = sorted(expected - state_dict.keys()), sorted(state_dict.keys() - expected)
    if missing or unexpected:
        raise MemlmError(
            f"{source}: weights do not fit the model (missing {missing[:4]}{'...' if len(missing) > 4 else ''},"
            f" unexpected {unexpected[:4]}{'...' if len(unexpected) > 4 else ''})"
        )
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, tensor in state_dict.items():
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise MemlmError(f"{source}: {name} has shape {tuple(tensor.shape)}, the config needs {tuple(params[name].shape)}")
    converted = {k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()}
    model.load_state_dict(converted, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # assign=True replaced the shared Parameter
    assert not any(p.is_meta for p in model.parameters()), "every parameter must come from state_dict"
    return model.eval()


def require_decoder(model: Decoder | CausalLM, what: str) -> Decoder:
    """`model` as memlm's Decoder, or a MemlmError in one line: `what` (e.g. "--memory xl") changes attention,
    which only memlm's decoder lets a memory enter."""
    if not isinstance(model, Decoder):
        raise MemlmError(f"{what} needs memlm's decoder (it enters attention), and {model.config.name} runs through "
                         "transformers; memlm's decoder loads any Llama-family checkpoint (a directory or .gguf "
                         "given without hf:)")
    return model


def files_fingerprint(files: Sequence[Path]) -> str:
    """The fingerprint of a model's weight files: the sha256 of the one file, else the sha256 of
    "name:digest" lines in the given order (Hugging Face directories, sharded or not)."""
    digests = [sha256_file(f) for f in files]
    if len(digests) == 1:
        return digests[0]
    return hashlib.sha256("".join(f"{f.name}:{d}\n" for f, d in zip(files, digests)).encode()).hexdigest()
