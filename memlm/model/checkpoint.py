"""memlm checkpoints: one directory that carries everything needed to load the model again.

Layout:
    config.json            ModelConfig.to_dict() + {"format": "memlm-checkpoint", "version": 1}
    model.safetensors      parameters by our names; lm_head.weight is left out when tied
    tokenizer.json         Hugging Face tokenizer JSON
    tokenizer_config.json  bos/eos token names
    settings.json          how the model reads text (TextSettings: boundary token, memory, segment, sinks),
                           when the checkpoint comes from a run (memlm train); absent for a bare model
    extra.json             caller's metadata (training step, ...)
    (optimizer.pt)         written by the training code through `write_files`, inside the same atomic step

A checkpoint is written to a temporary sibling directory and renamed into place, so a crash leaves the
old checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memlm.errors import MemlmError
from memlm.files import fsync_dir, fsync_tree, sha256_file
from memlm.model.memory_config import MemoryConfig
from memlm.model.config import ModelConfig
from memlm.model.decoder import Decoder
from memlm.model.pretrained import Pretrained, model_from_state_dict
from memlm.model.tokenizer import Tokenizer

FORMAT = "memlm-checkpoint"
VERSION = 1
SETTINGS_NAME = "settings.json"


@dataclass(frozen=True)
class TextSettings:
    """How a checkpoint's model was run over text: what evaluating or serving it must reproduce.

    `memlm eval` and `serve lm` take these where the caller leaves an option unset, and refuse a given
    option that differs (memlm.retrieval.compat.adopt): one rule for checkpoints and datastores.
    """

    boundary_token: int
    """Token prepended to every document (memlm.model.tokenizer.document_boundary at training time)."""
    memory: MemoryConfig
    """Memory kind, segment length, memory sizes and sink-token count the model was trained with."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TextSettings:
        return cls(boundary_token=int(d["boundary_token"]), memory=MemoryConfig(**d["memory"]))


def save_checkpoint(
    directory: str | Path,
    model: Decoder,
    tokenizer: Tokenizer,
    extra: dict[str, Any] | None = None,
    write_files: Callable[[Path], None] | None = None,
    settings: TextSettings | None = None,
) -> Path:
    """Write a checkpoint of `model` and `tokenizer` to `directory` atomically (replacing an old one).

    settings: how the model was run over text (written to settings.json); None for a bare model.
    write_files: called with the not-yet-published directory, to add files such as optimizer.pt so
        that they are part of the same atomic step.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # leftover of a crashed save by this pid number
    tmp.mkdir()
    try:
        config = model.config
        meta = config.to_dict() | {"format": FORMAT, "version": VERSION}
        (tmp / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
        state = model.state_dict()
        if config.tie_embeddings:
            # safetensors refuses tensors that share memory; the tie is restored from the config on load.
            state.pop("lm_head.weight")
        state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save(tmp)
        (tmp / "extra.json").write_text(json.dumps(extra or {}, indent=2, sort_keys=True) + "\n")
        if settings is not None:
            (tmp / SETTINGS_NAME).write_text(json.dumps(settings.to_dict(), indent=2, sort_keys=True) + "\n")
        if write_files is not None:
            write_files(tmp)
        sha256_file(tmp / "model.safetensors")  # remembered by inode: loading the published one does not rehash
        fsync_tree(tmp)  # durable before it is published: a resumed run must not find empty files
        _publish(tmp, directory)
        fsync_dir(directory.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _publish(tmp: Path, directory: Path) -> None:
    """Move `tmp` to `directory`; an existing checkpoint is swapped out first and removed afterwards."""
    if not directory.exists():
        os.replace(tmp, directory)
        return
    old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(directory, old)
    os.replace(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(
    directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> Pretrained:
    """Load a checkpoint written by `save_checkpoint`; the fingerprint is the sha256 of model.safetensors."""
    from safetensors.torch import load_file

    directory = Path(directory)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (directory / name).is_file():
            raise MemlmError(f"{directory} is not a complete memlm checkpoint: {name} is missing")
    meta = json.loads((directory / "config.json").read_text())
    if meta.get("format") != FORMAT:
        raise MemlmError(f"{directory}/config.json is not a memlm checkpoint (format {meta.get('format')!r})")
    if meta.get("version") != VERSION:
        raise MemlmError(f"{directory}: checkpoint version {meta.get('version')} is not supported (this memlm reads {VERSION})")
    config = ModelConfig.from_dict(meta)
    weights = directory / "model.safetensors"
    try:
        state = load_file(str(weights))
    except Exception as e:  # safetensors raises SafetensorError on a truncated or garbled file
        raise MemlmError(f"{weights} cannot be read ({e}); the checkpoint is damaged") from e
    model = model_from_state_dict(config, state, device, dtype, str(directory))
    return Pretrained(model, Tokenizer.from_dir(directory), sha256_file(weights))


def read_extra(directory: str | Path) -> dict[str, Any]:
    """The `extra` dict saved with a checkpoint ({} when there is none)."""
    path = Path(directory) / "extra.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def read_settings(directory: str | Path) -> TextSettings | None:
    """The TextSettings saved with a checkpoint; None for a bare model or anything that is not a checkpoint."""
    path = Path(directory) / SETTINGS_NAME
    if not path.is_file():
        return None
    try:
        return TextSettings.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise MemlmError(f"{path} cannot be read ({e}); the checkpoint is damaged") from None
