"""The one compatibility check between a datastore (a Searcher's info) and the model and text layout in use.

A datastore's keys only mean something for the model, tokenizer and key activation they were made with,
and only for queries computed over the same text layout (the token prepended to each document, the
window length and stride). One rule everywhere, for datastores and checkpoints alike:
- what a caller cannot choose (fingerprints, key dimension, key layer, boundary token) must match, or
  the artifact is refused in one line; so must the weight format the keys were computed in, unless the
  caller accepts the mismatch (its perplexity cost: docs/decisions/weight-formats.md);
- a setting the caller left unset (window context/stride, memory sizes) is taken from the artifact, and
  `say_taken` says so in one line;
- a setting the caller gave explicitly that differs from the artifact's is refused in one line (`adopt`).
The command line, the LM server (local datastore or retrieval service) and the evaluation jobs all call
`check_searcher`; nothing else compares fingerprints.
"""

from __future__ import annotations

import sys
from typing import TypeVar

from memlm.errors import MemlmError
from memlm.retrieval.searcher import SearcherInfo

T = TypeVar("T")


def check_searcher(
    info: SearcherInfo,
    *,
    model_fingerprint: str,
    tokenizer_fingerprint: str,
    dim: int,
    key_layer: str,
    boundary_token: int,
    context: int | None = None,
    stride: int | None = None,
    weights: str = "float32",
    accept_weights_mismatch: bool = False,
) -> None:
    """Refuse (MemlmError, one line) a datastore whose keys do not fit the model and layout in use.

    model_fingerprint, tokenizer_fingerprint: of the model in use (memlm.model.weights.Pretrained).
    dim, key_layer: the model's key width (n_embd) and ModelConfig.key_description.
    boundary_token: memlm.model.tokenizer.document_boundary of the tokenizer in use.
    context, stride: the sliding windows the queries are computed with; None where the caller has no
        windows (the LM server, whose Score requests choose their own) or took the datastore's.
    weights: the weight format the queries are computed in (memlm.model.weight_formats.format_of); another
        format than the keys' is refused unless `accept_weights_mismatch` (the keys are then only close).
    """
    name = info.model_name or "its model"
    for what, ours, theirs in (
        ("model fingerprint", model_fingerprint, info.model_fingerprint),
        ("tokenizer fingerprint", tokenizer_fingerprint, info.tokenizer_fingerprint),
    ):
        if ours != theirs:
            raise MemlmError(
                f"the datastore was built with a different {what} ({name}, {theirs[:16]}) than the one in use "
                f"({ours[:16]}); use the model it was built with, or rebuild it with `memlm datastore build --model ...`"
            )
    if info.dim != dim:
        raise MemlmError(f"the datastore's keys have dimension {info.dim}, the model's {dim}; rebuild the datastore")
    if info.key_layer != key_layer:
        raise MemlmError(f"the datastore's keys are {info.key_layer}, this model's kNN key is {key_layer}; "
                         "rebuild the datastore with this model configuration")
    if info.boundary_token != boundary_token:
        raise MemlmError(f"the datastore's documents start with token {info.boundary_token}, this tokenizer's "
                         f"document boundary is {boundary_token}; rebuild the datastore with this memlm")
    if info.weights != weights and not accept_weights_mismatch:
        raise MemlmError(f"the datastore's keys were computed with --weights {info.weights}, the model runs "
                         f"--weights {weights}; give --weights {info.weights}, or --accept-weights-mismatch")
    for flag, ours_w, theirs_w in (("--context", context, info.context), ("--stride", stride, info.stride)):
        if ours_w is not None and ours_w != theirs_w:
            raise MemlmError(f"{flag} {ours_w} differs from the datastore's {flag} {theirs_w}; leave {flag} unset "
                             f"to use the datastore's, or rebuild the datastore with {flag} {ours_w}")


def adopt(flag: str, given: T | None, recorded: T, artifact: str, taken: list[str]) -> T:
    """The one settings rule for an option an artifact (datastore, checkpoint) records: left unset, it takes
    the artifact's value (appended to `taken`, which the caller prints as one line); given and different,
    it is refused in one line."""
    if given is None:
        taken.append(f"{flag} {recorded}")
        return recorded
    if given != recorded:
        raise MemlmError(f"{flag} {given} differs from {artifact}'s {flag} {recorded}; leave {flag} unset to use it")
    return given


def say_taken(taken: list[str], artifact: str) -> None:
    """The one line that says which settings came from an artifact (nothing when none did)."""
    if taken:
        print(f"memlm: taken from {artifact}: {', '.join(taken)}", file=sys.stderr)
