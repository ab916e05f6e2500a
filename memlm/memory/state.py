"""Make an empty memory for a MemoryConfig, or restore one from its state_dict.
"""

from __future__ import annotations

import torch

from memlm.memory.compressive import CompressiveMemory, Compressor
from memlm.model.memory_config import MemoryConfig, memorizing_layer, resolve_knn_backend
from memlm.memory.memorizing import LOCAL_BACKENDS, KnnAttention, MemorizingMemory
from memlm.memory.xl import XLMemory
from memlm.model.decoder import LayerMemory
from memlm.memory.knn_store import KeyValueMemory


def new_memory(
    config: MemoryConfig, batch_size: int, device: torch.device | str = "cpu", compressor: Compressor | None = None,
    reproject: bool = False, *, knn_attention: KnnAttention | None = None, knn_store: KeyValueMemory | None = None,
    n_layer: int | None = None,
) -> XLMemory | MemorizingMemory | None:
    """An empty memory for `config` (None for kind "none"); reproject: see XLMemory (True for training).

    A conv compressor of space "x" (trained by memlm train) compresses layer inputs, so its memory
    re-projects whatever `reproject` says.
    Kind "memorizing" needs the rest, all three: knn_attention (the layer's parameters), knn_store (an
    EMPTY KeyValueMemory of batch_size * n_kv_head streams of head_dim keys and values and knn_mem_size
    entries, e.g. memlm.jobs.memorizing.open_knn_store) and n_layer (the model's, for memorizing_layer).
    The state uses the store and hands it on from state to state; the caller closes it when done."""
    if config.kind == "memorizing":
        if knn_attention is None or knn_store is None or n_layer is None:
            raise ValueError("a memorizing memory needs knn_attention, knn_store and n_layer")
        if int(knn_store.sizes().sum()) != 0 or knn_store.capacity != config.knn_mem_size:
            raise ValueError(f"a new memorizing memory needs an empty kNN store of {config.knn_mem_size} entries per "
                             f"stream, got capacity {knn_store.capacity} holding {int(knn_store.sizes().sum())}")
        xl = XLMemory.empty(batch_size, config.mem_len, sink_tokens=config.sink_tokens, device=device,
                            reproject=reproject)
        return MemorizingMemory(xl, memorizing_layer(config, n_layer), knn_store, knn_attention, config.knn_top_k,
                                resolve_knn_backend(config))
    if knn_attention is not None or knn_store is not None:
        raise ValueError(f"knn_attention and knn_store apply to a memorizing memory only, not {config.kind!r}")
    if config.kind == "none":
        return None
    if config.kind == "compressive" and config.compress_fn == "conv" and compressor is not None:
        reproject = reproject or compressor.space == "x"
    if config.kind in ("xl", "spalm"):  # SPALM's short-term memory is the XL memory (memlm.memory.spalm)
        return XLMemory.empty(batch_size, config.mem_len, sink_tokens=config.sink_tokens, device=device,
                              reproject=reproject)
    return CompressiveMemory.empty(
        batch_size, config.mem_len, config.cmem_len, config.compress_rate, config.compress_fn,
        sink_tokens=config.sink_tokens, device=device, compressor=compressor, reproject=reproject,
    )


def memory_from_state_dict(
    d: dict, device: torch.device | str = "cpu", compressor: Compressor | None = None, *,
    knn_attention: KnnAttention | None = None, knn_store: KeyValueMemory | None = None,
) -> XLMemory | MemorizingMemory:
    """Inverse of `state_dict` (the compressor, a module, is passed in separately).

    Memorizing: knn_attention and an EMPTY knn_store opened as for new_memory (same streams, capacity
    and backend as saved) are passed in; a local backend's saved contents are loaded into it, a
    service memory (not saved) starts empty."""

    def layers(x):
        if x is None:
            return None
        return tuple(LayerMemory(*(None if t is None else t.to(device) for t in m)) for m in x)

    if d["kind"] == "memorizing":
        if knn_attention is None or knn_store is None:
            raise ValueError("a memorizing memory needs knn_attention and knn_store to be restored")
        if knn_store.capacity != d["capacity"]:
            raise ValueError(f"saved kNN memory has {d['capacity']} entries per stream, the store {knn_store.capacity}")
        xl = memory_from_state_dict(d["xl"], device)
        if d["backend"] in LOCAL_BACKENDS and d["store"] is not None:
            knn_store.load_state_dict(d["store"])  # type: ignore[attr-defined]
        return MemorizingMemory(xl, d["layer"], knn_store, knn_attention, d["top_k"], d["backend"])
    next_pos, seen = d["next_pos"].to(device), d["seen"].to(device)
    reproject = bool(d.get("reproject", False))
    if d["kind"] == "xl":
        return XLMemory(d["mem_len"], d["sink_tokens"], next_pos, seen, layers(d["sink"]), layers(d["mem"]), reproject)
    return CompressiveMemory(
        d["mem_len"], d["cmem_len"], d["rate"], d["compress_fn"], d["sink_tokens"], next_pos, seen,
        layers(d["sink"]), layers(d["mem"]), layers(d["cmem"]), compressor, reproject=reproject,
    )
