"""Any Hugging Face causal LM as the base of kNN-LM, Score and Generate.

`load_hf_causal_lm(source)` loads a local Hugging Face directory, a GGUF file (transformers'
`gguf_file=`) or, when online, a hub id as `AutoModelForCausalLM` (the `hf` extra) in the dtype and
on the device asked for, and wraps it as `HFCausalLM`, which answers memlm's `CausalLM` seam
(memlm.model.pretrained): `model(idx, state, logits_from) -> LMOutput(logits, knn_key, state)`, like
memlm's Decoder. Sliding-window scoring, datastore builds, kNN-LM evaluation and KV-cache generation
then run unchanged.

The kNN key (Khandelwal et al. 2020: the input of the last layer's feed-forward block, after its norm)
is read by a forward pre-hook on the module that `find_key_module` picks by one rule over the module
tree, with no per-model-type table (the popular transformers kNN-LM code keeps one and breaks on every
new architecture):
  1. the blocks are the outermost `nn.ModuleList` with as many entries as the config's
     num_hidden_layers (GPT-2 `transformer.h`, GPT-NeoX `gpt_neox.layers`, Llama/Mistral/Qwen2/Gemma
     `model.layers`);
  2. the key module is the one child of the last block whose name says feed-forward
     (FEED_FORWARD_NAME: `mlp`, `ffn`, `feed_forward`, `moe`) and that holds a weight matrix (which
     leaves out NeoX's `post_mlp_dropout` and Gemma2's `post_feedforward_layernorm`).
Every pre-norm block calls that module on its normalised input (GPT-2 ln_2, NeoX
post_attention_layernorm, Llama post_attention_layernorm, Gemma2 pre_feedforward_layernorm), so its
input is the paper's key. `key_module=` (`--key-module PATH`) overrides the rule; errors name the
modules looked at.

Memories that change attention (XL, compressive, Memorizing, SPALM) need memlm's decoder: an HF model
refuses any state but its KV cache (`require_decoder` in memlm.model.pretrained says so in one line).

Shape legend: B batch, T tokens, C hidden width (the key width), V vocab.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memlm.errors import MemlmError
from memlm.files import sha256_file
from memlm.model.decoder import KVCache, LMOutput
from memlm.model.pretrained import Pretrained, files_fingerprint
from memlm.model.tokenizer import Tokenizer

HF_PREFIX = "hf:"
"""`--model hf:SOURCE` loads SOURCE (a directory, a .gguf file or a hub id) with transformers."""

KEY_MODULE_HELP = ("dotted path of the module whose input is the kNN key, for a model run through transformers "
                   "(default: the last block's feed-forward module, memlm.model.hf_model.find_key_module)")
"""Help of --key-module, wherever a command loads a model (datastore build, eval)."""

FEED_FORWARD_NAME = re.compile(r"mlp|ffn|feed_?forward|moe", re.IGNORECASE)
"""Names of a block's feed-forward child, across architectures (rule 2 of find_key_module)."""

SAFE_WEIGHTS = "*.safetensors"
"""Weight files an HF directory is loaded from, fingerprinted in name order."""
PICKLED_WEIGHTS = "*.bin"
"""Pickled torch weight files (pytorch_model.bin): loading one can run code, so they are read only with
--allow-pickle-weights, and only where a directory has no safetensors."""
ALLOW_PICKLE_FLAG = "--allow-pickle-weights"
"""The command-line flag that lets a transformers model load from pickled weights (memlm.cli.options)."""


@dataclass(frozen=True)
class HFModelConfig:
    """What memlm reads of a transformers model: the fields the kNN-LM, scoring and generation paths use."""

    name: str
    """Where the model came from (directory, .gguf file or hub id)."""
    model_type: str
    """transformers' model_type (gpt2, gpt_neox, llama, qwen2, ...)."""
    vocab_size: int
    """Width V of the output logits."""
    n_embd: int
    """Width C of the kNN key (the input of the key module)."""
    max_seq_len: int
    """max_position_embeddings: longer windows are refused."""
    key_module: str
    """Dotted path of the module whose input is the kNN key (find_key_module, or --key-module)."""
    n_layer: int
    """Decoder layers (num_hidden_layers): with n_kv_head and head_dim, what a token's KV cache takes."""
    n_kv_head: int
    """Key/value heads (num_key_value_heads, else num_attention_heads)."""
    head_dim: int
    """Width of one head (head_dim, else hidden_size / num_attention_heads)."""

    @property
    def key_description(self) -> str:
        """Name of the kNN key in datastore manifests: never equal to a memlm Decoder's, so a datastore
        built through transformers is refused by memlm's decoder and back (floats differ slightly)."""
        return f"input:{self.key_module}"


def key_module_of(key_description: str) -> str | None:
    """The key module named by a manifest's key layer written by HFModelConfig.key_description ("input:PATH"
    -> PATH), or None for a key of memlm's decoder (so reopening a datastore's model finds the same key)."""
    prefix = "input:"
    return key_description[len(prefix):] if key_description.startswith(prefix) else None


@dataclass(frozen=True)
class HFKVCache:
    """Generation state of an HF model: transformers' cache, extended in place by each forward pass
    (so a state is used for exactly one pass, as memlm.engine's caches are)."""

    past: Any
    """transformers Cache (DynamicCache), or None before the first pass."""
    length: int
    """Tokens in the cache."""
    max_len: int
    """Most tokens the cache may hold (the model's max_seq_len, or less)."""


# -- the key module -------------------------------------------------------------------------------


def find_key_module(model: nn.Module, n_layer: int) -> str:
    """Dotted path of the kNN-key module of a transformers causal LM (the rule in the module docstring)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    blocks = [(name, m) for name, m in lists if len(m) == n_layer]
    if not blocks:
        seen = ", ".join(f"{name} ({len(m)})" for name, m in lists) or "none"
        raise MemlmError(f"no module list of {n_layer} blocks (num_hidden_layers) found; module lists: {seen}; "
                         "pass --key-module PATH")
    depth = min(name.count(".") for name, _ in blocks)
    outermost = [(name, m) for name, m in blocks if name.count(".") == depth]
    if len(outermost) > 1:
        raise MemlmError(f"several block lists of {n_layer} ({', '.join(n for n, _ in outermost)}); "
                         "pass --key-module PATH")
    name, layers = outermost[0]
    last = f"{name}.{len(layers) - 1}"
    children = list(layers[-1].named_children())
    ffn = [child for child, m in children if FEED_FORWARD_NAME.search(child) and _has_matrix(m)]
    if len(ffn) != 1:
        raise MemlmError(f"the last block {last} has {'no' if not ffn else 'more than one'} feed-forward child "
                         f"(looked at: {', '.join(c for c, _ in children)}); pass --key-module PATH")
    return f"{last}.{ffn[0]}"


def _has_matrix(module: nn.Module) -> bool:
    """A weight matrix inside: a layer that computes (norms hold vectors, dropouts nothing)."""
    return any(p.dim() >= 2 for p in module.parameters())


def _module(model: nn.Module, path: str) -> nn.Module:
    modules = dict(model.named_modules())
    if path not in modules:
        parts = path.split(".")
        known = next(".".join(parts[:i]) for i in range(len(parts), -1, -1) if ".".join(parts[:i]) in modules)
        there = [f"{known}.{c}".lstrip(".") for c, _ in modules[known].named_children()]
        raise MemlmError(f"--key-module {path}: no such module (under {known or 'the model'}: {', '.join(there)})")
    return modules[path]


# -- the wrapper ----------------------------------------------------------------------------------


class HFCausalLM(nn.Module):
    """A transformers causal LM behind memlm's CausalLM seam (memlm.model.pretrained)."""

    def __init__(self, hf: nn.Module, config: HFModelConfig) -> None:
        super().__init__()
        self.hf = hf
        self.config = config
        self.key_module = _module(hf, config.key_module)

    @property
    def device(self) -> torch.device:
        return self.hf.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.get_input_embeddings().weight.dtype

    def forward(self, idx: torch.Tensor, state: Any = None, logits_from: int = 0) -> LMOutput:
        """idx: (B, T) int64 token ids; state: None, an empty memlm KVCache (what generation starts with:
        only its max_len is read) or the HFKVCache of the previous pass; logits_from as Decoder.forward.
        Returns LMOutput(logits (B, T - logits_from, V), knn_key (B, T, C), HFKVCache or None)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (B, T), got {tuple(idx.shape)}")
        T = idx.shape[1]
        cache = _as_cache(state)
        if cache is not None and cache.length + T > cache.max_len:
            raise ValueError(f"KV cache full: {cache.length} + {T} tokens exceed max_len {cache.max_len}")
        keys: list[torch.Tensor] = []

        kept = T - logits_from
        handle = self.key_module.register_forward_pre_hook(_capture_input(keys), with_kwargs=True)
        try:
            # logits_to_keep=0 means "all" to transformers: keep one and drop it below when none is asked.
            out = self.hf(input_ids=idx, cache=None if cache is None else cache.past,
                          use_cache=cache is not None, logits_to_keep=max(kept, 1))
        finally:
            handle.remove()
        if len(keys) != 1:
            raise MemlmError(f"{self.config.key_module} ran {len(keys)} times in one forward pass; "
                             "pass --key-module PATH of a module that runs once")
        logits = out.logits[:, out.logits.shape[1] - kept:]  # (B, T - logits_from, V)
        knn_key = keys[0]  # (B, T, C)
        new_state = None if cache is None else HFKVCache(out.cache, cache.length + T, cache.max_len)
        return LMOutput(logits, knn_key, new_state)


def _capture_input(into: list[torch.Tensor]) -> Any:
    """A forward pre-hook (with_kwargs=True) that appends the module's first input (B, T, C) to `into`."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        into.append(args[0] if args else next(iter(kwargs.values())))

    return hook


def _as_cache(state: Any) -> HFKVCache | None:
    if state is None or isinstance(state, HFKVCache):
        return state
    if isinstance(state, KVCache) and state.length == 0:
        return HFKVCache(None, 0, state.max_len)
    raise MemlmError(f"a {type(state).__name__} memory needs memlm's decoder, which loads any Llama-family "
                     "checkpoint; this model runs through transformers (kNN-LM and plain generation only)")


# -- loading --------------------------------------------------------------------------------------


def load_hf_causal_lm(
    source: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, key_module: str | None = None,
    gguf_tokenizer: Tokenizer | None = None, allow_pickle: bool = False,
) -> Pretrained:
    """Load SOURCE with transformers: a local directory (config.json, weights, tokenizer.json), a .gguf file
    (dequantised by transformers' gguf_file= loader, which needs accelerate) or a hub id (online only; the
    snapshot is downloaded into the Hugging Face cache, then read as a directory).

    gguf_tokenizer: a .gguf's tokenizer, as memlm reads it (memlm.model.weights.tokenizer_from_gguf, 1 s
        where transformers' takes 10; the same ids); required for a .gguf, refused otherwise.
    allow_pickle: read pickled *.bin weights from a directory that has no *.safetensors (PICKLED_WEIGHTS);
        otherwise such a directory is refused, since unpickling can run the file's code.
    The fingerprint is that of the weight files (files_fingerprint), the tokenizer's that of its JSON.
    """
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        raise MemlmError("loading a Hugging Face model needs transformers: pip install 'memlm[hf]'") from e
    hf_logging.disable_progress_bar()  # one line per command, as memlm's own loaders
    path = Path(source).expanduser()
    is_gguf = path.is_file() and path.suffix == ".gguf"
    if is_gguf != (gguf_tokenizer is not None):
        raise MemlmError(f"{source}: a .gguf file loads with its tokenizer (gguf_tokenizer), anything else with its own")
    if gguf_tokenizer is not None:
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        tokenizer, fingerprint = gguf_tokenizer, sha256_file(path)
    else:
        if not path.is_dir():
            path = _snapshot(source, allow_pickle)
        if not (path / "config.json").is_file():
            raise MemlmError(f"{path} has no config.json; not a Hugging Face model directory")
        files = _weight_files(path, allow_pickle)
        safe = files[0].match(SAFE_WEIGHTS)  # transformers reads the files fingerprinted, never the others
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True,
                                                  use_safetensors=safe)
        tokenizer, fingerprint = Tokenizer.from_dir(path), files_fingerprint(files)
    hf = hf.to(device).eval()
    return Pretrained(HFCausalLM(hf, hf_config(hf, source, key_module)), tokenizer, fingerprint)


def hf_config(hf: nn.Module, source: str, key_module: str | None) -> HFModelConfig:
    """The HFModelConfig of a loaded transformers model (its text config; key module found or checked)."""
    text = hf.config.get_text_config()
    max_len = getattr(text, "max_position_embeddings", None)
    if not isinstance(max_len, int):
        raise MemlmError(f"{source}: the config has no max_position_embeddings; memlm needs the model's context")
    path = key_module if key_module is not None else find_key_module(hf, int(text.num_hidden_layers))
    heads = int(text.num_attention_heads)
    return HFModelConfig(name=source, model_type=str(hf.config.model_type),
                         vocab_size=int(hf.get_output_embeddings().weight.shape[0]),
                         n_embd=_key_width(hf, _module(hf, path)), max_seq_len=max_len, key_module=path,
                         n_layer=int(text.num_hidden_layers),
                         n_kv_head=int(getattr(text, "num_key_value_heads", None) or heads),
                         head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads))


@torch.inference_mode()
def _key_width(hf: nn.Module, module: nn.Module) -> int:
    """Width C of the key module's input, measured on a one-token forward pass (a --key-module of any
    width is recorded truly)."""
    inputs: list[torch.Tensor] = []
    handle = module.register_forward_pre_hook(_capture_input(inputs), with_kwargs=True)
    try:
        hf(input_ids=torch.zeros(1, 1, dtype=torch.long, device=hf.get_input_embeddings().weight.device),
           use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    if not inputs:
        raise MemlmError("the key module did not run in a forward pass; pass --key-module PATH of one that does")
    return int(inputs[0].shape[-1])


def _weight_files(directory: Path, allow_pickle: bool) -> list[Path]:
    """The weight files transformers loads: the *.safetensors, else the pickled *.bin if allowed."""
    safe = sorted(directory.glob(SAFE_WEIGHTS))
    if safe:
        return safe
    pickled = sorted(directory.glob(PICKLED_WEIGHTS))
    if pickled and allow_pickle:
        return pickled
    if pickled:
        names = ", ".join(f.name for f in pickled)
        raise MemlmError(f"{directory} has only pickled weights ({names}), which can run code when loaded: "
                         f"pass {ALLOW_PICKLE_FLAG} if you trust them, or save them as safetensors")
    if allow_pickle:
        raise MemlmError(f"{directory} has no weights ({SAFE_WEIGHTS} or {PICKLED_WEIGHTS})")
    raise MemlmError(f"{directory} has no {SAFE_WEIGHTS} weights (pickled {PICKLED_WEIGHTS} load only with "
                     f"{ALLOW_PICKLE_FLAG})")


def _snapshot(repo_id: str, allow_pickle: bool,
              allow: Sequence[str] = ("*.json", SAFE_WEIGHTS, "*.model", "*.txt")) -> Path:
    """A hub model's files in the Hugging Face cache (online; offline only what is cached already); pickled
    weights only when allowed."""
    from huggingface_hub import snapshot_download

    patterns = [*allow, PICKLED_WEIGHTS] if allow_pickle else list(allow)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # huggingface_hub raises many kinds (offline, not found, gated, bad id)
        raise MemlmError(f"cannot load {repo_id!r}: not a local path, and the hub says: {e}") from e
