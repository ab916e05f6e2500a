"""Shared test setup: offline mode for every test, and the helper that finds the fetched SmolLM2."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Tests never touch a hub: transformers and huggingface_hub fail fast instead of downloading.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One compute thread per process: tests start servers as subprocesses beside the test process, and on
# a machine with few cores two OpenMP pools spinning against each other make tiny forwards 10-20x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A benchmark's main() run by a test writes its JSON result (benchmarks/harness.py) here, never into the
# checked-in docs/results/data.
os.environ.setdefault("MEMLM_RESULTS_DIR", tempfile.mkdtemp(prefix="memlm-test-results-"))

import torch  # noqa: E402  (after the environment above)

torch.set_num_threads(1)

SMOLLM2_SKIP = "SmolLM2 weights not fetched; run: memlm fetch smollm2-135m"



def smollm2_path() -> Path:
    """The cached SmolLM2 GGUF, or skip the calling test when it has not been fetched.

    Test modules should use the `smollm2_gguf` fixture: `from conftest import ...` is ambiguous
    because tests/datastore and tests/services have their own conftest.py (whichever is imported
    first owns the name "conftest" in a full run).
    """
    from memlm.model.weights import model_path

    path = model_path("smollm2-135m")
    if not path.is_file():
        pytest.skip(SMOLLM2_SKIP)
    return path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Fixture form of `smollm2_path()`."""
    return smollm2_path()


@pytest.fixture(scope="session")
def smollm2_model(smollm2_gguf):
    """SmolLM2-135M through memlm's decoder (`load_pretrained("smollm2-135m")`: float32, CPU), loaded once
    for the session: each load dequantises the whole GGUF (about 5 s), and the modules that use this one
    only read it (none trains it, changes its weights or hooks it)."""
    from memlm.model.weights import load_pretrained

    return load_pretrained("smollm2-135m")


@pytest.fixture(scope="session")
def hf_llama():
    """The `build_hf_llama(config, state_dict)` function below."""
    return build_hf_llama


def build_hf_llama(config, state_dict, attn_implementation: str = "eager"):
    """transformers' LlamaForCausalLM holding our `state_dict`: the reference model.

    config: a memlm ModelConfig; state_dict: our parameter names (no "model." prefix).
    attn_implementation: "eager" (transformers' own attention arithmetic: an independent oracle, equal
        to ours up to float32 summation order) or "sdpa" (the same torch kernel as ours: bit-identical).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.n_embd, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head, num_key_value_heads=config.n_kv_head,
        rope_theta=config.rope_theta, rms_norm_eps=config.norm_eps, tie_word_embeddings=config.tie_embeddings,
        max_position_embeddings=config.max_seq_len, attn_implementation=attn_implementation,
    )
    with torch.device("meta"):  # skip transformers' random init of weights that are replaced anyway
        model = LlamaForCausalLM(hf_config)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hf_config)  # its buffer, on the CPU
    hf_state = {("lm_head.weight" if k == "lm_head.weight" else "model." + k): v for k, v in state_dict.items()}
    if config.tie_embeddings:
        hf_state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(hf_state, strict=False, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if config.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    return model.float().eval()
