"""SPALM training (memlm.jobs.spalm_train): a step changes the head and W only (the head only with
--freeze-embeddings), the checkpoint evaluates with its head, and the leakage guard drops exactly the
neighbours of a query's own document near its position when the training text is the datastore's corpus."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from datastore import Datastore
from memlm.cli import main
from memlm.jobs.segment_eval import SegmentStream
from memlm.jobs.spalm_train import batch_provenance, leakage_filter, leakage_window
from memlm.memory.spalm import GATE_BIAS_INIT, load_spalm_head
from memlm.model.checkpoint import load_checkpoint
from memlm.model.weights import load_pretrained
from memlm.retrieval.searcher import search_keys


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spalm")
    corpus = tmp / "corpus.jsonl"
    rows = [{"text": f"Speech number {i}: the state of the union is strong and growing.", "year": 1990 + i}
            for i in range(12)]
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    store = tmp / "store"
    assert main(["datastore", "build", "--model", "tiny", "--data", str(corpus), "--split", "year<2000", "--out",
                 str(store), "--context", "64", "--stride", "32", "--quiet"]) == 0
    return tmp, corpus, store


def train_args(corpus, store, out, *extra):
    return ["train", "--model", "tiny", "--init", "pretrained", "--memory", "spalm", "--datastore", str(store),
            "--data", str(corpus), "--split", "year<2000", "--steps", "2", "--warmup-steps", "0", "--lr", "0.05",
            "--segment", "32", "--mem-len", "32", "--batch-size", "2", "--k", "4", "--out", str(out), *extra]


@pytest.mark.parametrize("freeze", [False, True])
def test_a_training_step_changes_only_what_it_should(capsys, built, freeze):
    tmp, corpus, store = built
    out = tmp / f"ckpt-{freeze}"
    code, _, err = run(capsys, *train_args(corpus, store, out, *(["--freeze-embeddings"] if freeze else [])))
    assert code == 0, err
    assert "leakage guard on (window 64)" in err  # the training text is the datastore's corpus
    base = load_pretrained("tiny").model
    before, after = base.state_dict(), load_checkpoint(out).model.state_dict()
    # W is the output embedding (the input embedding too when tied; the tiny preset is untied)
    embedding = {"lm_head.weight", *(["embed_tokens.weight"] if base.config.tie_embeddings else [])}
    for name, value in before.items():
        same = torch.equal(value, after[name])
        assert same == (freeze or name not in embedding), name
    head, keys_fingerprint = load_spalm_head(out)
    assert keys_fingerprint == load_pretrained("tiny").fingerprint  # the datastore's keys' model
    assert bool(head.w_g.detach().abs().sum() > 0) and float(head.bias.detach()) != GATE_BIAS_INIT
    settings = json.loads((out / "settings.json").read_text())
    assert settings["memory"]["kind"] == "spalm" and settings["memory"]["segment"] == 32

    # the checkpoint evaluates with its own head and memory (taken from it), against the same datastore
    code, _, err = run(capsys, "eval", "--model", str(out), "--data", str(corpus), "--split", "year>=2000",
                       "--datastore", str(store), "--quiet", "--json", str(tmp / "eval.json"))
    assert code == 0, err
    result = json.loads((tmp / "eval.json").read_text())
    assert result["head_trained"] is True and result["memory"] == "spalm" and result["segment"] == 32


def test_spalm_training_refuses_what_does_not_apply(capsys, built):
    tmp, corpus, store = built
    args = train_args(corpus, store, tmp / "x")
    code, _, err = run(capsys, *[a for a in args if a != "pretrained" and a != "--init"])
    assert code == 1 and "pass --init pretrained" in err and err.count("\n") == 1, err
    no_store = args[:7] + args[9:]  # without --datastore DIR
    code, _, err = run(capsys, *no_store)
    assert code == 1 and "--memory spalm needs --datastore" in err, err
    code, _, err = run(capsys, "train", "--model", "tiny", "--data", str(corpus), "--freeze-embeddings", "--steps", "1")
    assert code == 1 and "apply to --memory spalm only" in err, err


def test_the_leakage_guard_drops_exactly_the_own_documents_nearby_entries(built):
    _tmp, corpus, store_dir = built
    from memlm.data.documents import load_documents, tokenize_documents
    from memlm.model.tokenizer import document_boundary

    pre = load_pretrained("tiny")
    store = Datastore.open(store_dir)
    docs = list(tokenize_documents(load_documents(str(corpus), "year<2000"), pre.tokenizer, None))
    boundary = document_boundary(pre.tokenizer)
    window = leakage_window(store.info())
    stream = SegmentStream(docs, 2, 32, boundary)
    doc_ids = list(range(len(docs)))
    leaked_before = 0
    while (batch := stream.next_batch()) is not None:
        qdocs, qpos = batch_provenance(batch, stream.row_doc, stream.row_offset, doc_ids)
        # oracle for the query positions: the target at (r, t) is sequence[lo + t + 1] of its document
        seqs = [[boundary, *docs[d]] for d in qdocs.tolist()]
        assert [s[p] for s, p in zip(seqs, qpos.tolist())] == batch.targets[batch.mask].tolist()
        with torch.no_grad():
            key = pre.model(batch.inputs, None).knn_key[batch.mask]  # (Q, C)
        nb = search_keys(store, key, 8, None)
        kept = leakage_filter(store, qdocs, qpos, window)(nb)
        prov = store.provenance(nb.ids)
        for q in range(nb.ids.shape[0]):
            for j in range(nb.ids.shape[1]):
                leak = (nb.ids[q, j] >= 0 and prov.docs[q, j] == qdocs[q]
                        and abs(int(prov.positions[q, j]) - int(qpos[q])) <= window)
                leaked_before += int(leak)
                if leak:
                    assert kept.ids[q, j] == -1 and kept.values[q, j] == -1 and kept.distances[q, j] == np.inf
                else:
                    assert kept.ids[q, j] == nb.ids[q, j] and kept.values[q, j] == nb.values[q, j]
    assert leaked_before > 0  # the own-document neighbours were there to drop


def test_a_resumed_spalm_run_equals_an_uninterrupted_one(built):
    from memlm.jobs.spalm_train import train_spalm
    from memlm.jobs.train import TrainConfig
    from memlm.model.memory_config import MemoryConfig

    tmp, corpus, store_dir = built
    store = Datastore.open(store_dir)
    memory = MemoryConfig(kind="spalm", segment=16, mem_len=16, sink_tokens=2)

    def config(out):
        return TrainConfig(model="tiny", init="pretrained", memory=memory, batch_size=2, steps=3, lr=0.05,
                           warmup_steps=1, out_dir=str(out), data=str(corpus), train_split="year<2000",
                           eval_split="year>=2000", datastore=str(store_dir), spalm_k=4, log_every=0)

    whole = train_spalm(config(tmp / "whole"), store, log=lambda _line: None)
    assert [e["step"] for e in whole.evals] == [3] and "gate_mean" in whole.evals[0]
    train_spalm(config(tmp / "part"), store, stop_at=1, log=lambda _line: None)
    train_spalm(config(tmp / "rest"), store, resume_from=tmp / "part", log=lambda _line: None)
    a, b = load_spalm_head(tmp / "whole")[0], load_spalm_head(tmp / "rest")[0]
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    wa, wb = (load_checkpoint(tmp / d).model.lm_head.weight for d in ("whole", "rest"))
    assert torch.equal(wa, wb) and not torch.equal(wa, load_pretrained("tiny").model.lm_head.weight)


def first_step_size(before: torch.Tensor, after: torch.Tensor) -> float:
    """The largest change of one parameter tensor: AdamW's first step moves every entry with a gradient by
    lr * g / (|g| + eps) ~ lr (plus lr * decay * value where decayed), so it reads the group's lr."""
    return float((after.detach().float() - before.detach().float()).abs().max())


@pytest.mark.parametrize("head_lr", [None, 0.05])
def test_head_lr_sets_the_gates_step_and_leaves_ws(built, head_lr):
    from memlm.jobs.spalm_train import train_spalm
    from memlm.jobs.train import TrainConfig
    from memlm.model.memory_config import MemoryConfig
    from memlm.memory.spalm import SpalmHead

    tmp, corpus, store_dir = built
    memory = MemoryConfig(kind="spalm", segment=16, mem_len=16, sink_tokens=2)
    cfg = TrainConfig(model="tiny", init="pretrained", memory=memory, batch_size=2, steps=1, lr=1e-3, warmup_steps=0,
                      data=str(corpus), train_split="year<2000", datastore=str(store_dir), spalm_k=4, log_every=0,
                      head_lr=head_lr, out_dir=str(tmp / f"head-lr-{head_lr}"))
    lines: list[str] = []
    result = train_spalm(cfg, Datastore.open(store_dir), log=lines.append)
    head = load_spalm_head(tmp / f"head-lr-{head_lr}")[0]
    fresh = SpalmHead(head.n_embd)
    want = head_lr if head_lr is not None else cfg.lr
    assert first_step_size(fresh.bias, head.bias) == pytest.approx(want, rel=1e-3)  # undecayed: exactly lr
    assert first_step_size(fresh.w_g, head.w_g) == pytest.approx(want, rel=1e-3)
    w0 = load_pretrained("tiny").model.lm_head.weight
    assert first_step_size(w0, result.model.lm_head.weight) == pytest.approx(cfg.lr, rel=0.05)  # W stays on --lr
    assert any(f"head lr {want:.3g}" in line for line in lines)
    extra = json.loads((tmp / f"head-lr-{head_lr}" / "extra.json").read_text())
    assert extra["train_config"]["head_lr"] == head_lr  # recorded with the checkpoint


def test_head_lr_also_drives_the_memorizing_gate_and_nothing_else():
    from tiny_models import phrase_documents

    from memlm.jobs.memorizing import fresh_knn_attention
    from memlm.jobs.train import TrainConfig, train
    from memlm.model.memory_config import MemoryConfig

    memory = MemoryConfig("memorizing", mem_len=8, sink_tokens=0, segment=16, knn_mem_size=48, knn_top_k=4,
                          knn_backend="exact")
    # Two steps at a constant rate: the first segment's kNN memory is empty, so the gate's gradient is 0
    # there and the second step is the same for both runs up to the gate's learning rate.
    results = {head_lr: train(TrainConfig(model="tiny", init="pretrained", memory=memory, batch_size=2, steps=2,
                                          lr=1e-3, min_lr=1e-3, warmup_steps=0, log_every=0, device="cpu",
                                          knn_train="top", head_lr=head_lr), phrase_documents(2, 80),
                              log=lambda _line: None)
               for head_lr in (None, 0.05)}
    fresh = fresh_knn_attention(results[None].model).state_dict()
    default, fast = (results[h].knn_attention.state_dict() for h in (None, 0.05))
    for name in fresh:  # Adam's step is linear in its learning rate: 50 times as far
        ratio = first_step_size(fresh[name], fast[name]) / first_step_size(fresh[name], default[name])
        assert ratio == pytest.approx(0.05 / 1e-3, rel=1e-3), name
    base = load_pretrained("tiny").model.state_dict()
    blocks = {h: results[h].model.state_dict() for h in results}
    assert any(not torch.equal(base[n], blocks[None][n]) for n in base)  # the top blocks trained...
    assert all(torch.equal(blocks[None][n], blocks[0.05][n]) for n in base)  # ...on --lr, bit for bit


def test_head_lr_is_refused_where_no_gate_trains(capsys, built):
    from memlm.errors import MemlmError
    from memlm.jobs.train import TrainConfig

    with pytest.raises(MemlmError, match="--head-lr .* applies to --memory spalm or memorizing, not xl"):
        TrainConfig(model="tiny", head_lr=0.01)
    tmp, corpus, store = built
    code, _, err = run(capsys, *train_args(corpus, store, tmp / "neg", "--head-lr", "0"))
    assert code == 1 and "--head-lr (> 0" in err and err.count("\n") == 1, err


def test_spalm_train_top_trains_what_lies_after_the_key_and_the_keys_stay(capsys, built):
    tmp, corpus, store = built
    out = tmp / "top"
    code, _, err = run(capsys, *train_args(corpus, store, out, "--spalm-train-top", "1", "--freeze-embeddings"))
    assert code == 0, err
    assert "trained blocks norm layers.1.mlp" in err  # tiny: 2 layers, the key is layer 1's feed-forward input
    base, trained = load_pretrained("tiny").model, load_checkpoint(out).model
    before, after = base.state_dict(), trained.state_dict()
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved == {"norm.weight", *(n for n in before if n.startswith("layers.1.mlp."))}
    idx = torch.tensor([list(range(5, 37))])  # (1, 32)
    with torch.no_grad():  # the query keys are still the datastore's model's, bit for bit
        assert torch.equal(base(idx, None).knn_key, trained(idx, None).knn_key)
        assert not torch.equal(base(idx, None).logits, trained(idx, None).logits)
    assert json.loads((out / "extra.json").read_text())["train_config"]["spalm_train_top"] == 1

    code, _, err = run(capsys, *train_args(corpus, store, tmp / "top2", "--spalm-train-top", "2"))
    assert code == 1 and "--spalm-train-top 2 would change the datastore's keys (ffn_input.1): at most 1" in err, err
    assert err.count("\n") == 1


def spalm_run(built, split, store=None):
    """A SpalmRun over the built datastore (or `store`) started on `split` of the corpus; its log lines."""
    from memlm.data.documents import load_documents, tokenize_documents
    from memlm.jobs.spalm_train import SpalmRun
    from memlm.jobs.train import TrainConfig
    from memlm.model.memory_config import MemoryConfig

    _tmp, corpus, store_dir = built
    cfg = TrainConfig(model="tiny", init="pretrained", memory=MemoryConfig(kind="spalm", segment=16, mem_len=16),
                      batch_size=2, steps=1, data=str(corpus), train_split=split, datastore=str(store_dir), spalm_k=4)
    lines: list[str] = []
    run = SpalmRun(cfg, None, lines.append, store or Datastore.open(store_dir))
    run._start(list(tokenize_documents(load_documents(str(corpus), split), run.tokenizer)))
    return run, lines


def test_the_guard_goes_by_document_identity_not_the_split_expression(built):
    from memlm.data.documents import corpus_fingerprint
    from memlm.retrieval.leakage import copy_level

    _tmp, corpus, store_dir = built
    store = Datastore.open(store_dir)
    # The same ten speeches, written as another split: the corpus fingerprint differs, the documents do not.
    assert corpus_fingerprint(str(corpus), "[0:10]") != store.info().corpus_fingerprint
    run, lines = spalm_run(built, "[0:10]")
    assert run.guarded and "leakage guard on (window 64): 10 of 10 training documents in the datastore" in lines[-1]
    years = [r.meta["year"] for r in store.documents()]
    assert [years[d[0]] for d in run.doc_ids] == list(range(1990, 2000))  # each speech found as itself
    # Two speeches the datastore does not hold: -1, nothing of theirs is masked; the rest still guarded.
    run, lines = spalm_run(built, "year<2002")
    assert copy_level(run.doc_ids, 0) == [*range(10), -1, -1] and "10 of 12" in lines[-1]
    run, lines = spalm_run(built, "year>=2000")
    assert not run.guarded and "leakage guard off: 0 of 2" in lines[-1]


def test_a_datastore_without_the_documents_table_falls_back_to_the_corpus_fingerprint(built):
    from memlm.errors import MemlmError

    class OlderFormat:
        """The datastore as a format-3 one answers: no documents table."""

        def __init__(self, store):
            self.store, self.values = store, store.values

        def search(self, xq, k, options=None):
            return self.store.search(xq, k, options)

        def info(self):
            return self.store.info()

        def provenance(self, ids):
            return self.store.provenance(ids)

        def documents(self):
            raise MemlmError("datastore x has format version 3, which predates the documents table")

    store = OlderFormat(Datastore.open(built[2]))
    run, lines = spalm_run(built, "year<2000", store)
    assert run.guarded and run.doc_ids == [[i] for i in range(10)] and "by corpus fingerprint" in lines[-1]
    run, lines = spalm_run(built, "[0:10]", store)  # without a documents table, another split expression turns it off
    assert not run.guarded and "leakage guard off: by corpus fingerprint" in lines[-1]
