"""Typed entry points behind `memlm datastore build` and `memlm datastore info`.

`build_datastore` resolves names (model, corpus) into a model, a token stream and fingerprints, and
hands them to `datastore.build.build_from_tokens`, which does the work in resumable stages.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from datastore.build import BuildSettings, BuildSource, build_from_tokens
from datastore.datastore import Datastore
from datastore.documents import (
    SourceDocument,
    describe,
    select,
    source_documents,
    summary,
)
from datastore.encode import ParallelStages
from datastore.index import index_footprint
from datastore.manifest import Manifest
from memlm.errors import MemlmError
from memlm.jobs.windows import WindowConfig
from memlm.model.config import describe_weights

if TYPE_CHECKING:
    from datastore.ray_build import RayOptions


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
    num_shards: int = 1,
    key_module: str | None = None,
    on_disk: bool = False,
    ray: RayOptions | None = None,
    weights: str | None = None,
    allow_pickle_weights: bool = False,
) -> Path:
    """Build the datastore of (key, next token) pairs of `data` under `model` in `out`; returns `out`.

    model: preset, .gguf file, HF or memlm checkpoint dir (memlm.model.weights.load_pretrained).
    data, split: corpus spec and split expression (memlm.data.documents.load_documents).
    index: FAISS factory string; None chooses one from N and d and prints it.
    context, stride: window length and stride (None: min(WindowConfig.context, model max) and context // 2,
        as `memlm eval`).
    Running the same call again after an interruption continues the build; a finished datastore in
    `out` is an error unless overwrite.
    num_shards: > 1 writes that many datastores `out/shard-00-of-NN`, ... over contiguous runs of
        documents with about equal token counts, for `memlm serve router` (shard order = id order).
    key_module: the kNN key's module of a model run through transformers (memlm.model.hf_model; None: its rule).
    on_disk: keep the IVF lists in a memory-mapped file (BuildSettings.on_disk).
    ray: encode (and add on-disk blocks) on a Ray cluster (datastore.ray_build); the files are the same.
    weights: the model's weight format (memlm.model.weight_formats.resolve_format with `dtype`), recorded in
        the manifest.
    allow_pickle_weights: a model run through transformers may load pickled *.bin weights (--allow-pickle-weights).
    """
    from memlm.data.documents import corpus_fingerprint, load_documents

    # Every count is >= 1: a 0 is refused rather than read as "the default".
    for name, value in (("--shards", num_shards), ("--batch-size", batch_size), ("--nprobe", nprobe),
                        ("--context", context), ("--stride", stride)):
        if value is not None and value < 1:
            raise MemlmError(f"{name} must be at least 1, got {value}")
    from memlm.model.device import resolve_device
    from memlm.model.tokenizer import document_boundary
    from memlm.model.weight_formats import resolve_format
    from memlm.model.weights import load_pretrained

    torch_device = resolve_device(device)
    fmt = resolve_format(weights, dtype, torch_device)
    pretrained = load_pretrained(model, device=torch_device, dtype=fmt.dtype, key_module=key_module,
                                 weights=fmt.weights, allow_pickle=allow_pickle_weights)
    tokenizer = pretrained.tokenizer
    defaults = WindowConfig.for_model(pretrained.model.config.max_seq_len, context, stride)
    context, stride = defaults.context, defaults.stride
    boundary = document_boundary(tokenizer)
    source = BuildSource(
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
        on_disk=on_disk,
    )

    def documents():  # read and tokenized only when the tokenize stage runs (it applies max_tokens)
        return source_documents(load_documents(data, split), tokenizer)

    parallel = None if ray is None else _ray_stages(ray, model, device, dtype, key_module, settings, int(boundary),
                                                    weights, allow_pickle_weights)
    if num_shards == 1:
        return build_from_tokens(pretrained.model, documents, Path(out), source, settings,
                                 overwrite=overwrite, progress=progress, parallel=parallel)
    return _build_shards(pretrained.model, _cut(documents(), max_tokens), Path(out), source, settings, num_shards,
                         overwrite, progress, parallel)


def _ray_stages(ray: RayOptions, model: str, device: str, dtype: str, key_module: str | None,
                settings: BuildSettings, boundary: int, weights: str | None = None,
                allow_pickle_weights: bool = False) -> ParallelStages:
    """The Ray workers of build_datastore: they load the model by its names (never shipped weights)."""
    from datastore.ray_build import RayStages, load_model_by_name

    loader = functools.partial(load_model_by_name, model, device, dtype, key_module, weights, allow_pickle_weights)
    return RayStages(loader, settings, boundary, ray)


def _cut(docs: Iterable[SourceDocument], max_tokens: int | None) -> list[SourceDocument]:
    """The documents a build with --max-tokens reads: whole ones, then the last one cut (as the tokenize
    stage does for one datastore)."""
    out, left = [], max_tokens
    for doc in docs:
        if left is not None and left <= 0:
            break
        ids = doc.ids if left is None else doc.ids[:left]
        out.append(doc._replace(ids=ids))
        left = None if left is None else left - len(ids)
    return out


def shard_dir(out: Path, shard: int, num_shards: int) -> Path:
    return out / f"shard-{shard:02d}-of-{num_shards:02d}"


def split_documents(docs: list[SourceDocument], num_shards: int) -> list[list[SourceDocument]]:
    """Contiguous runs of documents with about total/num_shards tokens each (documents stay whole)."""
    total = sum(len(d.ids) for d in docs)
    groups: list[list[SourceDocument]] = [[] for _ in range(num_shards)]
    seen = 0
    for doc in docs:
        # the shard whose token range holds this document's middle token
        shard = min(num_shards - 1, (seen + len(doc.ids) // 2) * num_shards // max(total, 1))
        groups[shard].append(doc)
        seen += len(doc.ids)
    return groups


def _build_shards(model, docs: list[SourceDocument], out: Path, source: BuildSource, settings: BuildSettings,
                  num_shards: int, overwrite: bool, progress: bool, parallel: ParallelStages | None = None) -> Path:
    groups = split_documents(docs, num_shards)
    if any(not any(d.ids for d in group) for group in groups):
        raise MemlmError(f"the corpus has too few documents for {num_shards} shards; use fewer --shards")
    dirs = [shard_dir(out, i, num_shards) for i in range(num_shards)]
    finished = [(d / "manifest.json").is_file() for d in dirs]
    if all(finished) and not overwrite:
        raise MemlmError(f"{out} already holds {num_shards} finished shards; pass --overwrite to rebuild them")
    for i, (directory, group) in enumerate(zip(dirs, groups)):
        if finished[i] and not overwrite:
            print(f"shard {i}: {directory} already built", file=sys.stderr)
            continue
        shard_provenance = dataclasses.replace(
            source,
            corpus=f"{source.corpus} shard {i} of {num_shards}",
            corpus_fingerprint=hashlib.sha256(f"{source.corpus_fingerprint}:{i}/{num_shards}".encode()).hexdigest(),
        )
        build_from_tokens(model, group, directory, shard_provenance, settings, overwrite=overwrite, progress=progress,
                          parallel=parallel)
    print("serve the shards in this order behind one router: "
          + " ".join(f"--shard <address of {d.name}>" for d in dirs), file=sys.stderr)
    return out


def datastore_info(directory: Path, verify: bool = False) -> str:
    """A readable summary of a datastore directory.

    verify: run every check `Datastore.open` runs (each file's presence, size and SHA-256, the key and
        value arrays and the index against the manifest) by opening it on the CPU; a failure is a
        MemlmError. Without it only the manifest is read, and the summary says nothing was verified.
    """
    if verify:
        Datastore.open(Path(directory), verify=True, device="cpu")
    m = Manifest.read(Path(directory))
    size = sum(entry.bytes for entry in m.files.values())
    lines = [
        f"datastore     {directory}",
        f"entries       {m.n:,} keys of dimension {m.dim} ({m.key_dtype}), values {m.value_dtype}",
        f"key layer     {m.key_layer}",
        f"index         {m.index_factory} (metric {m.metric}, default nprobe {m.nprobe})",
        f"index memory  {index_footprint(m)}",
        f"model         {m.model_name} (fingerprint {m.model_fingerprint[:16]})",
        f"weights       {describe_weights(m.model_name)}",
        f"tokenizer     fingerprint {m.tokenizer_fingerprint[:16]}",
        f"corpus        {m.corpus} (fingerprint {m.corpus_fingerprint[:16]})",
        (f"windows       context {m.context}, stride {m.stride}, boundary token {m.boundary_token}, "
         f"sink tokens {m.sink_tokens}"),
        "documents     " + (summary(Datastore.documents_of(Path(directory), m)) if m.has_documents
                             else f"no table (format {m.format_version}): rebuild for memlm datastore docs"),
        "provenance    " + (f"{m.n:,} entries from {m.documents:,} document{'' if m.documents == 1 else 's'} "
                             "(docs.i32, positions.i32; the boundary token is position 0)" if m.has_provenance
                             else f"none (format {m.format_version}): rebuild for the SPALM leakage guard"),
        f"files         {size / 2**20:.1f} MiB: "
        + ", ".join(f"{name} {e.bytes / 2**20:.1f} MiB" for name, e in sorted(m.files.items())),
        f"format        version {m.format_version}, generation {m.generation}",
        "verified      " + ("files, sizes, checksums, arrays and index match the manifest" if verify
                            else "no: files were not checked (memlm datastore info --verify checks them)"),
    ]
    build = m.build
    if build:
        lines.append("build         " + ", ".join(f"{k}={build[k]}" for k in sorted(build)))
    return "\n".join(lines)


def add_to_datastore(directory: Path, data: str, split: str | None = None, model: str | None = None,
                     device: str = "auto", dtype: str | None = None, progress: bool = True) -> int:
    """`memlm datastore add`: encode the documents of `data` [split] that `directory` does not hold yet with
    its model (model: None = the manifest's; another one is refused unless its fingerprints match) and
    windows, and commit them as the next generation (datastore.add). Returns the documents added."""
    from datastore.add import add_documents
    from memlm.data.documents import corpus_fingerprint, load_documents
    from memlm.model.device import resolve_device
    from memlm.model.hf_model import key_module_of
    from memlm.model.tokenizer import document_boundary
    from memlm.model.weight_formats import resolve_format
    from memlm.model.weights import load_pretrained

    m = Manifest.read(Path(directory))
    name = model or m.model_name
    torch_device = resolve_device(device)
    # The key the datastore was built with (a --key-module of a transformers model is in its key layer), in the
    # weight format its keys were computed in.
    fmt = resolve_format(m.weights, dtype or m.build.get("model_dtype", "auto"), torch_device)
    pretrained = load_pretrained(name, device=torch_device, dtype=fmt.dtype, key_module=key_module_of(m.key_layer),
                                 weights=fmt.weights)
    tokenizer = pretrained.tokenizer
    source = BuildSource(
        model_name=name, model_fingerprint=pretrained.fingerprint, tokenizer_fingerprint=tokenizer.fingerprint,
        corpus=data if split is None else f"{data} [{split}]", corpus_fingerprint=corpus_fingerprint(data, split),
        boundary_token=int(document_boundary(tokenizer)),
    )
    return add_documents(pretrained.model, lambda: source_documents(load_documents(data, split), tokenizer),
                         Path(directory), source, progress=progress)


def datastore_docs(directory: Path, where: str | None = None) -> str:
    """The documents of a datastore, one line each (index, doc_id, tokens, metadata as JSON), those whose
    metadata pass `where` (a --split expression over the metadata, datastore.documents.select)."""
    m = Manifest.read(Path(directory))
    records = select(Datastore.documents_of(Path(directory), m), where)
    return "\n".join(["index\tdoc_id\ttokens\tmeta", *map(describe, records)])


__all__ = ["Datastore", "add_to_datastore", "build_datastore", "datastore_docs", "datastore_info"]
