"""The memlm decoder: one Llama-family model in plain torch, with memories that enter attention.

Blocks: RMSNorm, rotary positions, grouped-query attention, SwiGLU; tied or untied output embedding.
Parameter names follow Hugging Face's LlamaForCausalLM without the "model." prefix, so HF
checkpoints load by name (memlm.model.weights).

Memories are explicit. `Decoder.forward(idx, state)` takes a `DecoderState` (a KV cache for
incremental decoding, a Transformer-XL or compressive memory from memlm.memory, or None) and returns
`LMOutput(logits, knn_key, state)` with the updated state. The state decides what each layer attends
to besides the current segment (`layer_memory`), where the new tokens sit (`positions`) and how the
layer's new keys and values are kept (`update`). The module itself holds no state between calls.
A layer's memory can also carry a kNN retrieval (`LayerMemory.knn`: the Memorizing Transformer's layer,
memlm.memory.memorizing): attention then mixes local attention with attention over the retrieved
entries by a per-head gate. Every other state leaves it None and the plain path is unchanged.

Shape legend:
    B batch, T tokens in the segment, S memory slots, C n_embd, V vocab,
    nh query heads, nkv key/value heads, hs head size.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from memlm.model import cpu_gemm
from memlm.model.config import ModelConfig


class KnnRetrieval(Protocol):
    """The memorizing layer's kNN memory, as the attention layer sees it (memlm.memory.memorizing)."""

    def attend(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (B, nh, T, hs) queries before rotary -> (attention over the retrieved entries (B, nh, T, hs),
        gate (B, nh, T) in [0, 1]: 0 exactly where nothing was retrieved)."""
        ...


class LayerMemory(NamedTuple):
    """What one attention layer attends to besides the current segment.

    Keys are stored *before* rotary embedding with their absolute positions, so that rotary is applied
    at attention time and only relative distances matter (compressed slots can carry fractional positions).
    """

    k: torch.Tensor  # (B, S, nkv, hs) un-rotated keys
    v: torch.Tensor  # (B, S, nkv, hs) values
    pos: torch.Tensor  # (B, S) float32 absolute positions
    valid: torch.Tensor  # (B, S) bool; False slots are masked out (empty or reset rows)
    x: torch.Tensor | None = None  # (B, S, C) the layer's normalised input, or None
    # When a memory carries x, attention projects the memory's keys and values from it with the current
    # weights, as Transformer-XL does in training (Dai et al. 2019: k = SG(h) W_k): W_k and W_v then
    # learn from attention to the memory, and the keys are never a step stale. k and v are ignored then.
    knn: KnnRetrieval | None = None  # the memorizing layer's kNN memory (Wu et al. 2022), or None


class CachedAttention(ABC):
    """One layer's view of a preallocated KV cache for one forward pass (memlm.engine.kv_cache).

    Attention hands it the segment's projections; it applies rotary at the tokens' positions, writes
    the rotated keys and values into the cache (rotary is applied once per key, when it is written),
    and attends over each row's cached slots. The cache is written in place: a state that yields one
    is used for exactly one forward pass."""

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (B, nh, T, hs), k, v: (B, nkv, T, hs), all before rotary -> attention output (B, nh, T, hs)."""
        ...


class DecoderState(Protocol):
    """A memory policy: KV cache, Transformer-XL memory, compressive memory, ..."""

    def positions(self, batch_size: int, seq_len: int, device: torch.device) -> torch.Tensor:
        """Absolute positions of the next segment's tokens, (B, T) float32."""
        ...

    def layer_memory(self, layer: int) -> LayerMemory | CachedAttention | None:
        """Memory that `layer` attends to before the segment, or None; or the layer's view of a
        preallocated KV cache, which then does the attention itself (CachedAttention)."""
        ...

    def update(self, new_kv: list[LayerMemory]) -> DecoderState:
        """Return the state after a segment whose per-layer un-rotated keys/values are `new_kv`."""
        ...


class LMOutput(NamedTuple):
    logits: torch.Tensor  # (B, T - logits_from, V)
    knn_key: torch.Tensor  # (B, T, C) the kNN-LM key at every position
    state: DecoderState | None  # the updated memory, or None when none was passed in


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 for stability under bf16/fp16, as HF Llama does.
        input_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)


def rotary_inv_freq(head_dim: int, theta: float, device: torch.device | str) -> torch.Tensor:
    """The rotary frequencies theta^(-2i/hs), (hs/2,) float32: the one definition (also memlm.engine)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))


def rotary_cos_sin(pos: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """pos: (B, S) float positions -> cos, sin of shape (B, 1, S, hs), float32."""
    inv_freq = rotary_inv_freq(head_dim, theta, pos.device)  # (hs/2,)
    angles = pos.float()[..., None] * inv_freq  # (B, S, hs/2)
    angles = torch.cat([angles, angles], dim=-1)  # (B, S, hs), HF "rotate_half" layout
    return angles.cos()[:, None], angles.sin()[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, h, S, hs) -> rotated x, same shape and dtype."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose CPU float32 inference runs the GEMM memlm.model.cpu_gemm
    picks (cpu_gemm_as): F.linear's, or oneDNN's over a copy of the weight kept on the layer (not saved, not
    trained)."""

    _packed: tuple[tuple, nn.Module] | None = None
    """(the weight's key when copied, oneDNN's layer over the copy): memlm.model.cpu_gemm.linear's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.linear(self, x)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_packed", None)  # remade on first use, never saved twice
        return state


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        hs = config.head_dim
        self.q_proj = Linear(config.n_embd, config.n_head * hs, bias=False)
        self.k_proj = Linear(config.n_embd, config.n_kv_head * hs, bias=False)
        self.v_proj = Linear(config.n_embd, config.n_kv_head * hs, bias=False)
        self.o_proj = Linear(config.n_head * hs, config.n_embd, bias=False)

    def forward(
        self, x: torch.Tensor, pos: torch.Tensor, memory: LayerMemory | CachedAttention | None
    ) -> tuple[torch.Tensor, LayerMemory]:
        """x: (B, T, C), pos: (B, T) -> output (B, T, C) and this segment's un-rotated (k, v)."""
        B, T, _ = x.shape
        cfg = self.config
        hs = cfg.head_dim
        q = self.q_proj(x).view(B, T, cfg.n_head, hs)  # (B, T, nh, hs)
        k = self.k_proj(x).view(B, T, cfg.n_kv_head, hs)  # (B, T, nkv, hs)
        v = self.v_proj(x).view(B, T, cfg.n_kv_head, hs)  # (B, T, nkv, hs)
        segment_kv = LayerMemory(k, v, pos, torch.ones(B, T, dtype=torch.bool, device=x.device), x)
        if isinstance(memory, CachedAttention):
            # The engine's preallocated cache: rotary, cache writes and masking are its own.
            y = memory.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (B, nh, T, hs)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, cfg.n_head * hs)), segment_kv
        if memory is not None and memory.x is not None:
            S = memory.x.shape[1]
            mx = memory.x.to(x.dtype)  # (B, S, C)
            memory = memory._replace(
                k=self.k_proj(mx).view(B, S, cfg.n_kv_head, hs), v=self.v_proj(mx).view(B, S, cfg.n_kv_head, hs)
            )  # (B, S, nkv, hs) each

        # Positions relative to the segment start keep rotary angles small (exact in float32 even
        # deep into long documents); only relative distances matter for the scores.
        origin = pos[:, :1]  # (B, 1)
        if memory is None or memory.k.shape[1] == 0:
            keys, values, key_pos = k, v, pos
            mask = None
        else:
            keys = torch.cat([memory.k.to(k.dtype), k], dim=1)  # (B, S+T, nkv, hs)
            values = torch.cat([memory.v.to(v.dtype), v], dim=1)  # (B, S+T, nkv, hs)
            key_pos = torch.cat([memory.pos.to(pos.dtype), pos], dim=1)  # (B, S+T)
            S = memory.k.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()  # (T, T)
            mem_mask = memory.valid[:, None, :].expand(B, T, S)  # (B, T, S)
            mask = torch.cat([mem_mask, causal.expand(B, T, T)], dim=-1)[:, None]  # (B, 1, T, S+T)

        knn = memory.knn if memory is not None else None
        # The kNN memory is searched and scored with the query before rotary (its keys are stored
        # un-rotated): retrieved keys come from arbitrarily far back, where relative rotary angles mean
        # nothing to the model, and the paper gives the memory no positional signal (KnnRetrieval.attend).
        q_plain = q.transpose(1, 2) if knn is not None else None  # (B, nh, T, hs)
        cos_q, sin_q = rotary_cos_sin(pos - origin, hs, cfg.rope_theta)  # (B, 1, T, hs)
        cos_k, sin_k = rotary_cos_sin(key_pos - origin, hs, cfg.rope_theta)  # (B, 1, S+T, hs)
        q = apply_rotary(q.transpose(1, 2), cos_q, sin_q)  # (B, nh, T, hs)
        keys = apply_rotary(keys.transpose(1, 2), cos_k, sin_k)  # (B, nkv, S+T, hs)
        values = values.transpose(1, 2)  # (B, nkv, S+T, hs)

        if mask is None:
            y = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        if knn is not None:
            # Wu et al. 2022: a learned per-head gate mixes retrieved and local attention.
            memory_y, gate = knn.attend(q_plain)  # (B, nh, T, hs), (B, nh, T)
            g = gate[..., None]  # (B, nh, T, 1)
            y = g * memory_y + (1 - g) * y  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, cfg.n_head * hs)  # (B, T, nh*hs)
        return self.o_proj(y), segment_kv


class MLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.n_embd, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.n_embd, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, pos: torch.Tensor, memory: LayerMemory | CachedAttention | None
    ) -> tuple[torch.Tensor, torch.Tensor, LayerMemory]:
        """x: (B, T, C) -> new x (B, T, C), feed-forward input (B, T, C), this segment's (k, v)."""
        attn_out, segment_kv = self.self_attn(self.input_layernorm(x), pos, memory)
        x = x + attn_out
        ffn_input = self.post_attention_layernorm(x)  # (B, T, C): the kNN-LM paper's key
        x = x + self.mlp(ffn_input)
        return x, ffn_input, segment_kv


class Decoder(nn.Module):
    """Llama-family decoder returning logits, kNN keys and the updated memory for every position."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        # GPT-2 / Llama style init for models trained from scratch; real weights overwrite it.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(
        self,
        idx: torch.Tensor,
        state: DecoderState | None = None,
        logits_from: int = 0,
    ) -> LMOutput:
        """Run one segment.

        idx: token ids, shape (B, T), int64, each in [0, V).
        state: memory to attend to and update, or None (positions start at 0, nothing is kept).
        logits_from: compute logits only for positions >= logits_from (a sliding window scores only
            the tokens after its overlap; the output head is a fifth of the model's compute).
        Returns LMOutput(logits (B, T - logits_from, V), knn_key (B, T, C), state).
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (B, T), got {tuple(idx.shape)}")
        B, T = idx.shape
        cfg = self.config
        if state is None:
            pos = torch.arange(T, device=idx.device, dtype=torch.float32).expand(B, T)  # (B, T)
        else:
            pos = state.positions(B, T, idx.device)  # (B, T)

        x = self.embed_tokens(idx)  # (B, T, C)
        knn_key = None
        new_kv: list[LayerMemory] = []
        for i, block in enumerate(self.layers):
            memory = state.layer_memory(i) if state is not None else None
            x, ffn_input, segment_kv = block(x, pos, memory)
            new_kv.append(segment_kv)
            if cfg.knn_key == "ffn_input" and i == cfg.key_layer_index:
                knn_key = ffn_input
        x = self.norm(x)  # (B, T, C)
        if cfg.knn_key == "final_hidden":
            knn_key = x
        logits = self.lm_head(x[:, logits_from:])  # (B, T - logits_from, V)
        new_state = state.update(new_kv) if state is not None else None
        return LMOutput(logits, knn_key, new_state)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


class KVCache:
    """Keeps every key and value: incremental decoding. Immutable; `update` returns a new cache.

    Refuses to grow past `max_len` (default: the model's max_seq_len) instead of silently dropping.
    """

    def __init__(self, layers: list[LayerMemory] | None, length: int, max_len: int) -> None:
        self.layers = layers
        self.length = length
        self.max_len = max_len

    @classmethod
    def empty(cls, config: ModelConfig, max_len: int | None = None) -> KVCache:
        return cls(None, 0, max_len or config.max_seq_len)

    def positions(self, batch_size: int, seq_len: int, device: torch.device) -> torch.Tensor:
        if self.length + seq_len > self.max_len:
            raise ValueError(f"KV cache full: {self.length} + {seq_len} tokens exceed max_len {self.max_len}")
        return torch.arange(self.length, self.length + seq_len, device=device, dtype=torch.float32).expand(
            batch_size, seq_len
        )

    def layer_memory(self, layer: int) -> LayerMemory | None:
        return None if self.layers is None else self.layers[layer]

    def update(self, new_kv: list[LayerMemory]) -> KVCache:
        seg_len = new_kv[0].k.shape[1]
        if self.layers is None:
            layers = [LayerMemory(m.k.detach(), m.v.detach(), m.pos, m.valid) for m in new_kv]
        else:
            layers = [
                LayerMemory(
                    torch.cat([old.k, new.k.detach()], dim=1),  # (B, S+T, nkv, hs)
                    torch.cat([old.v, new.v.detach()], dim=1),  # (B, S+T, nkv, hs)
                    torch.cat([old.pos, new.pos], dim=1),  # (B, S+T)
                    torch.cat([old.valid, new.valid], dim=1),  # (B, S+T)
                )
                for old, new in zip(self.layers, new_kv)
            ]
        return KVCache(layers, self.length + seg_len, self.max_len)


def build_model(config: ModelConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Decoder:
    """A randomly initialised Decoder on `device` in `dtype`."""
    return Decoder(config).to(device=device, dtype=dtype)


def sdpa_scale(head_dim: int) -> float:
    """Attention logit scale 1/sqrt(hs) (the SDPA default), exposed for the memory losses."""
    return 1.0 / math.sqrt(head_dim)
