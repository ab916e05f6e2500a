"""MEMORY_MODE_SPALM on the LM server (Yogatama et al. 2021): what a server needs to serve
it, how its datastore is checked, and how a request's search is read.

A server serves SPALM when it holds both halves of the model: the trained head (spalm_head.pt beside a
`memlm train --memory spalm` checkpoint's weights, loaded at start) and a kNN source (`--datastore DIR` in
process or `--retrieval HOST:PORT`). The datastore holds the keys of the model the head was trained
against (`SpalmCheckpoint.keys_fingerprint`: training changes W, hence the checkpoint's own fingerprint,
never the datastore's keys), so that is the fingerprint it is checked against at start, as `memlm eval
--memory spalm` checks it (memlm.cli.spalm). kNN-LM is served over the same datastore only when its
keys are this model's own.

A request's search rides in its KnnOptions with `enabled` false: knn.k (neighbours per token, unset =
memlm.memory.spalm.SPALM_DEFAULT_K, the one default `memlm eval --memory spalm --k` has) and knn.nprobe;
kNN-LM's lambda and temperature do not apply (SPALM mixes the retrieved tokens by its learned gate).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from memlm.errors import MemlmError
from memlm.memory.spalm import SPALM_DEFAULT_K, SpalmHead, load_spalm_head
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.searcher import SearchOptions
from memlm.v1 import language_model_pb2 as lm_pb2
from services.common.server import InvalidRequest

NEEDS_HEAD = "a SPALM checkpoint (spalm_head.pt beside the weights: memlm train --memory spalm)"
"""What a server without a SPALM head lacks (named in the UNIMPLEMENTED status)."""
NEEDS_SEARCHER = "a kNN source (serve lm --datastore DIR or --retrieval HOST:PORT)"
"""What a server without a searcher lacks."""


@dataclass(frozen=True)
class SpalmCheckpoint:
    """A trained SPALM head as the server loaded it (memlm.memory.spalm.load_spalm_head)."""

    head: SpalmHead
    """The gate w_g and its bias."""
    keys_fingerprint: str
    """Fingerprint of the model whose kNN keys the datastore holds (what the datastore is checked against)."""


@dataclass(frozen=True)
class SpalmSearch:
    """How MEMORY_MODE_SPALM searches the datastore for one request (from its KnnOptions, enabled false)."""

    k: int
    """Neighbours per token: knn.k, or memlm.memory.spalm.SPALM_DEFAULT_K when unset."""
    options: SearchOptions
    """nprobe (knn.nprobe, else the server's) and the server's exact re-rank."""


def saved_spalm(model: str, device: torch.device | str) -> SpalmCheckpoint | None:
    """The SPALM head beside a checkpoint directory's weights, or None (no directory, no spalm_head.pt)."""
    saved = load_spalm_head(model, device) if Path(model).is_dir() else None
    return None if saved is None else SpalmCheckpoint(*saved)


def spalm_missing(spalm: SpalmCheckpoint | None, has_searcher: bool) -> tuple[str, ...]:
    """What the server lacks to serve MEMORY_MODE_SPALM; () when it serves it."""
    return (() if spalm is not None else (NEEDS_HEAD,)) + (() if has_searcher else (NEEDS_SEARCHER,))


def keys_fingerprint(spalm: SpalmCheckpoint | None, model_fingerprint: str, n_embd: int) -> str:
    """The model fingerprint the server's datastore must carry: the SPALM head's keys' model when a head is
    loaded (refused when made for another width), else the served model's own."""
    if spalm is None:
        return model_fingerprint
    try:
        spalm.head.check_model(n_embd)
    except ValueError as e:
        raise MemlmError(str(e)) from None
    return spalm.keys_fingerprint


def knn_refusal(keys_model: str, model_fingerprint: str, has_searcher: bool) -> str | None:
    """Why kNN-LM is refused on this server (None: served): no searcher, or a datastore of the SPALM head's
    keys' model, which is not this model (kNN-LM's queries must be made as the datastore's keys were)."""
    if not has_searcher:
        return "this server has no datastore; start it with --datastore or --retrieval"
    if keys_model != model_fingerprint:
        return f"this server's datastore holds the keys of model {keys_model} (its SPALM head's), not this model's"
    return None


def check_search(k: int, nprobe: int | None, max_k: int, max_nprobe: int) -> None:
    """The domain of a request's knn.k and knn.nprobe (kNN-LM and SPALM alike)."""
    if k < 1:
        raise InvalidRequest("knn.k", f"{k}, must be >= 1")
    if k > max_k:
        raise InvalidRequest("knn.k", f"{k}, at most {max_k}", grpc.StatusCode.OUT_OF_RANGE)
    if nprobe is not None and nprobe < 1:
        raise InvalidRequest("knn.nprobe", f"{nprobe}, must be >= 1")
    if nprobe is not None and nprobe > max_nprobe:
        raise InvalidRequest("knn.nprobe", f"{nprobe}, at most {max_nprobe}", grpc.StatusCode.OUT_OF_RANGE)


def parse_spalm_search(o: lm_pb2.KnnOptions, knn_defaults: KNNLMConfig, max_k: int, max_nprobe: int) -> SpalmSearch:
    """A MEMORY_MODE_SPALM request's search from its KnnOptions (enabled must stay false)."""
    if o.enabled:
        raise InvalidRequest("knn.enabled", "kNN-LM interpolation does not combine with MEMORY_MODE_SPALM (it mixes "
                                            "by its gate); leave it false, knn.k and knn.nprobe set SPALM's search")
    for name in ("lambda_weight", "temperature"):
        if o.HasField(name):
            raise InvalidRequest(f"knn.{name}", "is kNN-LM's interpolation; MEMORY_MODE_SPALM mixes by its gate")
    k = o.k if o.HasField("k") else SPALM_DEFAULT_K
    nprobe = o.nprobe if o.HasField("nprobe") else knn_defaults.nprobe
    check_search(k, nprobe, max_k, max_nprobe)
    return SpalmSearch(int(k), SearchOptions(nprobe=nprobe, exact_rerank=knn_defaults.exact_rerank))
