"""SPALM training (memlm.jobs.spalm_train, issue 11): a step changes the head and W only (the head only with
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
    from memlm.memory.config import MemoryConfig

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
