"""The continuous cache (Grave et al. 2017, "Improving neural language models with a continuous cache"):
a kNN-LM over the document's own past, the baseline the Memorizing Transformer is compared with.

    p(w | h_t) = (1 - lambda) p_LM(w | h_t) + lambda p_cache(w | h_t),
    p_cache(w | h_t) proportional to sum over earlier positions i < t of the same document with x_{i+1} = w
                     of exp(-|h_t - h_i|^2 / T)

Built from the project's parts, not copied: the cache is an `ExactMemory` (memlm.memory.knn_store)
with one stream per batch row, key = the position's kNN-LM key (Decoder's knn_key), value = its next
token; p_cache and the mixture are kNN-LM's (memlm.retrieval.knnlm: knn_logprob_from_matches and
interpolate, so lambda 0 is the base LM bit for bit), and lambda and T are tuned by kNN-LM's grid search
(memlm.jobs.knnlm_eval.tune) on tuning documents that the command line checks share none with the
evaluation. Grave et al. use exp(theta h_t . h_i) over the whole cache; we use kNN-LM's squared L2
(the scale kNN-LM's tuning grid is built for) over the k nearest entries, which is the whole cache when
k >= its size.

The store searches by maximum inner product, so keys and queries are augmented: key' = [h_i, -|h_i|^2/2],
query' = [h_t, 1] give query'.key' = -(|h_t - h_i|^2 - |h_t|^2) / 2, whose largest values are the
nearest keys. The store holds the past segments of the row's document (the last `size` positions,
FIFO); the earlier positions of the current segment come from one masked (T, T) distance matrix, so
every position i < t counts, as in the paper. The base runs segment by segment with any memory
(none or Transformer-XL), as `memlm eval --memory` does.

Shape legend: B rows, T segment length, C key width, k neighbours, V vocab, n scored tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from memlm.errors import MemlmError
from memlm.jobs.knnlm_eval import TuningData, tune
from memlm.jobs.memorizing import open_memory
from memlm.jobs.segment_eval import SegmentStream
from memlm.jobs.token_scores import knn_final, score_chunk
from memlm.model.memory_config import MemoryConfig
from memlm.model.decoder import Decoder
from memlm.model.device import synchronize
from memlm.retrieval.knnlm import KNNLMConfig, knn_logprob_from_matches
from memlm.memory.knn_store import ExactMemory

DEFAULT_CACHE_SIZE = 2048
"""Positions of earlier segments a cache holds per document when --cache-size is unset (Grave et al. 2017's
largest cache, 2000, on WikiText-103)."""
RETRIEVED_FLOATS = 1 << 24
"""Most retrieved-key floats held at once (64 MB): queries are searched in blocks of that size."""


class _Cache:
    """One run's cache: an ExactMemory of B streams, float32 so that token ids (values) stay exact."""

    def __init__(self, rows: int, dim: int, size: int, device: torch.device) -> None:
        self.store = ExactMemory(rows, dim + 1, 1, size, device, dtype=torch.float32)

    def candidates(self, keys: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                   k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Squared-L2 distances (B, T, K) (inf where missing) and next tokens (B, T, K) of each position's
        nearest earlier positions: up to k from the store (past segments), up to k from this segment.

        keys (B, T, C) float32, targets (B, T) int64, mask (B, T) bool (real positions)."""
        B, T, C = keys.shape
        sq = keys.pow(2).sum(-1)  # (B, T)
        query = torch.cat([keys, torch.ones_like(sq)[..., None]], dim=-1)  # (B, T, C+1)
        # The store returns the retrieved keys themselves, (B, q, k, C+1): a block of queries at a time.
        block = max(1, RETRIEVED_FLOATS // max(B * k * (C + 1), 1))
        if int(self.store.sizes().max()) == 0:  # nothing cached yet: every row's first segment
            past_d = [torch.full((B, T, k), math.inf, device=keys.device)]  # (B, T, k)
            past_v = [torch.zeros(B, T, k, dtype=torch.long, device=keys.device)]  # (B, T, k)
        else:
            past_d, past_v = [], []
            for lo in range(0, T, block):
                q = query[:, lo : lo + block]  # (B, q, C+1)
                got = self.store.search(q, k)
                dot = torch.einsum("bqd,bqkd->bqk", q, got.keys)  # (B, q, k)
                d = (sq[:, lo : lo + block, None] - 2 * dot).clamp(min=0)  # (B, q, k) = |h_t - h_i|^2
                past_d.append(d.masked_fill(~got.valid, math.inf))
                past_v.append(got.values[..., 0].round().long())  # (B, q, k)
        local = torch.cdist(keys, keys).pow(2)  # (B, T, T): |h_t - h_i|^2
        earlier = torch.ones(T, T, dtype=torch.bool, device=keys.device).tril(-1)  # (T, T) i < t
        local = local.masked_fill(~(earlier[None] & mask[:, None, :]), math.inf)  # (B, T, T)
        local_d, local_i = torch.topk(local, min(k, T), dim=-1, largest=False)  # (B, T, k')
        local_v = targets[:, None, :].expand(B, T, T).gather(-1, local_i)  # (B, T, k')
        return (torch.cat([torch.cat(past_d, dim=1), local_d], dim=-1),
                torch.cat([torch.cat(past_v, dim=1), local_v], dim=-1))  # (B, T, K) each

    def append(self, keys: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> None:
        """After the segment: its real positions enter the cache (key', next token)."""
        sq = keys.pow(2).sum(-1, keepdim=True)  # (B, T, 1)
        self.store.append(torch.cat([keys, -sq / 2], dim=-1), targets[..., None].float(), mask)  # (B, T, C+1)


def _pass(model: Decoder, docs: Sequence[Sequence[int]], memory: MemoryConfig, size: int, k: int, *,
          boundary_token: int, batch_size: int, collect: bool,
          knn: KNNLMConfig | None) -> dict[str, Any]:
    """One segment-recurrent pass: base and (with fixed `knn`) cache NLL sums, or the tuning data."""
    stream = SegmentStream(docs, batch_size, memory.segment, boundary_token)
    device = model.device
    state = open_memory(model, memory, batch_size)
    cache = _Cache(batch_size, model.config.n_embd, size, device)
    base_sum = torch.zeros((), dtype=torch.float64, device=device)
    cache_sum = torch.zeros((), dtype=torch.float64, device=device)
    lm_parts, dist_parts, match_parts, n_tokens = [], [], [], 0
    with torch.inference_mode():
        while (batch := stream.next_batch()) is not None:
            reset = batch.reset.to(device)
            if state is not None:
                state = state.reset_rows(reset)
            cache.store.clear(reset)
            out = model(batch.inputs.to(device), state)
            state = out.state
            mask, targets = batch.mask.to(device), batch.targets.to(device)  # (B, T) each
            keys = out.knn_key.float()  # (B, T, C)
            dist, values = cache.candidates(keys, targets, mask, k)  # (B, T, K) each
            cache.append(keys, targets, mask)
            base = score_chunk(out.logits[mask], targets[mask]).base  # (n,), as evaluate_memory
            matches = values[mask] == targets[mask][:, None]  # (n, K)
            base_sum -= base.double().sum()
            n_tokens += int(mask.sum())
            if collect:
                lm_parts.append(base.cpu())
                dist_parts.append(dist[mask].cpu())
                match_parts.append(matches.cpu())
            else:
                knn_lp = knn_logprob_from_matches(dist[mask], matches, knn.temperature)  # (n,)
                cache_sum -= knn_final(base, knn_lp, knn.lmbda).double().sum()
    cache.store.close()
    data = TuningData(torch.cat(lm_parts), torch.cat(dist_parts), torch.cat(match_parts)) if collect else None
    return {"base_nll_sum": float(base_sum), "cache_nll_sum": float(cache_sum), "tokens": n_tokens,
            "documents": len(stream.docs), "tuning": data}


def evaluate_continuous_cache(
    model: Decoder,
    token_docs: Sequence[Sequence[int]],
    memory: MemoryConfig,
    size: int,
    knn: KNNLMConfig,
    *,
    boundary_token: int,
    batch_size: int = 1,
    tune_docs: Sequence[Sequence[int]] | None = None,
) -> dict[str, Any]:
    """Perplexity of the base (segment-recurrent `memory`, kind "none" or "xl") and of the base with a
    continuous cache of the last `size` positions of each document, in one pass.

    knn: k (neighbours per token), lambda and temperature; those left None are tuned on `tune_docs`
        (which the caller guarantees share no document with `token_docs`).
    Returns perplexity (with the cache), base_perplexity, lambda, temperature, cache_size, k, tokens, ...
    """
    if memory.kind not in ("none", "xl"):
        raise MemlmError(f"the continuous cache runs over --memory none or xl, not {memory.kind}")
    if size < 1:
        raise MemlmError(f"--cache-size must be at least 1, got {size}")
    if memory.segment > model.config.max_seq_len:
        raise MemlmError(f"--segment {memory.segment} is longer than the model supports ({model.config.max_seq_len})")
    was_training = model.training
    model.eval()
    common = {"boundary_token": boundary_token, "batch_size": batch_size}
    tuned = None
    if knn.needs_tuning:
        if not tune_docs:
            raise MemlmError("--lambda auto / --knn-temperature auto need --tune-data")
        data = _pass(model, tune_docs, memory, size, knn.k, collect=True, knn=None, **common)["tuning"]
        tuned = tune(data, fixed_lmbda=knn.lmbda, fixed_temperature=knn.temperature)
        knn = KNNLMConfig(k=knn.k, lmbda=tuned.lmbda, temperature=tuned.temperature)
    synchronize(model.device)
    t0 = time.perf_counter()
    run = _pass(model, token_docs, memory, size, knn.k, collect=False, knn=knn, **common)
    synchronize(model.device)
    seconds = time.perf_counter() - t0
    model.train(was_training)
    n = max(run["tokens"], 1)
    nll, base_nll = run["cache_nll_sum"] / n, run["base_nll_sum"] / n
    return {
        "continuous_cache": True, "cache_size": size, "k": knn.k, "lambda": knn.lmbda, "temperature": knn.temperature,
        "tuned": tuned is not None, "tune_perplexity": tuned.perplexity if tuned else None,
        "memory": memory.kind, "segment": memory.segment, "mem_len": memory.mem_len if memory.kind == "xl" else 0,
        "sink_tokens": memory.sink_tokens if memory.kind == "xl" else 0, "boundary_token": boundary_token,
        "documents": run["documents"], "tokens": run["tokens"], "nll": nll, "perplexity": math.exp(nll),
        "base_nll": base_nll, "base_perplexity": math.exp(base_nll), "relative_change": math.exp(nll - base_nll) - 1,
        "seconds": seconds, "tokens_per_s": run["tokens"] / seconds if seconds > 0 else float("inf"),
    }
