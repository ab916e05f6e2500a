"""SPALM evaluation (Yogatama et al. 2021; issue 11): segment-recurrent perplexity with the XL memory as
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
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from memlm.errors import MemlmError
from memlm.jobs.memorizing import open_memory
from memlm.jobs.segment_eval import SegmentStream, attention_cost
from memlm.memory.config import MemoryConfig
from memlm.memory.spalm import SpalmHead, spalm_forward
from memlm.model.config import ModelConfig
from memlm.model.decoder import Decoder
from memlm.model.device import synchronize
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
) -> dict[str, Any]:
    """SPALM perplexity of `model` with `head` over `token_docs` (token ids per document).

    memory: kind "spalm": segment, XL memory size and sink tokens, as for memlm.jobs.segment_eval.
    searcher: the datastore; its keys must be this model's kNN keys (the caller checks with
        memlm.retrieval.compat.check_searcher). k: neighbours per scored token.
    token_counts: (V,) occurrences of each token in the datastore's corpus, for the gate by frequency.
    head_trained: recorded (False for a fresh head, whose gate is GATE_BIAS_INIT everywhere).
    Returns perplexity, nll, tokens, tokens_per_s, seconds, gate_mean (g: the hidden state's weight),
    memory_weight_mean (1 - g), neighbour_rate (scored tokens with any neighbour), gate_by_frequency
    {bucket: {"tokens", "gate_mean"}}, and the memory settings and attention cost of segment_eval.
    """
    mcfg = spalm_memory(memory)
    if mcfg.segment > model.config.max_seq_len:
        raise MemlmError(f"--segment {mcfg.segment} is longer than the model supports ({model.config.max_seq_len})")
    if token_counts.shape != (model.config.vocab_size,):
        raise MemlmError(f"token counts must have shape ({model.config.vocab_size},), got {token_counts.shape}")
    device = model.device
    buckets = torch.from_numpy(frequency_buckets(token_counts)).to(device)  # (V,)
    stream = SegmentStream(token_docs, batch_size, mcfg.segment, boundary_token)
    state = open_memory(model, mcfg, batch_size)
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    gate_sum = torch.zeros(len(BUCKETS), dtype=torch.float64, device=device)  # (buckets,)
    bucket_tokens = torch.zeros(len(BUCKETS), dtype=torch.long, device=device)
    n_tokens = with_neighbours = 0
    was_training = model.training
    model.eval()
    synchronize(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        while (batch := stream.next_batch()) is not None:
            state = state.reset_rows(batch.reset.to(device))
            mask, targets = batch.mask.to(device), batch.targets.to(device)  # (B, T) each
            out = spalm_forward(model, head, batch.inputs.to(device), state, searcher, k, mask, options)
            state = out.state
            logp = F.log_softmax(out.logits.float(), dim=-1)  # (B, T, V)
            nll_sum -= logp.gather(-1, targets[..., None])[..., 0][mask].double().sum()
            b = buckets[targets[mask]]  # (n,)
            gate_sum.index_add_(0, b, out.gate[mask].double())
            bucket_tokens += torch.bincount(b, minlength=len(BUCKETS))
            n_tokens += int(mask.sum())
            with_neighbours += int(out.has_neighbours[mask].sum())
    synchronize(device)
    seconds = time.perf_counter() - t0
    model.train(was_training)
    nll = float(nll_sum) / max(n_tokens, 1)
    gate_mean = float(gate_sum.sum()) / max(n_tokens, 1)
    by_freq = {name: {"tokens": int(bucket_tokens[i]),
                      "gate_mean": float(gate_sum[i]) / int(bucket_tokens[i]) if int(bucket_tokens[i]) else None}
               for i, name in enumerate(BUCKETS)}
    return {
        "memory": "spalm", "segment": mcfg.segment, "mem_len": mcfg.mem_len, "sink_tokens": mcfg.sink_tokens,
        "boundary_token": boundary_token, "k": k, "head_trained": head_trained,
        "documents": len(stream.docs), "tokens": n_tokens, "nll": nll, "perplexity": math.exp(nll),
        "gate_mean": gate_mean, "memory_weight_mean": 1.0 - gate_mean,
        "neighbour_rate": with_neighbours / max(n_tokens, 1), "gate_by_frequency": by_freq,
        "seconds": seconds, "tokens_per_s": n_tokens / seconds if seconds > 0 else float("inf"),
        **attention_cost(mcfg, mcfg.segment, model.config.n_layer),
    }


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
    """(V,) occurrences of each next token in the datastore (its corpus' counts, for the gate report)."""
    return np.bincount(np.asarray(store.values, dtype=np.int64), minlength=vocab_size)[:vocab_size]


def spalm_trainable(config: ModelConfig, train_top: int | None) -> tuple[str, ...]:
    """Name prefixes of the decoder parameters that `--spalm-train-top N` trains besides W (lm_head).

    The datastore's keys are the pretrained model's; a query key must stay that model's key, so only what
    lies after the key layer may train: of the top N blocks and the final norm, the key layer's own block
    trains its feed-forward only (its attention and norms make the key: ModelConfig.key_description), and
    N reaching below the key layer is refused (one line). With tied embeddings, training W moves the input
    embedding too, hence every key: --freeze-embeddings keeps the keys exact (issue 11, "the keys stay fixed").
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
