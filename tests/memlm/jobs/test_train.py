"""memlm.jobs.train on the tiny preset with token lists: it learns, resumes exactly, trains only what it should."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import phrase_documents as documents

from memlm.errors import MemlmError
from memlm.jobs.segment_eval import evaluate_segments
from memlm.jobs.train import TrainConfig, load_compressor, lr_at, train
from memlm.model.memory_config import MemoryConfig
from memlm.model.checkpoint import TextSettings, read_extra, read_settings
from memlm.model.config import ModelConfig
from memlm.model.tokenizer import document_boundary
from memlm.model.weights import load_pretrained, random_model


def quiet(_line: str) -> None:
    pass


def small_config(**kw) -> TrainConfig:
    base = dict(
        model="tiny", memory=MemoryConfig("xl", mem_len=16, sink_tokens=0, segment=16), batch_size=2,
        steps=40, lr=3e-3, min_lr=3e-4, warmup_steps=4, log_every=0, device="cpu",
    )
    base.update(kw)
    return TrainConfig(**base)


def test_lr_schedule_warmup_then_cosine():
    cfg = small_config(steps=100, warmup_steps=10, lr=1.0, min_lr=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(55, cfg) == pytest.approx(0.55)
    assert lr_at(100, cfg) == pytest.approx(0.1)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 100))


def test_training_lowers_the_loss():
    cfg = small_config()
    docs, held_out = documents(6, 120), documents(2, 120, seed=1)
    model = random_model(ModelConfig.from_name("tiny"), cfg.seed, "cpu", torch.float32)
    before = evaluate_segments(model, held_out, 16, "xl", mem_len=16, sink_tokens=0, boundary_token=256)
    result = train(cfg, docs, held_out, log=quiet)
    after = result.evals[-1]
    assert result.step == 40 and after["tokens"] == before["tokens"] == 240
    assert after["perplexity"] < 0.5 * before["perplexity"]
    assert sum(result.losses[-5:]) < 0.7 * sum(result.losses[:5])


@pytest.mark.parametrize(
    "memory",
    [MemoryConfig("xl", mem_len=16, sink_tokens=2, segment=16),
     MemoryConfig("compressive", 8, 8, 2, "conv", sink_tokens=2, segment=16)],
    ids=["xl", "compressive-conv"],
)
def test_resume_continues_identically(tmp_path, memory):
    cfg = small_config(memory=memory, steps=8, warmup_steps=2)
    docs = documents(3, 70)  # rows switch documents mid-run: the data position and memory must resume
    whole = train(cfg, docs, log=quiet)
    ckpt = tmp_path / "ckpt"
    first = train(dataclasses.replace(cfg, out_dir=str(ckpt)), docs, log=quiet, stop_at=3)
    assert first.step == 3 and read_extra(ckpt)["step"] == 3
    rest = train(dataclasses.replace(cfg, out_dir=str(ckpt)), docs, resume_from=ckpt, log=quiet)
    assert rest.step == 8
    assert first.losses + rest.losses == whole.losses  # bit-identical on CPU
    assert first.reconstruction_losses + rest.reconstruction_losses == whole.reconstruction_losses
    resumed = load_pretrained(str(ckpt)).model
    # The uninterrupted run's weights: train again to step 8 with a checkpoint.
    again = train(dataclasses.replace(cfg, out_dir=str(tmp_path / "whole")), docs, log=quiet)
    assert again.losses == whole.losses
    reference = load_pretrained(str(tmp_path / "whole")).model
    for (name, a), (_, b) in zip(resumed.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name


def test_checkpoint_carries_its_config(tmp_path):
    cfg = small_config(steps=2, out_dir=str(tmp_path / "c"))
    train(cfg, documents(2, 40), log=quiet)
    assert TrainConfig.from_dict(read_extra(tmp_path / "c")["train_config"]) == cfg
    assert load_pretrained(str(tmp_path / "c")).model.config == ModelConfig.from_name("tiny")


def test_compressor_only_training_freezes_the_model(tmp_path):
    memory = MemoryConfig("compressive", mem_len=8, cmem_len=8, compress_rate=2, compress_fn="conv", sink_tokens=0,
                          segment=16)
    base = tmp_path / "base"
    train(small_config(steps=10, out_dir=str(base)), documents(3, 80), log=quiet)  # a trained "pretrained" model
    cfg = small_config(model=str(base), init="pretrained", memory=memory, compressor_only=True, steps=12,
                       lr=1e-2, warmup_steps=0, out_dir=str(tmp_path / "comp"))
    result = train(cfg, documents(3, 80), log=quiet)
    before, after = load_pretrained(str(base)).model, load_pretrained(str(tmp_path / "comp")).model
    for (name, a), (_, b) in zip(before.state_dict().items(), after.state_dict().items()):
        assert torch.equal(a, b), f"{name} changed in compressor-only training"
    comp = load_compressor(tmp_path / "comp")
    eye = torch.eye(comp.x_convs[0].weight.shape[0])[:, :, None].expand_as(comp.x_convs[0].weight) / 2
    assert not torch.equal(comp.x_convs[0].weight, eye)  # moved away from its mean-pooling init
    rec = [r for r in result.reconstruction_losses if r > 0]
    assert rec and sum(rec[-3:]) < sum(rec[:3])


def test_compressor_only_needs_conv():
    with pytest.raises(MemlmError, match="compress-fn conv"):
        small_config(memory=MemoryConfig("compressive", 8, 8, 2, "mean", segment=16), compressor_only=True)


def test_reconstruction_gradients_do_not_scale_the_model_steps():
    # The model and the compressor are clipped each on its own norm. Oracle: with the compressor's
    # gradient far above the clip norm at both weights, its clipped gradient (hence its trajectory) is
    # the same, so the model must end bit-for-bit alike; one global norm would shrink the model's
    # gradient by a factor that depends on the weight (100x apart here) and the runs would differ.
    memory = MemoryConfig("compressive", mem_len=8, cmem_len=8, compress_rate=2, compress_fn="conv", sink_tokens=0,
                          segment=16)
    runs = [train(small_config(memory=memory, steps=8, grad_clip=1.0, reconstruction_weight=w), documents(2, 120),
                  log=quiet) for w in (1e6, 1e8)]
    assert any(r > 0 for r in runs[0].reconstruction_losses)  # the compressor was trained
    for (name, a), (_, b) in zip(runs[0].model.state_dict().items(), runs[1].model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name} depends on the reconstruction weight")


def test_checkpoint_records_how_the_model_reads_text(tmp_path):
    memory = MemoryConfig("xl", mem_len=16, sink_tokens=2, segment=16)
    train(small_config(memory=memory, steps=2, out_dir=str(tmp_path / "c")), documents(2, 40), log=quiet)
    tokenizer = load_pretrained(str(tmp_path / "c")).tokenizer
    assert read_settings(tmp_path / "c") == TextSettings(boundary_token=document_boundary(tokenizer), memory=memory)


def test_train_starts_documents_with_the_one_boundary_token(tmp_path, smollm2_gguf, monkeypatch):
    """Train starts documents with the boundary token eval, the builder and the server take (<|endoftext|> for
    SmolLM2), not BOS (<|im_start|>)."""
    import memlm.jobs.train as train_module

    seen = []
    real_stream = train_module.SegmentStream

    def recording_stream(docs, batch_size, segment, boundary_token, **kw):
        seen.append(boundary_token)
        return real_stream(docs, batch_size, segment, boundary_token, **kw)

    monkeypatch.setattr(train_module, "SegmentStream", recording_stream)
    cfg = small_config(model="small", steps=1, batch_size=1, out_dir=str(tmp_path / "c"),
                       memory=MemoryConfig("xl", mem_len=8, segment=8))
    train(cfg, [[5, 6, 7, 8, 9, 10, 11, 12, 13]], log=quiet)
    tokenizer = load_pretrained(str(tmp_path / "c")).tokenizer
    assert tokenizer.bos_id != document_boundary(tokenizer)  # the oracle can tell the two rules apart
    assert seen == [document_boundary(tokenizer)] == [read_settings(tmp_path / "c").boundary_token]


def test_sink_tokens_default_is_memory_configs():
    assert TrainConfig().memory == MemoryConfig() and TrainConfig().memory.sink_tokens == MemoryConfig.sink_tokens


def test_old_checkpoints_with_a_top_level_segment_still_read():
    d = small_config().to_dict()
    d["segment"] = d["memory"].pop("segment")  # the older layout, with segment at the top level
    assert TrainConfig.from_dict(d) == small_config()
