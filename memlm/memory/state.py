"""Make an empty memory for a MemoryConfig, or restore one from its state_dict.
"""

from __future__ import annotations

import torch

from memlm.memory.compressive import CompressiveMemory, Compressor
from memlm.memory.config import MemoryConfig
from memlm.memory.xl import XLMemory
from memlm.model.decoder import LayerMemory


def new_memory(
    config: MemoryConfig, batch_size: int, device: torch.device | str = "cpu", compressor: Compressor | None = None,
    reproject: bool = False,
) -> XLMemory | None:
    """An empty memory for `config` (None for kind "none"); reproject: see XLMemory (True for training).

    A conv compressor of space "x" (trained by memlm train) compresses layer inputs, so its memory
    re-projects whatever `reproject` says."""
    if config.kind == "none":
        return None
    if config.kind == "compressive" and config.compress_fn == "conv" and compressor is not None:
        reproject = reproject or compressor.space == "x"
    if config.kind == "xl":
        return XLMemory.empty(batch_size, config.mem_len, sink_tokens=config.sink_tokens, device=device,
                              reproject=reproject)
    return CompressiveMemory.empty(
        batch_size, config.mem_len, config.cmem_len, config.compress_rate, config.compress_fn,
        sink_tokens=config.sink_tokens, device=device, compressor=compressor, reproject=reproject,
    )


def memory_from_state_dict(d: dict, device: torch.device | str = "cpu", compressor: Compressor | None = None) -> XLMemory:
    """Inverse of `state_dict` (the compressor, a module, is passed in separately)."""

    def layers(x):
        if x is None:
            return None
        return tuple(LayerMemory(*(None if t is None else t.to(device) for t in m)) for m in x)

    next_pos, seen = d["next_pos"].to(device), d["seen"].to(device)
    reproject = bool(d.get("reproject", False))
    if d["kind"] == "xl":
        return XLMemory(d["mem_len"], d["sink_tokens"], next_pos, seen, layers(d["sink"]), layers(d["mem"]), reproject)
    return CompressiveMemory(
        d["mem_len"], d["cmem_len"], d["rate"], d["compress_fn"], d["sink_tokens"], next_pos, seen,
        layers(d["sink"]), layers(d["mem"]), layers(d["cmem"]), compressor, reproject=reproject,
    )

