"""memlm train/eval/score --memory memorizing on the tiny preset: what trains, exact resume, a
checkpoint round-trips into eval, the gate at 0 is the XL model exactly, scoring equals the eval path."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from tiny_models import phrase_documents as documents

from memlm.cli import main
from memlm.errors import MemlmError
from memlm.engine.generate import generate
from memlm.jobs.decoding import SamplingConfig
from memlm.jobs.memorizing import fresh_knn_attention
from memlm.jobs.scoring import score_tokens_segments
from memlm.jobs.segment_eval import evaluate_memory
from memlm.jobs.train import TrainConfig, train
from memlm.model.memory_config import MemoryConfig, memorizing_layer
from memlm.memory.memorizing import load_knn_attention, mean_gate
from memlm.model.checkpoint import read_settings
from memlm.model.weights import load_pretrained
from memlm.memory.knn_store import ExactMemory

MEMORY = MemoryConfig("memorizing", mem_len=8, sink_tokens=0, segment=16, knn_mem_size=48, knn_top_k=4,
                      knn_backend="exact")


def config(**kw) -> TrainConfig:
    return TrainConfig(**({"model": "tiny", "init": "pretrained", "memory": MEMORY, "batch_size": 2, "steps": 3,
                           "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 0, "log_every": 0, "device": "cpu"} | kw))


def quiet(_line: str) -> None:
    pass


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    return {name for name in before if not torch.equal(before[name], after[name])}


def test_gate_trains_only_the_knn_attention() -> None:
    base = {k: v.clone() for k, v in load_pretrained("tiny").model.state_dict().items()}
    result = train(config(knn_train="gate"), documents(2, 80), log=quiet)
    assert changed(base, result.model.state_dict()) == set()  # every decoder parameter bit-identical
    fresh = fresh_knn_attention(result.model).state_dict()
    assert changed(fresh, result.knn_attention.state_dict()) == {"gate_logit", "log_scale"}


def test_top_trains_the_layers_from_the_memorizing_layer_up() -> None:
    base = {k: v.clone() for k, v in load_pretrained("tiny").model.state_dict().items()}
    result = train(config(knn_train="top"), documents(2, 80), log=quiet)
    layer = memorizing_layer(MEMORY, result.model.config.n_layer)
    assert layer == 1
    moved = changed(base, result.model.state_dict())
    assert moved and all(name.startswith(f"layers.{layer}.") for name in moved)  # below L: bit-identical
    assert f"layers.{layer}.self_attn.q_proj.weight" in moved and f"layers.{layer}.mlp.down_proj.weight" in moved
    assert changed(fresh_knn_attention(result.model).state_dict(), result.knn_attention.state_dict())


def test_training_refuses_the_service_backend() -> None:
    with pytest.raises(MemlmError, match="memlm train keeps its kNN memory in process"):
        train(config(memory=dataclasses.replace(MEMORY, knn_backend="service")), documents(2, 40), log=quiet)


def test_from_scratch_everything_trains_and_knn_train_is_refused() -> None:
    result = train(config(init="scratch", steps=2), documents(2, 80), log=quiet)
    assert result.knn_attention is not None and len(result.losses) == 2
    with pytest.raises(Exception, match="from scratch everything trains"):
        config(init="scratch", knn_train="gate")


def test_resume_equals_uninterrupted(tmp_path) -> None:
    cfg = config(knn_train="top", steps=6)
    docs = documents(3, 70)  # rows switch documents mid-run: data position and kNN memory must resume
    whole = train(dataclasses.replace(cfg, out_dir=str(tmp_path / "whole")), docs, log=quiet)
    ckpt = tmp_path / "ckpt"
    first = train(dataclasses.replace(cfg, out_dir=str(ckpt)), docs, log=quiet, stop_at=3)
    rest = train(dataclasses.replace(cfg, out_dir=str(ckpt)), docs, resume_from=ckpt, log=quiet)
    assert first.losses + rest.losses == whole.losses  # bit-identical on CPU
    assert torch.equal(rest.knn_attention.gate_logit, whole.knn_attention.gate_logit)
    resumed, reference = load_pretrained(str(ckpt)).model, load_pretrained(str(tmp_path / "whole")).model
    for (name, a), (_, b) in zip(resumed.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name


def test_checkpoint_round_trips_into_eval(tmp_path, capsys) -> None:
    ckpt = tmp_path / "ckpt"
    result = train(config(knn_train="gate", out_dir=str(ckpt)), documents(2, 80), log=quiet)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": "the cat sat on the mat. " * 8}) + "\n" for _ in range(2)))
    out = tmp_path / "r.json"
    code = main(["eval", "--model", str(ckpt), "--data", str(data), "--memory", "memorizing", "--knn-mem-size", "32",
                 "--knn-top-k", "2", "--quiet", "--json", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    r = json.loads(out.read_text())
    assert (r["memory"], r["knn_mem_size"], r["knn_top_k"], r["knn_backend"], r["knn_layer"]) == (
        "memorizing", 32, 2, "exact", 1)
    assert r["gate_trained"] is True and r["mean_gate"] == mean_gate(result.knn_attention)
    assert r["mean_gate"] == mean_gate(load_knn_attention(ckpt))
    assert "--knn-layer 1" in err  # the layer (resolved in settings.json) and the XL part come from the checkpoint
    assert read_settings(ckpt).memory == dataclasses.replace(MEMORY, knn_layer=1)
    code = main(["eval", "--model", str(ckpt), "--data", str(data), "--memory", "memorizing", "--knn-layer", "0",
                 "--quiet"])
    assert code == 1 and "--knn-layer 0 differs from checkpoint" in capsys.readouterr().err
    # Memory 0: the same checkpoint with its XL memory alone (the gate-trained decoder is the base model).
    code = main(["eval", "--model", str(ckpt), "--data", str(data), "--memory", "xl", "--quiet", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    xl = json.loads(out.read_text())
    assert (xl["memory"], xl["mem_len"], xl["segment"]) == ("xl", MEMORY.mem_len, MEMORY.segment)
    assert "mean_gate" not in xl


def test_gate_at_zero_is_the_xl_model_exactly() -> None:
    model = load_pretrained("tiny").model
    knn = fresh_knn_attention(model)
    with torch.no_grad():
        knn.gate_logit.fill_(-math.inf)  # g = sigmoid(-inf) = 0 exactly
    docs = documents(3, 90)
    mem = evaluate_memory(model, docs, MEMORY, boundary_token=0, batch_size=2, knn_attention=knn)
    xl = evaluate_memory(model, docs, dataclasses.replace(MEMORY, kind="xl"), boundary_token=0, batch_size=2)
    assert mem["nll"] == xl["nll"] and mem["tokens"] == xl["tokens"]
    assert mem["mean_gate"] == [0.0] * model.config.n_head
    live = evaluate_memory(model, docs, MEMORY, boundary_token=0, batch_size=2, knn_attention=fresh_knn_attention(model))
    assert live["nll"] != xl["nll"]  # a gate above 0 does read the memory


def test_scoring_equals_the_eval_path() -> None:
    model = load_pretrained("tiny").model
    knn = fresh_knn_attention(model)
    docs = documents(3, 90)
    ev = evaluate_memory(model, docs, MEMORY, boundary_token=0, batch_size=2, knn_attention=knn)
    scores = score_tokens_segments(model, docs, memory=MEMORY, boundary_token=0, batch_size=2, knn_attention=knn)
    total = sum(float(s.base_logprob.astype("float64").sum()) for s in scores)
    assert -total / ev["tokens"] == pytest.approx(ev["nll"], rel=1e-12, abs=0)
    assert sum(len(s.tokens) for s in scores) == ev["tokens"]


def test_untrained_gate_is_recorded(tmp_path, capsys) -> None:
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"text": "a b c d e f g " * 10}) + "\n")
    out = tmp_path / "r.json"
    code = main(["eval", "--model", "tiny", "--data", str(data), "--memory", "memorizing", "--segment", "16",
                 "--knn-mem-size", "64", "--quiet", "--json", str(out)])
    assert code == 0
    r = json.loads(out.read_text())
    assert r["gate_trained"] is False and "untrained" in capsys.readouterr().err


class CountingMemory(ExactMemory):
    """An in-process memory standing in for a retrieval-service session: it counts its closes."""

    closed_count = 0

    def close(self) -> None:
        CountingMemory.closed_count += 1
        super().close()


def counting_factory(streams: int, dim: int, value_dim: int, capacity: int) -> CountingMemory:
    return CountingMemory(streams, dim, value_dim, capacity)


def test_generation_with_the_gate_at_zero_is_xl_generation_and_releases_its_store() -> None:
    pre = load_pretrained("tiny")
    model, tok = pre.model, pre.tokenizer
    knn = fresh_knn_attention(model)
    with torch.no_grad():
        knn.gate_logit.fill_(-math.inf)
    prompt = documents(1, 40)[0]
    run = {"max_new_tokens": 20, "sampling": SamplingConfig(temperature=0), "boundary_token": 0}
    xl = list(generate(model, tok, prompt, memory=dataclasses.replace(MEMORY, kind="xl"), **run))
    service = dataclasses.replace(MEMORY, knn_backend="service")
    CountingMemory.closed_count = 0
    mz = list(generate(model, tok, prompt, memory=service, knn_attention=knn, service=counting_factory, **run))
    assert [e.token_id for e in mz[:-1]] == [e.token_id for e in xl[:-1]]
    assert [e.logprob for e in mz[:-1]] == [e.logprob for e in xl[:-1]]
    assert CountingMemory.closed_count == 1
    events = generate(model, tok, prompt, memory=service, knn_attention=fresh_knn_attention(model),
                      service=counting_factory, **run)
    next(events)
    events.close()  # a caller that stops early (a cancelled Generate) releases the session too
    assert CountingMemory.closed_count == 2


def test_eval_and_scoring_release_their_store() -> None:
    model = load_pretrained("tiny").model
    service = dataclasses.replace(MEMORY, knn_backend="service")
    CountingMemory.closed_count = 0
    docs = documents(2, 40)
    ev = evaluate_memory(model, docs, service, boundary_token=0, knn_attention=fresh_knn_attention(model),
                         service=counting_factory)
    assert ev["knn_backend"] == "service"
    score_tokens_segments(model, docs, memory=service, boundary_token=0, knn_attention=fresh_knn_attention(model),
                          service=counting_factory)
    assert CountingMemory.closed_count == 2
    with pytest.raises(MemlmError, match="needs a memory service"):
        evaluate_memory(model, docs, service, boundary_token=0, knn_attention=fresh_knn_attention(model))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 autocast path of memlm train)")
def test_gate_training_under_bf16_autocast_on_cuda() -> None:
    result = train(config(knn_train="gate", device="cuda", steps=3), documents(2, 80), log=quiet)
    assert all(math.isfinite(x) for x in result.losses)
    assert changed(fresh_knn_attention(result.model).state_dict(), result.knn_attention.state_dict())
