"""SPALM evaluation (Yogatama et al. 2021): segment-recurrent perplexity with the XL memory as
short-term memory and a kNN datastore as long-term memory, read through the SPALM head (memlm.memory.spalm).

The segments, documents, boundary token and XL memory (with its sinks) are exactly those of `memlm eval
--memory xl` (memlm.jobs.segment_eval.SegmentStream and the same memory state); per segment the decoder
runs once, the kNN keys of its scored positions are searched in ONE batched Searcher.search, and the
head mixes the retrieved tokens' embeddings into the final hidden state. Besides perplexity the result
says how much the gate trusts the datastore: the mean of 1 - g over scored tokens is the share of the
memory ("gate" reports g itself, the weight of the hidden state), overall and by the frequency of the
target token in the datastore's corpus (`frequency_buckets`), the paper's analysis (its section 5).

Shape legend: B rows, T segment length, V vocab, k neighbours.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import torch

from memlm.errors import MemlmError
from memlm.jobs.knnlm_eval import TuningData, tune
from memlm.jobs.memorizing import open_memory
from memlm.jobs.segment_eval import SegmentStream, attention_cost
from memlm.jobs.token_scores import knn_final, score_chunk
from memlm.model.memory_config import MemoryConfig
from memlm.memory.spalm import SpalmHead, spalm_forward
from memlm.model.config import ModelConfig
from memlm.model.decoder import Decoder
from memlm.model.device import synchronize
from memlm.retrieval.knnlm import KNNLMConfig, knn_logprob_from_matches
from memlm.retrieval.searcher import Searcher, SearchOptions

BUCKETS: tuple[str, ...] = ("frequent", "rare", "unseen")
"""Target-token frequency buckets of the gate report (`frequency_buckets`)."""
FREQUENT_MASS = 0.8
""""frequent": the most frequent tokens of the datastore's corpus that together make up 80% of its tokens
(the Zipfian head); "rare": every other token it holds at least once; "unseen": tokens it never holds."""


def frequency_buckets(counts: np.ndarray) -> np.ndarray:
    """counts (V,) occurrences of each token in the datastore's corpus (np.bincount of its values) ->
    (V,) int64 index into BUCKETS. Ties at the FREQUENT_MASS cut go by token id (stable sort)."""
    counts = np.asarray(counts, dtype=np.int64)
    order = np.argsort(-counts, kind="stable")  # (V,) most frequent first
    covered = np.cumsum(counts[order])  # (V,)
    total = int(covered[-1]) if covered.size else 0
    buckets = np.where(counts > 0, 1, 2).astype(np.int64)  # (V,) rare or unseen
    if total > 0:
        # A token is frequent while the mass before it is under the cut (the token crossing it counts).
        head = order[(covered - counts[order]) < FREQUENT_MASS * total]
        buckets[head[counts[head] > 0]] = 0
    return buckets


def spalm_memory(memory: MemoryConfig) -> MemoryConfig:
    """The memory of a SPALM run: kind "spalm" (the XL memory plus the head); other kinds are refused."""
    if memory.kind != "spalm":
        raise MemlmError(f"SPALM runs with --memory spalm, got {memory.kind}")
    return memory


class _SpalmPass(NamedTuple):
    """Sums of one SPALM pass over documents (memlm.jobs.spalm._spalm_pass)."""

    nll: float  # SPALM's, float64 sum over scored tokens
    mixed_nll: float  # SPALM + kNN-LM's (= nll without a mixture)
    tokens: int
    with_neighbours: int  # scored tokens with any neighbour for the head
    knn_hits: int  # scored tokens with the target among kNN-LM's neighbours
    gate_sum: torch.Tensor  # (buckets,) float64 sums of g by target bucket
    bucket_tokens: torch.Tensor  # (buckets,) int64
    seconds: float
    tuning: TuningData | None  # SPALM's log p(target) and kNN-LM's neighbours, when collected


def _spalm_pass(model: Decoder, head: SpalmHead, token_docs: Sequence[Sequence[int]], memory: MemoryConfig,
                searcher: Searcher, k: int, boundary_token: int, buckets: torch.Tensor, batch_size: int,
                options: SearchOptions | None, knn_k: int, mix: tuple[float, float] | None,
                collect: bool) -> _SpalmPass:
    """The segments of `memlm eval --memory xl` through spalm_forward, one search of max(k, knn_k) per
    segment; `mix` (lambda, T) interpolates kNN-LM over the first knn_k neighbours (memlm.retrieval.knnlm);
    `collect` keeps what kNN-LM's tuner reads (memlm.jobs.knnlm_eval.tune)."""
    device = model.device
    stream = SegmentStream(token_docs, batch_size, memory.segment, boundary_token)
    state = open_memory(model, memory, batch_size)
    nll = torch.zeros((), dtype=torch.float64, device=device)
    mixed = torch.zeros((), dtype=torch.float64, device=device)
    gate_sum = torch.zeros(len(BUCKETS), dtype=torch.float64, device=device)  # (buckets,)
    bucket_tokens = torch.zeros(len(BUCKETS), dtype=torch.long, device=device)
    n_tokens = with_neighbours = hits = 0
    lm_parts, dist_parts, match_parts = [], [], []
    search_k = max(k, knn_k) if (mix is not None or collect) else k
    synchronize(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        while (batch := stream.next_batch()) is not None:
            state = state.reset_rows(batch.reset.to(device))
            mask, targets = batch.mask.to(device), batch.targets.to(device)  # (B, T) each
            out = spalm_forward(model, head, batch.inputs.to(device), state, searcher, k, mask, options,
                                search_k=search_k)
            state = out.state
            lp = score_chunk(out.logits[mask], targets[mask]).base  # (Q,) row-major, as the search rows
            nll -= lp.double().sum()
            if mix is not None or collect:
                nb = out.neighbors
                distances = torch.from_numpy(nb.distances[:, :knn_k].astype(np.float32))  # (Q, knn_k)
                matches = torch.from_numpy(nb.values[:, :knn_k].astype(np.int64)) == targets[mask].cpu()[:, None]
                hits += int(matches.any(dim=1).sum())
                if mix is not None:
                    knn_lp = knn_logprob_from_matches(distances, matches, mix[1])  # (Q,) log p_kNN(target)
                    mixed -= knn_final(lp, knn_lp, mix[0]).double().sum()
                if collect:
                    lm_parts.append(lp.float().cpu())
                    dist_parts.append(distances)
                    match_parts.append(matches)
            b = buckets[targets[mask]]  # (Q,)
            gate_sum.index_add_(0, b, out.gate[mask].double())
            bucket_tokens += torch.bincount(b, minlength=len(BUCKETS))
            n_tokens += int(mask.sum())
            with_neighbours += int(out.has_neighbours[mask].sum())
    synchronize(device)
    seconds = time.perf_counter() - t0
    tuning = TuningData(torch.cat(lm_parts), torch.cat(dist_parts), torch.cat(match_parts)) if lm_parts else None
    return _SpalmPass(float(nll), float(mixed) if mix else float(nll), n_tokens, with_neighbours, hits, gate_sum,
                      bucket_tokens, seconds, tuning)


def evaluate_spalm(
    model: Decoder,
    head: SpalmHead,
    token_docs: Sequence[Sequence[int]],
    memory: MemoryConfig,
    searcher: Searcher,
    k: int,
    *,
    boundary_token: int,
    token_counts: np.ndarray,
    batch_size: int = 1,
    options: SearchOptions | None = None,
    head_trained: bool = True,
    knn: KNNLMConfig | None = None,
    tune_docs: Sequence[Sequence[int]] | None = None,
) -> dict[str, Any]:
    """SPALM perplexity of `model` with `head` over `token_docs` (token ids per document).

    memory: kind "spalm": segment, XL memory size and sink tokens, as for memlm.jobs.segment_eval.
    searcher: the datastore; its keys must be this model's kNN keys (the caller checks with
        memlm.retrieval.compat.check_searcher). k: neighbours per scored token for the head.
    token_counts: (V,) occurrences of each token in the datastore's corpus, for the gate by frequency.
    head_trained: recorded (False for a fresh head, whose gate is GATE_BIAS_INIT everywhere).
    knn: SPALM + kNN-LM, p = (1 - lambda) p_SPALM + lambda p_kNN over knn.k neighbours of the same search
        (one of max(k, knn.k) per segment; the head reads its k nearest, the same as a search of k up to
        the order of tied distances); lambda or T None are tuned by kNN-LM's grid search on `tune_docs`
        (SPALM as its LM), never on token_docs. Its search options must be `options`.
    Returns perplexity, nll, tokens, tokens_per_s, seconds, gate_mean (g: the hidden state's weight),
    memory_weight_mean (1 - g), neighbour_rate (scored tokens with any neighbour), gate_by_frequency
    {bucket: {"tokens", "gate_mean"}}, and the memory settings and attention cost of segment_eval; with
    knn also spalm_nll, spalm_perplexity (perplexity and nll are then the mixture's), lambda, temperature,
    knn_k, knn_hit_rate, tuned, tune_tokens (and tune_spalm_perplexity, tune_perplexity when tuned).
    """
    mcfg = spalm_memory(memory)
    if mcfg.segment > model.config.max_seq_len:
        raise MemlmError(f"--segment {mcfg.segment} is longer than the model supports ({model.config.max_seq_len})")
    if token_counts.shape != (model.config.vocab_size,):
        raise MemlmError(f"token counts must have shape ({model.config.vocab_size},), got {token_counts.shape}")
    if knn is not None and knn.search_options != (options or SearchOptions()):
        raise MemlmError(f"kNN-LM's search options {knn.search_options} are not SPALM's {options}: one search serves both")
    buckets = torch.from_numpy(frequency_buckets(token_counts)).to(model.device)  # (V,)
    was_training = model.training
    model.eval()
    run_pass = partial(_spalm_pass, model, head, memory=mcfg, searcher=searcher, k=k, boundary_token=boundary_token,
                       buckets=buckets, batch_size=batch_size, options=options, knn_k=knn.k if knn else k)
    mixture, tuned = _spalm_mixture(knn, tune_docs, run_pass)
    run = run_pass(token_docs, mix=mixture, collect=False)
    model.train(was_training)
    n = max(run.tokens, 1)
    gate_mean = float(run.gate_sum.sum()) / n
    by_freq = {name: {"tokens": int(run.bucket_tokens[i]), "gate_mean": float(run.gate_sum[i]) /
                      int(run.bucket_tokens[i]) if int(run.bucket_tokens[i]) else None}
               for i, name in enumerate(BUCKETS)}
    result = {
        "memory": "spalm", "segment": mcfg.segment, "mem_len": mcfg.mem_len, "sink_tokens": mcfg.sink_tokens,
        "boundary_token": boundary_token, "k": k, "head_trained": head_trained,
        "documents": len([d for d in token_docs if len(d) > 0]), "tokens": run.tokens,
        "nll": run.mixed_nll / n, "perplexity": math.exp(run.mixed_nll / n),
        "gate_mean": gate_mean, "memory_weight_mean": 1.0 - gate_mean,
        "neighbour_rate": run.with_neighbours / n, "gate_by_frequency": by_freq,
        "seconds": run.seconds, "tokens_per_s": run.tokens / run.seconds if run.seconds > 0 else float("inf"),
        **attention_cost(mcfg, mcfg.segment, model.config.n_layer),
    }
    if mixture is not None:
        assert knn is not None
        result.update(spalm_nll=run.nll / n, spalm_perplexity=math.exp(run.nll / n), knn_k=knn.k,
                      knn_hit_rate=run.knn_hits / n, **{"lambda": mixture[0], "temperature": mixture[1]}, **tuned)
    return result


def require_tuning_docs(knn: KNNLMConfig | None, tune_docs: Sequence[Sequence[int]] | None) -> None:
    """lambda or T left to tuning (auto) needs tuning documents: one line, before any work."""
    if knn is not None and knn.needs_tuning and not tune_docs:
        raise MemlmError("--lambda auto / --knn-temperature auto need --tune-data (never tuned on the evaluation split)")


def _spalm_mixture(knn: KNNLMConfig | None, tune_docs: Sequence[Sequence[int]] | None,
                   run_pass: Callable[..., _SpalmPass]) -> tuple[tuple[float, float] | None, dict]:
    """(lambda, T) of SPALM + kNN-LM (None: SPALM alone) and the tuning record: as given, or those left None
    tuned by memlm.jobs.knnlm_eval.tune over SPALM's pass (`run_pass`: _spalm_pass with the evaluation's
    model, head and settings bound) on the tuning documents."""
    if knn is None:
        return None, {}
    if not knn.needs_tuning:
        assert knn.lmbda is not None and knn.temperature is not None
        return (knn.lmbda, knn.temperature), {"tuned": False, "tune_tokens": 0}
    require_tuning_docs(knn, tune_docs)
    data = run_pass(tune_docs, mix=None, collect=True).tuning
    if data is None:
        raise MemlmError("the tuning split has no tokens; pass other --tune-data / --tune-split")
    t = tune(data, fixed_lmbda=knn.lmbda, fixed_temperature=knn.temperature)
    return (t.lmbda, t.temperature), {"tuned": True, "tune_tokens": int(data.lm_logprob.shape[0]),
                                      "tune_spalm_perplexity": t.base_perplexity, "tune_perplexity": t.perplexity}


def check_spalm_train(memory: MemoryConfig, init: str, datastore: str | None, k: int | None,
                      freeze_embeddings: bool, train_top: int | None = None) -> None:
    """The TrainConfig fields of SPALM: a datastore with --memory spalm (and only there), a pretrained model.
    train_top is checked against the model's key layer where the model is loaded (spalm_trainable)."""
    if memory.kind != "spalm":
        raise MemlmError(f"--datastore, --k, --freeze-embeddings and --spalm-train-top apply to --memory spalm only, "
                         f"not {memory.kind}")
    if train_top is not None and train_top < 1:
        raise MemlmError(f"--spalm-train-top must be at least 1, got {train_top}")
    if datastore is None:
        raise MemlmError("--memory spalm needs --datastore DIR (its long-term memory)")
    if init != "pretrained":
        raise MemlmError("--memory spalm fine-tunes the model whose keys the datastore holds: pass --init pretrained")
    if k is not None and k < 1:
        raise MemlmError(f"--k must be at least 1, got {k}")


def datastore_token_counts(store: Any, vocab_size: int) -> np.ndarray:
    """(V,) occurrences of each next token among the live entries of a datastore.Datastore (its corpus'
    counts, for the gate report): entries of removed documents (store.live) are not counted,
    as no search returns them."""
    values = np.asarray(store.values, dtype=np.int64)  # (N,)
    if store.live is not None:
        values = values[store.live.live]  # (L,) the live entries
    return np.bincount(values, minlength=vocab_size)[:vocab_size]


def spalm_trainable(config: ModelConfig, train_top: int | None) -> tuple[str, ...]:
    """Name prefixes of the decoder parameters that `--spalm-train-top N` trains besides W (lm_head).

    The datastore's keys are the pretrained model's; a query key must stay that model's key, so only what
    lies after the key layer may train: of the top N blocks and the final norm, the key layer's own block
    trains its feed-forward only (its attention and norms make the key: ModelConfig.key_description), and
    N reaching below the key layer is refused (one line). With tied embeddings, training W moves the input
    embedding too, hence every key: --freeze-embeddings keeps the keys exact (the datastore's keys stay fixed).
    """
    if train_top is None:
        return ()
    key = config.key_layer_index if config.knn_key == "ffn_input" else config.n_layer  # final_hidden: after all
    most = config.n_layer - key
    if train_top > most:
        raise MemlmError(f"--spalm-train-top {train_top} would change the datastore's keys ({config.key_description}): "
                         f"at most {most} for this model (the key layer's block trains its feed-forward only)")
    lowest = config.n_layer - train_top
    blocks = [f"layers.{i}." for i in range(lowest, config.n_layer) if i != key]
    return ("norm.", *blocks, *([f"layers.{key}.mlp."] if lowest <= key else []))


def select_spalm_trainable(model: Decoder, train_top: int | None, freeze_embeddings: bool) -> tuple[str, ...]:
    """Freeze the decoder but for W (unless freeze_embeddings) and spalm_trainable's parameters; returns those
    name prefixes. Frozen parameters get no gradient, so they stay bit-identical through training."""
    trained = spalm_trainable(model.config, train_top)
    model.requires_grad_(False)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(trained))
    model.lm_head.weight.requires_grad_(not freeze_embeddings)  # W (the input embedding too when tied)
    return trained
