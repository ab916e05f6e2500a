"""Command-line option groups, each defined once: kNN-LM, memory, windows, and the
memorizing layer's options inside the memory group plus `--knn-train` for `memlm train`.

Each option has one flag, one type and one help text, and is attached by name to the subcommands it
applies to (`memlm eval`, `serve lm`, `train`, `client score/generate`, `datastore build`). Parsers keep
every default at None, so that a command can tell "left unset" from "given": unset options take the
library's defaults (KNNLMConfig, MemoryConfig, WindowConfig, never literals written here), or an
artifact's recorded settings (memlm.retrieval.compat.adopt), and a given option that does not apply to
the chosen mode is refused in one line (`refuse_given`).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memlm.errors import MemlmError
from memlm.jobs.memorizing import DEFAULT_KNN_TRAIN, KNN_TRAIN_MODES
from memlm.jobs.windows import WindowConfig
from memlm.model.hf_model import ALLOW_PICKLE_FLAG
from memlm.model.memory_config import COMPRESS_FNS, KNN_BACKENDS, MEMORY_KINDS, MemoryConfig
from memlm.model.weight_formats import DEFAULT_WEIGHTS, WEIGHT_FORMATS, ModelFormat, resolve_format
from memlm.retrieval.clustered_states import EXACT_MEMBERS
from memlm.retrieval.compat import say_taken
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.pointers import PointerConfig
from memlm.retrieval.searcher import DEFAULT_SEARCH_BACKEND, MAX_K, SEARCH_BACKENDS

AUTO = "auto"


def float_or_auto(text: str) -> float | str:
    """A float, or "auto" (tuned on --tune-data; only `memlm eval` tunes)."""
    if text == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1: for counts where 0 could be mistaken for "the default"."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def neighbours(text: str) -> int:
    """--k: 1 <= k <= MAX_K, refused before anything is loaded or allocated (Q * k results)."""
    value = positive_int(text)
    if value > MAX_K:
        raise argparse.ArgumentTypeError(f"at most {MAX_K} neighbours per search, got {value}")
    return value


MAX_PORT = 65535
"""Largest TCP port."""


def port_number(text: str) -> int:
    """A TCP port, 0 (any free port) to 65535; larger values would wrap around when bound."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"ports are 0 (any free port) to {MAX_PORT}, got {value}")
    return value


@dataclass(frozen=True)
class Option:
    """One command-line option: its flag, where it lands in the namespace, its type and help."""

    flag: str
    """"--mem-len"."""
    dest: str
    """Attribute of the parsed namespace (and, for grouped options, the config field it sets)."""
    type: Callable[[str], Any] | None
    """Parser of the value; None: a switch (store_true)."""
    help: str
    """Help text; the library default is appended."""
    default: Any = None
    """The library default the help names (the parser's own default stays None)."""
    choices: tuple[str, ...] | None = None
    """Allowed values."""

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup, choices: tuple[str, ...] | None) -> None:
        text = self.help if self.default is None else f"{self.help} (default {self.default})"
        if self.type is None:
            parser.add_argument(self.flag, dest=self.dest, action="store_true", default=None, help=text)
        else:
            parser.add_argument(self.flag, dest=self.dest, type=self.type, default=None, choices=choices or self.choices,
                                metavar=None if (choices or self.choices) else self.flag[2:].upper().replace("-", "_"), help=text)


_K, _M, _W = KNNLMConfig(), MemoryConfig(), WindowConfig()

KNN_OPTIONS = {o.dest: o for o in (
    Option("--k", "k", neighbours, f"neighbours retrieved per token (1 to {MAX_K})", _K.k),
    Option("--lambda", "lmbda", float_or_auto,
           "kNN-LM interpolation weight in [0, 1], or auto (tuned by memlm eval --tune-data)", _K.lmbda),
    Option("--knn-temperature", "temperature", float_or_auto,
           "softmax temperature over -distance, or auto (tuned by memlm eval --tune-data)", _K.temperature),
    Option("--nprobe", "nprobe", positive_int, "IVF lists probed per search", "the datastore's"),
    Option("--exact-rerank", "exact_rerank", None, "recompute exact distances from the stored keys"),
)}
MEMORY_OPTIONS = {o.dest: o for o in (
    Option("--memory", "kind", str, "segment-recurrent memory", None, MEMORY_KINDS),
    Option("--segment", "segment", int, "segment length in tokens", _M.segment),
    Option("--mem-len", "mem_len", int, "Transformer-XL memory slots per layer", _M.mem_len),
    Option("--cmem-len", "cmem_len", int, "compressed memory slots per layer", _M.cmem_len),
    Option("--compress-rate", "compress_rate", int, "memories per compressed slot", _M.compress_rate),
    Option("--compress-fn", "compress_fn", str, "compression function", _M.compress_fn, COMPRESS_FNS),
    Option("--sink-tokens", "sink_tokens", int, "first tokens of each document kept in memory", _M.sink_tokens),
    Option("--knn-layer", "knn_layer", int, "memorizing: 0-based layer with kNN attention", "about 3/4 up"),
    Option("--knn-mem-size", "knn_mem_size", positive_int,
           "memorizing: kNN memory entries per (row, kv head); oldest evicted beyond", _M.knn_mem_size),
    Option("--knn-top-k", "knn_top_k", positive_int, "memorizing: (key, value) pairs retrieved per query",
           _M.knn_top_k),
    Option("--knn-backend", "knn_backend", str, "memorizing: kNN memory backend (auto: exact up to "
           "memlm.model.memory_config.EXACT_MAX_ENTRIES entries, faiss beyond)", _M.knn_backend, KNN_BACKENDS),
)}
SEARCH_BACKEND_OPTIONS = {o.dest: o for o in (
    Option("--search-backend", "search_backend", str, "how the datastore searches: its faiss index (a GPU clone "
           "when faiss-gpu sees CUDA), or exact torch search over its float16 keys on the model's device",
           DEFAULT_SEARCH_BACKEND, SEARCH_BACKENDS),
)}
MEMORIZING_ONLY = ("knn_layer", "knn_mem_size", "knn_top_k", "knn_backend")
"""MEMORY_OPTIONS that apply to --memory memorizing only (refused with any other kind)."""
KNN_TRAIN_OPTIONS = {o.dest: o for o in (
    Option("--knn-train", "knn_train", str, "memorizing fine-tuning: gate (only the kNN-attention parameters) "
           "or top (those and the decoder layers from --knn-layer up); from scratch everything trains", DEFAULT_KNN_TRAIN,
           KNN_TRAIN_MODES),
)}
def fraction(text: str) -> float:
    """A number in [0, 1] (--adaptive-threshold, a probability; --adaptive-fraction is checked below 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


_P = PointerConfig()
FEWER_SEARCHES_OPTIONS = {o.dest: o for o in (
    Option("--pointers", "pointers", None, "RetoMaton (Alon et al. 2022): follow the neighbours' successor entries "
           "and search only when fewer than --min-pointers survive"),
    Option("--min-pointers", "min_pointers", positive_int, "with --pointers: search when fewer pointers survive "
           "(above --k: a search for every token)", _P.min_pointers),
    Option("--pointer-clusters", "pointer_clusters", positive_int, "with --pointers: RetoMaton over clustered "
           "states, k-means of the datastore's keys into this many clusters (entries of one share pointers)"),
    Option("--pointer-sketch", "pointer_sketch", positive_int, "with --pointer-clusters: rank the clusters' members "
           "by this many principal components of the keys and score only --pointer-exact of them exactly "
           "(default: every member scored exactly; memlm.retrieval.clustered_states.KeySketch)"),
    Option("--pointer-exact", "pointer_exact", positive_int, "with --pointer-sketch: members a row scores exactly "
           "(its own pointers first); the other kept ones are followed but weigh nothing in p_kNN", EXACT_MEMBERS),
    Option("--pointer-nearest-clusters", "pointer_nearest_clusters", positive_int, "with --pointer-sketch: rank "
           "only the members of a row's this many clusters nearest its query by centroid (its own pointers kept "
           "first in every cluster; default: all of them; KeySketch.max_clusters)"),
    Option("--pointer-width", "pointer_width", positive_int, "with --pointer-clusters: candidates a clustered row "
           "keeps at most (default: --k); wider keeps more pointers alive"),
    Option("--pointer-search-rows", "pointer_search_rows", positive_int, "with --pointers, memlm eval: search the "
           "token streams waiting for a search once this many wait (default: once all wait, the fullest calls, for "
           "a Flat index); the same searches, batched otherwise (PointerConfig.search_rows)"),
    Option("--adaptive-gate", "adaptive_gate", str, "adaptive retrieval (He et al. 2021): a gate directory from "
           "memlm train-gate, fitted on documents that are not evaluated"),
    Option("--adaptive-threshold", "adaptive_threshold", fraction, "with --adaptive-gate: search when the gate's "
           "score is at least this (0: always)"),
    Option("--adaptive-fraction", "adaptive_fraction", fraction, "with --adaptive-gate: skip about this fraction "
           "of the searches (the threshold at that quantile of the gate's scores on held-out tuning tokens)"),
)}
"""Fewer searches: named the same in memlm eval, generate and the LM service."""
WINDOW_OPTIONS = {o.dest: o for o in (
    Option("--context", "context", positive_int, "sliding-window length in tokens (at most the model's)", _W.context),
    Option("--stride", "stride", positive_int, "tokens between window starts", "context/2"),
)}


WEIGHTS_OPTIONS = {o.dest: o for o in (
    Option("--weights", "weights", str, "weight format (memlm.model.weight_formats): float32 or bfloat16 (weights, "
           "activations and KV cache in it), int8 or int4 (weight-only quantised linear layers, computing in --dtype, "
           "bfloat16 unless given)", ", ".join(f"{d} on {k}" for k, d in DEFAULT_WEIGHTS.items()), WEIGHT_FORMATS),
    Option(ALLOW_PICKLE_FLAG, "allow_pickle_weights", None, "let a model run through transformers load pickled *.bin "
           "weights where its directory has no safetensors (unpickling a file can run its code: trusted files only)"),
)}
"""The model's weights (format, and whether pickled files may load): named the same in memlm eval, generate,
datastore build and serve lm."""
ACCEPT_WEIGHTS_OPTIONS = {o.dest: o for o in (
    Option("--accept-weights-mismatch", "accept_weights_mismatch", None, "use a datastore whose keys were computed "
           "in another weight format than --weights (queries and keys then differ by the two formats' rounding)"),
)}


def model_format(args: argparse.Namespace, device: Any, datastore: str | None = None) -> ModelFormat:
    """The weight format and compute dtype of --weights and --dtype on `device` (weight_formats.resolve_format).
    With both unset, a local `datastore` directory lends the format its keys were computed in (memlm.retrieval.
    compat.adopt's rule for a setting an artifact records), said in one line where it is not the default."""
    weights, dtype = getattr(args, "weights", None), getattr(args, "dtype", None)
    if datastore is not None and weights is None and dtype in (None, AUTO):
        from datastore.manifest import Manifest

        weights = Manifest.read(Path(datastore)).weights
        if weights != resolve_format(None, None, device).weights:
            say_taken([f"--weights {weights}"], "the datastore")
    return resolve_format(weights, dtype, device)


def add_options(parser: argparse.ArgumentParser, title: str, table: dict[str, Option],
                names: Iterable[str] | None = None, choices: dict[str, tuple[str, ...]] | None = None) -> None:
    """Attach the options `names` (default: all) of one table to `parser` under the heading `title`."""
    group = parser.add_argument_group(title)
    for name in names if names is not None else table:
        table[name].add_to(group, (choices or {}).get(name))


def given(args: argparse.Namespace, table: dict[str, Option]) -> dict[str, Any]:
    """The options of `table` present on this command (attached) and set by the user, by dest."""
    return {dest: getattr(args, dest) for dest in table if getattr(args, dest, None) is not None}


def refuse_given(args: argparse.Namespace, names: Iterable[str], why: str) -> None:
    """A flag that does not apply is an error, never silently ignored: the first of the
    options `names` (dests) set on this command is refused with `why`."""
    for name in names:
        if getattr(args, name, None) is not None:
            raise MemlmError(f"{flag(name)} {why}")


def knn_config(args: argparse.Namespace, allow_auto: bool = False) -> KNNLMConfig:
    """KNNLMConfig from the kNN options given (the rest: its defaults); "auto" becomes None (tuned)."""
    values = given(args, KNN_OPTIONS)
    for dest in ("lmbda", "temperature"):
        if values.get(dest) == AUTO:
            if not allow_auto:
                raise MemlmError(f"{KNN_OPTIONS[dest].flag} auto is tuned by `memlm eval --tune-data` only; "
                                 "give a number")
            values[dest] = None
    return KNNLMConfig(**values)


def memory_config(args: argparse.Namespace, base: MemoryConfig) -> MemoryConfig:
    """`base` with the memory options given replacing its fields; a bad combination is one line."""
    try:
        memory = dataclasses.replace(base, **given(args, MEMORY_OPTIONS))
    except ValueError as e:
        raise MemlmError(str(e)) from None
    refuse_unless_memorizing(args, memory.kind)
    return memory


def refuse_unless_memorizing(args: argparse.Namespace, kind: str) -> None:
    """The memorizing layer's options (and --knn-train) given with another memory kind: one line."""
    if kind != "memorizing":
        refuse_given(args, (*MEMORIZING_ONLY, *KNN_TRAIN_OPTIONS), f"applies to --memory memorizing only, not {kind}")


def flag(dest: str) -> str:
    """The flag of an option by its dest: the group tables' flags, else the argparse spelling."""
    for table in (KNN_OPTIONS, MEMORY_OPTIONS, WINDOW_OPTIONS, KNN_TRAIN_OPTIONS, FEWER_SEARCHES_OPTIONS, WEIGHTS_OPTIONS,
                  ACCEPT_WEIGHTS_OPTIONS):
        if dest in table:
            return table[dest].flag
    return "--" + dest.replace("_", "-")
