"""Command-line glue of fewer kNN-LM searches: from `memlm eval`'s --pointers/--min-pointers and
--adaptive-gate/--adaptive-threshold/--adaptive-fraction (memlm.cli.options.FEWER_SEARCHES_OPTIONS) to the
library's memlm.jobs.knnlm_eval.Retrieval, with the datastore's successors, values and keys (RetoMaton)
and a fitted gate (adaptive retrieval) checked against the model and the evaluation documents.

The one overlap rule (`shared_documents`) lives here, below memlm.cli.eval, which uses it for tuning
splits too: a gate fitted on a document that is evaluated is refused, as a tuning split sharing one is.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from memlm.errors import MemlmError
from memlm.jobs.knnlm_eval import Retrieval
from memlm.cli.options import FEWER_SEARCHES_OPTIONS, given, refuse_given
from memlm.retrieval.adaptive import AdaptiveConfig, load_gate, threshold_for_fraction
from memlm.retrieval.clustered_states import EXACT_MEMBERS, cluster_states
from memlm.retrieval.pointers import PointerConfig, PointerSource, successors


def shared_documents(fingerprints: Iterable[str], evaluation: Any) -> set[str]:
    """The documents (by fingerprint, memlm.data.documents.document_fingerprint) of `fingerprints` that
    `evaluation` (a TokenizedCorpus) also holds: the one overlap rule of tuning splits and fitted gates."""
    return set(fingerprints) & set(evaluation.fingerprints)


def fewer_searches(args: argparse.Namespace, store: Any, adaptive: AdaptiveConfig | None) -> Retrieval:
    """The Retrieval the flags ask for over the opened datastore `store` (a datastore.Datastore): RetoMaton
    pointers over its successors, values and keys, and the gate from `gate_for` (refused when fitted with
    another datastore)."""
    _check_gate_datastore(args, store, adaptive)
    if not args.pointers:
        return Retrieval(adaptive=adaptive)
    pointers = pointer_config(args)
    found = successors(store.provenance, len(store))
    if not found.contiguous:
        print("the datastore's entries are not in document order; successors found by sorting", file=sys.stderr)
    clusters = None
    if args.pointer_clusters is not None:
        exact = EXACT_MEMBERS if args.pointer_exact is None else args.pointer_exact
        clusters = cluster_states(store.keys, args.pointer_clusters, sketch_dims=args.pointer_sketch or 0,
                                  exact_members=exact, max_clusters=args.pointer_nearest_clusters)
    return Retrieval(pointers, PointerSource.local(found.next_ids, store.values, store.keys, clusters), adaptive)


def generation_fewer(args: argparse.Namespace, searcher: Any, model_fingerprint: str, key_layer: str,
                     remote_pointers: Any = None) -> tuple[Retrieval | None, dict[str, Any]]:
    """`memlm generate`'s fewer searches (the same flags as memlm eval's; memlm.engine.fewer_rows): the
    Retrieval over its --datastore (a datastore.Datastore) or retrieval link, and what the result records;
    (None, {}) without the flags. remote_pointers: the PointerSource of a retrieval service's Successors rpc
    (the caller makes it: memlm does not import services), None for a local datastore. Prompts are no
    evaluation documents: the gate's overlap rule does not apply."""
    if not given(args, FEWER_SEARCHES_OPTIONS):  # none set (a value 0 is set: gate_for refuses it without its flag)
        return None, {}
    if searcher is None:
        raise MemlmError("--pointers and --adaptive-* need kNN-LM generation (--datastore or --retrieval)")
    refuse_given(args, ("pointer_search_rows",), "applies to memlm eval (it batches the searches of many token "
                 "streams; a generated row walks alone)")
    adaptive, record = gate_for(args, None, model_fingerprint, key_layer)
    if remote_pointers is None:
        retrieval = fewer_searches(args, searcher, adaptive)
    else:
        if args.pointer_clusters is not None:
            raise MemlmError("--pointer-clusters needs a local --datastore (the clusters are k-means of its keys)")
        _check_gate_datastore(args, searcher, adaptive)
        pointers = pointer_config(args) if args.pointers else None
        retrieval = Retrieval(pointers, remote_pointers if args.pointers else None, adaptive)
    if args.pointers:
        record["min_pointers"] = retrieval.pointers.min_pointers
    return retrieval, {"pointers": bool(args.pointers), **record}


def pointer_config(args: argparse.Namespace) -> PointerConfig:
    """The PointerConfig of --pointers [--min-pointers N] [--pointer-width W] [--pointer-search-rows R]:
    PointerConfig's own defaults for the flags not given."""
    defaults = PointerConfig()
    search_rows = args.pointer_search_rows
    return PointerConfig(min_pointers=defaults.min_pointers if args.min_pointers is None else args.min_pointers,
                         cluster_width=defaults.cluster_width if args.pointer_width is None else args.pointer_width,
                         search_rows=defaults.search_rows if search_rows is None else search_rows)


def _check_gate_datastore(args: argparse.Namespace, store: Any, adaptive: AdaptiveConfig | None) -> None:
    if adaptive is not None and adaptive.settings.datastore_corpus_fingerprint != store.info().corpus_fingerprint:
        raise MemlmError(f"--adaptive-gate {args.adaptive_gate} was fitted with another datastore (its labels are "
                         f"that datastore's searches); fit one for {args.datastore} with memlm train-gate")


def gate_for(args: argparse.Namespace, evaluation: Any, model_fingerprint: str, key_layer: str
             ) -> tuple[AdaptiveConfig | None, dict[str, Any]]:
    """The gate of --adaptive-gate (None without it) and what the result records about it; this and the
    refusals of flags given without theirs come before any datastore is opened."""
    if not args.pointers:
        refuse_given(args, ("min_pointers", "pointer_clusters", "pointer_search_rows"), "needs --pointers")
    if args.pointer_clusters is None:
        refuse_given(args, ("pointer_sketch", "pointer_width"), "needs --pointer-clusters")
    if args.pointer_sketch is None:
        refuse_given(args, ("pointer_exact", "pointer_nearest_clusters"), "needs --pointer-sketch")
    clusters = {} if args.pointer_clusters is None else {"pointer_clusters": args.pointer_clusters}
    named = ("pointer_sketch", "pointer_exact", "pointer_nearest_clusters", "pointer_width", "pointer_search_rows")
    clusters.update({name: getattr(args, name) for name in named if getattr(args, name) is not None})
    if args.adaptive_gate is None:
        refuse_given(args, ("adaptive_threshold", "adaptive_fraction"), "needs --adaptive-gate")
        return None, clusters
    adaptive = open_gate(args, evaluation, model_fingerprint, key_layer)
    s = adaptive.settings
    record = {"adaptive_gate": args.adaptive_gate, "gate_k": s.k, "gate_temperature": s.temperature,
              "gate_tune_data": s.tune_data, "gate_tokens": s.tokens, "gate_accuracy": s.accuracy,
              "gate_objective": s.config.objective, "gate_key_components": s.config.key_components, **clusters}
    if args.adaptive_fraction is not None:
        record["adaptive_fraction"] = args.adaptive_fraction
    return adaptive, record


def open_gate(args: argparse.Namespace, evaluation: Any, model_fingerprint: str, key_layer: str) -> AdaptiveConfig:
    """The gate of --adaptive-gate with the threshold of --adaptive-threshold or --adaptive-fraction (one of
    them), refused when fitted for another model or on a document that is evaluated (evaluation None:
    generation, whose prompts are no evaluation documents)."""
    if (args.adaptive_threshold is None) == (args.adaptive_fraction is None):
        raise MemlmError("--adaptive-gate needs one of --adaptive-threshold X or --adaptive-fraction F")
    gate, settings = load_gate(Path(args.adaptive_gate))
    if settings.model_fingerprint != model_fingerprint or settings.key_layer != key_layer:
        raise MemlmError(f"--adaptive-gate {args.adaptive_gate} was fitted for another model or key layer "
                         f"({settings.key_layer}); fit one for this model with memlm train-gate")
    shared = shared_documents(settings.fitted_documents, evaluation) if evaluation is not None else set()
    if shared:
        raise MemlmError(f"--adaptive-gate {args.adaptive_gate} was fitted on {len(shared)} document(s) of the "
                         f"evaluation data (--split {args.split!r}): the gate must never see evaluation tokens; "
                         "fit it on a disjoint split")
    if args.adaptive_fraction is not None:
        threshold = threshold_for_fraction(settings, args.adaptive_fraction)
    else:
        threshold = args.adaptive_threshold
    return AdaptiveConfig(gate, settings, threshold)
