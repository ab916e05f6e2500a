"""A loaded model: the Decoder built from a state dict, its tokenizer and its fingerprint.

Shared by every loader (memlm.model.weights for GGUF files, Hugging Face directories and random
presets; memlm.model.checkpoint for our checkpoints), so that neither loader imports the other.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from memlm.errors import MemlmError
from memlm.model.config import ModelConfig
from memlm.model.decoder import Decoder
from memlm.model.tokenizer import Tokenizer


class Pretrained(NamedTuple):
    model: Decoder
    """The decoder, in eval mode, on the requested device and dtype."""
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
