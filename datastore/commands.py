"""Typed entry points behind `memlm datastore build` and `memlm datastore info`.

`build_datastore` resolves names (model, corpus) into a model, a token stream and fingerprints, and
hands them to `datastore.build.build_from_tokens`, which does the work in resumable stages.
"""

from __future__ import annotations

from pathlib import Path

from datastore.build import BuildSettings, Provenance, build_from_tokens
from datastore.datastore import Datastore
from datastore.manifest import Manifest
from memlm.errors import MemlmError
from memlm.windows import WindowConfig


def build_datastore(
    model: str,
    data: str,
    out: Path,
    split: str | None = None,
    max_tokens: int | None = None,
    index: str | None = None,
    context: int | None = None,
    stride: int | None = None,
    batch_size: int = 4,
    device: str = "auto",
    dtype: str = "auto",
    overwrite: bool = False,
    nprobe: int | None = None,
    shard_batches: int = 64,
    progress: bool = True,
) -> Path:
    """Build the datastore of (key, next token) pairs of `data` under `model` in `out`; returns `out`.

    model: preset, .gguf file, HF or memlm checkpoint dir (memlm.weights.load_pretrained).
    data, split: corpus spec and split expression (memlm.corpus.load_documents).
    index: FAISS factory string; None chooses one from N and d and prints it.
    context, stride: window length and stride (None: min(1024, model max) and context // 2, as `memlm eval`).
    Running the same call again after an interruption continues the build; a finished datastore in
    `out` is an error unless overwrite.
    """
    from memlm.corpus import corpus_fingerprint, load_documents, tokenize_documents
    from memlm.evaluate import resolve_device, resolve_dtype
    from memlm.weights import load_pretrained

    torch_device = resolve_device(device)
    pretrained = load_pretrained(model, device=torch_device, dtype=resolve_dtype(dtype, torch_device))
    tokenizer = pretrained.tokenizer
    context = context or min(1024, pretrained.model.config.max_seq_len)
    stride = stride or max(1, context // 2)
    boundary = tokenizer.boundary_id
    if boundary is None:
        raise MemlmError("the tokenizer has neither a BOS nor an EOS token to mark document starts")
    provenance = Provenance(
        model_name=model,
        model_fingerprint=pretrained.fingerprint,
        tokenizer_fingerprint=tokenizer.fingerprint,
        corpus=data if split is None else f"{data} [{split}]",
        corpus_fingerprint=corpus_fingerprint(data, split),
        boundary_token=int(boundary),
    )
    settings = BuildSettings(
        window=WindowConfig(context=context, stride=stride, batch_size=batch_size),
        index_factory=index,
        nprobe=nprobe,
        max_tokens=max_tokens,
        shard_batches=shard_batches,
    )

    def documents():  # read and tokenized only when the tokenize stage runs
        return tokenize_documents(load_documents(data, split), tokenizer, max_tokens)

    return build_from_tokens(pretrained.model, documents, Path(out), provenance, settings,
                             overwrite=overwrite, progress=progress)


def datastore_info(directory: Path) -> str:
    """A readable summary of a datastore directory (no checksum pass; `Datastore.open` does that)."""
    m = Manifest.read(Path(directory))
    size = sum(entry.bytes for entry in m.files.values())
    lines = [
        f"datastore     {directory}",
        f"entries       {m.n:,} keys of dimension {m.dim} ({m.key_dtype}), values {m.value_dtype}",
        f"key layer     {m.key_layer}",
        f"index         {m.index_factory} (metric {m.metric}, default nprobe {m.nprobe})",
        f"model         {m.model_name} (fingerprint {m.model_fingerprint[:16]})",
        f"tokenizer     fingerprint {m.tokenizer_fingerprint[:16]}",
        f"corpus        {m.corpus} (fingerprint {m.corpus_fingerprint[:16]})",
        f"windows       context {m.context}, stride {m.stride}, boundary token {m.boundary_token}",
        f"files         {size / 2**20:.1f} MiB: "
        + ", ".join(f"{name} {e.bytes / 2**20:.1f} MiB" for name, e in sorted(m.files.items())),
        f"format        version {m.format_version}",
    ]
    build = m.build
    if build:
        lines.append("build         " + ", ".join(f"{k}={build[k]}" for k in sorted(build)))
    return "\n".join(lines)


__all__ = ["build_datastore", "datastore_info", "Datastore"]
