"""The jobs' side of the Memorizing Transformer (Wu et al. 2022): one way to open a memory state
for any MemoryConfig, which parameters a memorizing run trains, and what its results record.

Training, evaluation, scoring, generation and the benchmark all open their memory here
(`open_memory`), so that a memorizing state is built one way: a kNN memory store (memlm.retrieval.
memory_factory.open_key_value_memory) of one stream per (batch row, kv head), keys and values of the head
size, `knn_mem_size` entries each, on the model's device, with the backend `resolve_knn_backend` picks
(or a retrieval-service factory the command line or a server passes in: the library never imports
services/).

Shape legend: B batch rows, nkv key/value heads, hs head size, L layers.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from memlm.errors import MemlmError
from memlm.model.memory_config import MemoryConfig, memorizing_layer, resolve_knn_backend

if TYPE_CHECKING:
    from memlm.memory.compressive import Compressor
    from memlm.memory.memorizing import KnnAttention
    from memlm.model.decoder import Decoder, DecoderState
    from memlm.memory.knn_store import KeyValueMemoryFactory

KNN_TRAIN_MODES: tuple[str, ...] = ("gate", "top")
"""What `memlm train --memory memorizing` fine-tunes besides nothing: "gate" the KnnAttention parameters
only (the decoder frozen: the paper's quick adaptation of a pretrained model), "top" those and the decoder
blocks from the memorizing layer up. From scratch everything trains."""
DEFAULT_KNN_TRAIN = "gate"
"""--knn-train when fine-tuning a pretrained model and the flag is left unset."""
TRAIN_ALL = "all"
"""What trains from scratch: the whole decoder and the KnnAttention parameters."""


def check_knn_attention(memory: MemoryConfig, knn_attention: KnnAttention | None) -> None:
    """A memorizing memory needs its KnnAttention module; other kinds must not get one."""
    if memory.kind == "memorizing" and knn_attention is None:
        raise MemlmError("--memory memorizing needs a KnnAttention module (memlm.memory.memorizing)")
    if memory.kind != "memorizing" and knn_attention is not None:
        raise MemlmError(f"a KnnAttention module applies to --memory memorizing only, not {memory.kind}")


def open_memory(
    model: Decoder,
    memory: MemoryConfig,
    batch_size: int,
    *,
    compressor: Compressor | None = None,
    knn_attention: KnnAttention | None = None,
    service: KeyValueMemoryFactory | None = None,
    reproject: bool = False,
) -> DecoderState | None:
    """An empty memory state for `memory` over `batch_size` rows on the model's device (None for "none").

    compressor: the conv compressor (compressive, compress_fn "conv").
    knn_attention: the memorizing layer's parameters (memorizing only; required there).
    service: the factory of retrieval-service memories, required by knn_backend "service".
    reproject: see memlm.memory.xl.XLMemory (True in training).
    """
    from memlm.memory.state import new_memory
    from memlm.model.pretrained import require_decoder

    if memory.kind != "none":  # a transformers model serves kNN-LM and plain generation only
        require_decoder(model, f"--memory {memory.kind}")
    check_knn_attention(memory, knn_attention)
    device = model.device
    if memory.kind != "memorizing":
        return new_memory(memory, batch_size, device, compressor, reproject)
    return new_memory(memory, batch_size, device, reproject=reproject, knn_attention=knn_attention,
                      knn_store=open_knn_store(model, memory, batch_size, service), n_layer=model.config.n_layer)


def open_knn_store(model: Decoder, memory: MemoryConfig, batch_size: int, service: KeyValueMemoryFactory | None) -> Any:
    """The empty kNN memory of a memorizing state: one stream per (row, kv head) (GQA: each query head
    searches its kv head's stream), head-size keys and values, knn_mem_size entries per stream."""
    from memlm.memory.knn_store_factory import open_key_value_memory

    cfg = model.config
    backend = resolve_knn_backend(memory)
    if backend == "service" and service is None:
        raise MemlmError("--knn-backend service needs a memory service: memlm eval --knn-service HOST:PORT (a "
                         "server passes its client in; memlm train keeps its kNN memory in process: exact or faiss)")
    streams = batch_size * cfg.n_kv_head
    return open_key_value_memory(backend, streams, cfg.head_dim, cfg.head_dim, memory.knn_mem_size, model.device,
                                 service)


def recorded_memory(memory: MemoryConfig, n_layer: int) -> MemoryConfig:
    """The memory a checkpoint's settings.json records: a memorizing memory with its layer resolved
    (memorizing_layer), so that the file says which layer was trained whatever the default becomes."""
    if memory.kind != "memorizing":
        return memory
    return dataclasses.replace(memory, knn_layer=memorizing_layer(memory, n_layer))


def resolved_knn_train(memory: MemoryConfig, init: str, knn_train: str | None) -> str:
    """What a training run trains: TRAIN_ALL from scratch, else knn_train (default DEFAULT_KNN_TRAIN) for
    a memorizing memory; knn_train given where it does not apply is a one-line error."""
    if knn_train is not None and knn_train not in KNN_TRAIN_MODES:
        raise MemlmError(f"--knn-train must be one of {KNN_TRAIN_MODES}, got {knn_train!r}")
    if memory.kind != "memorizing":
        if knn_train is not None:
            raise MemlmError(f"--knn-train applies to --memory memorizing only, not {memory.kind}")
        return TRAIN_ALL
    if init == "scratch":
        if knn_train is not None:
            raise MemlmError("--knn-train applies to fine-tuning (--init pretrained); from scratch everything trains")
        return TRAIN_ALL
    return knn_train or DEFAULT_KNN_TRAIN


def select_trainable(model: Decoder, memory: MemoryConfig, mode: str) -> None:
    """Freeze what `mode` (resolved_knn_train) does not train: "gate" the whole decoder, "top" the
    embeddings, the blocks below the memorizing layer, the final norm and the output head (a tied head
    is the embedding, which feeds the lower blocks), so that a frozen layer is bit-identical after a step."""
    if mode == TRAIN_ALL:
        return
    model.requires_grad_(False)
    if mode == "top":
        for block in model.layers[memorizing_layer(memory, model.config.n_layer):]:
            block.requires_grad_(True)


def memorizing_record(memory: MemoryConfig, n_layer: int, knn_attention: KnnAttention | None,
                      gate_trained: bool) -> dict[str, Any]:
    """What a memorizing evaluation records beside its perplexity (empty for other kinds)."""
    if memory.kind != "memorizing" or knn_attention is None:
        return {}
    from memlm.memory.memorizing import mean_gate

    return {"knn_mem_size": memory.knn_mem_size, "knn_top_k": memory.knn_top_k,
            "knn_backend": resolve_knn_backend(memory), "knn_layer": memorizing_layer(memory, n_layer),
            "mean_gate": [float(g) for g in mean_gate(knn_attention)], "gate_trained": gate_trained}


def knn_parameters(knn_attention: KnnAttention | None) -> list[torch.nn.Parameter]:
    """The KnnAttention parameters (none without a memorizing layer)."""
    return [] if knn_attention is None else list(knn_attention.parameters())


def fresh_knn_attention(model: Decoder) -> KnnAttention:
    """A new KnnAttention for `model` on its device (gate near 0: fine-tuning starts at the base model)."""
    from memlm.memory.memorizing import new_knn_attention
    from memlm.model.pretrained import require_decoder

    return new_knn_attention(require_decoder(model, "--memory memorizing").config).to(model.device)


def saved_knn_attention(directory: str | Path, device: torch.device | str) -> KnnAttention | None:
    """The KnnAttention saved beside a checkpoint (memlm.memory.memorizing.save_knn_attention), or None."""
    from memlm.memory.memorizing import load_knn_attention

    return load_knn_attention(directory, device)


def save_knn_attention(knn_attention: KnnAttention, directory: str | Path) -> None:
    """Write the module beside a checkpoint (inside its atomic save)."""
    from memlm.memory.memorizing import save_knn_attention as save

    save(knn_attention, directory)


def restore_memory(saved: dict, model: Decoder, memory: MemoryConfig, batch_size: int, *,
                   compressor: Compressor | None = None, knn_attention: KnnAttention | None = None,
                   service: KeyValueMemoryFactory | None = None) -> DecoderState:
    """The memory state saved by `state_dict()` (a resumed training run), on the model's device; a
    memorizing state gets a freshly opened store that its saved contents are loaded into."""
    from memlm.memory.state import memory_from_state_dict

    check_knn_attention(memory, knn_attention)
    if memory.kind != "memorizing":
        return memory_from_state_dict(saved, model.device, compressor)
    return memory_from_state_dict(saved, model.device, knn_attention=knn_attention,
                                  knn_store=open_knn_store(model, memory, batch_size, service))


def close_memory(state: DecoderState | None) -> None:
    """Release what a memory state holds outside itself: a memorizing state's kNN store (a retrieval-
    service session, an index); XL and compressive states hold nothing to release."""
    from memlm.memory.memorizing import MemorizingMemory

    if isinstance(state, MemorizingMemory):
        state.store.close()
