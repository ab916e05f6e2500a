"""Shared test setup: offline mode for every test, and the helper that finds the fetched SmolLM2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never touch a hub: transformers and huggingface_hub fail fast instead of downloading.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SMOLLM2_SKIP = "SmolLM2 weights not fetched; run: memlm fetch smollm2-135m"


def smollm2_path() -> Path:
    """The cached SmolLM2 GGUF, or skip the calling test when it has not been fetched."""
    from memlm.weights import model_path

    path = model_path("smollm2-135m")
    if not path.is_file():
        pytest.skip(SMOLLM2_SKIP)
    return path


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """Fixture form of `smollm2_path()`."""
    return smollm2_path()


def hf_llama(config, state_dict):
    """transformers' LlamaForCausalLM (eager attention) holding our `state_dict`: the reference model.

    config: a memlm ModelConfig; state_dict: our parameter names (no "model." prefix).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.n_embd, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head, num_key_value_heads=config.n_kv_head,
        rope_theta=config.rope_theta, rms_norm_eps=config.norm_eps, tie_word_embeddings=config.tie_embeddings,
        max_position_embeddings=config.max_seq_len, attn_implementation="eager",
    )
    model = LlamaForCausalLM(hf_config)  # not on meta: the rotary inv_freq buffer must be computed
    hf_state = {("lm_head.weight" if k == "lm_head.weight" else "model." + k): v for k, v in state_dict.items()}
    if config.tie_embeddings:
        hf_state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(hf_state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if config.tie_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.float().eval()
