"""The builder against its oracle (score_documents, the evaluation loop) and its refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from store_helpers import PROVENANCE, WINDOW

from datastore import (
    BuildSettings,
    Datastore,
    Manifest,
    build_from_tokens,
    datastore_info,
)
from datastore.build import WORK_DIR
from datastore.generations import exclusive
from memlm.errors import MemlmError
from memlm.jobs.windows import score_documents

QUIET = dict(progress=False, log=lambda m: None)


def test_keys_and_values_are_what_evaluation_computes(built, tiny_model, docs):
    ds = Datastore.open(built)
    chunks = list(score_documents(tiny_model, docs, WINDOW, PROVENANCE.boundary_token, with_logprobs=False))
    keys = torch.cat([c.keys for c in chunks]).to(torch.float16).numpy()  # (N, d)
    values = torch.cat([c.targets for c in chunks]).numpy()  # (N,)
    assert len(ds) == sum(map(len, docs)) == keys.shape[0]
    np.testing.assert_array_equal(np.asarray(ds.keys), keys)
    np.testing.assert_array_equal(np.asarray(ds.values), values)
    assert ds.values.dtype == np.int32 and ds.keys.dtype == np.float16
    assert not (built / WORK_DIR).exists()


def test_manifest_describes_the_datastore(built, tiny_model):
    m = Manifest.read(built)
    assert (m.n, m.dim, m.key_dtype, m.value_dtype) == (1483, tiny_model.config.n_embd, "float16", "int32")
    assert m.key_layer == tiny_model.config.key_description
    assert (m.model_fingerprint, m.tokenizer_fingerprint, m.corpus_fingerprint) == (
        PROVENANCE.model_fingerprint, PROVENANCE.tokenizer_fingerprint, PROVENANCE.corpus_fingerprint)
    assert (m.index_factory, m.metric, m.nprobe, m.context, m.stride) == ("IVF16,Flat", "l2", 4, 48, 24)
    assert set(m.files) == {"keys.f16", "values.i32", "docs.i32", "positions.i32", "index.faiss", "documents.jsonl"}
    assert m.files["keys.f16"].bytes == 1483 * m.dim * 2
    assert m.files["docs.i32"].bytes == m.files["positions.i32"].bytes == 1483 * 4
    assert (m.format_version, m.documents, m.has_provenance, m.generation) == (4, 6, True, 0)  # the empty document counts
    assert Manifest.from_json(m.to_json()) == m
    text = datastore_info(built)
    assert "1,483 keys" in text and "IVF16,Flat" in text
    assert "provenance    1,483 entries from 6 documents" in text and "format        version 4, generation 0" in text
    assert "documents     6 documents, 1,483 tokens; no metadata" in text


def test_shard_size_does_not_change_the_keys(tmp_path, tiny_model, docs, built):
    # Shards are whole forward batches, so how the work is cut into shards never changes a float.
    out = build_from_tokens(tiny_model, docs, tmp_path / "s", PROVENANCE,
                            BuildSettings(window=WINDOW, index_factory="Flat", shard_batches=5), **QUIET)
    assert (out / "keys.f16").read_bytes() == (built / "keys.f16").read_bytes()
    for name in ("values.i32", "docs.i32", "positions.i32"):
        assert (out / name).read_bytes() == (built / name).read_bytes(), name


def test_finished_datastore_is_not_overwritten(tmp_path, tiny_model, docs):
    settings = BuildSettings(window=WINDOW, index_factory="Flat")
    out = build_from_tokens(tiny_model, docs[:2], tmp_path / "d", PROVENANCE, settings, **QUIET)
    before = (out / "manifest.json").read_bytes()
    with pytest.raises(MemlmError, match="--overwrite"):
        build_from_tokens(tiny_model, docs[3:], out, PROVENANCE, settings, **QUIET)
    assert (out / "manifest.json").read_bytes() == before
    build_from_tokens(tiny_model, docs[3:], out, PROVENANCE, settings, overwrite=True, **QUIET)
    assert Manifest.read(out).n == sum(map(len, docs[3:]))


def test_overwrite_waits_for_no_change_in_progress(tmp_path, tiny_model, docs):
    settings = BuildSettings(window=WINDOW, index_factory="Flat")
    out = build_from_tokens(tiny_model, docs[:2], tmp_path / "d", PROVENANCE, settings, **QUIET)
    with exclusive(out):
        pass
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}  # the lock file included
    with exclusive(out):  # an add, remove or compact holds the change lock
        with pytest.raises(MemlmError, match="another add, remove or compact"):
            build_from_tokens(tiny_model, docs[3:], out, PROVENANCE, settings, overwrite=True, **QUIET)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # nothing deleted
    build_from_tokens(tiny_model, docs[3:], out, PROVENANCE, settings, overwrite=True, **QUIET)
    assert Manifest.read(out).n == sum(map(len, docs[3:]))


def test_unfinished_build_with_other_settings_is_refused(tmp_path, tiny_model, docs):
    out = tmp_path / "d"
    (out / WORK_DIR).mkdir(parents=True)
    settings = BuildSettings(window=WINDOW, index_factory="Flat")
    identity = {"provenance": {}, "settings": {}, "key_layer": "x", "dim": 1, "model_dtype": "x", "device": "cpu"}
    (out / WORK_DIR / "build.json").write_text(json.dumps(identity))
    with pytest.raises(MemlmError, match="unfinished build with other settings"):
        build_from_tokens(tiny_model, docs, out, PROVENANCE, settings, **QUIET)


def test_directory_with_foreign_files_is_refused(tmp_path, tiny_model, docs):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(MemlmError, match="not a memlm datastore"):
        build_from_tokens(tiny_model, docs, tmp_path, PROVENANCE, BuildSettings(window=WINDOW), overwrite=True,
                          **QUIET)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_max_tokens_cuts_the_corpus(tmp_path, tiny_model, docs):
    settings = BuildSettings(window=WINDOW, index_factory="Flat", max_tokens=450)
    out = build_from_tokens(tiny_model, lambda: iter(docs), tmp_path / "d", PROVENANCE, settings, **QUIET)
    ds = Datastore.open(out)
    assert len(ds) == 450
    np.testing.assert_array_equal(np.asarray(ds.values[:400]), docs[0])  # every token is a target (BOS first)
    np.testing.assert_array_equal(np.asarray(ds.values[400:450]), docs[1][:50])
