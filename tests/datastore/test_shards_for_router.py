"""`memlm datastore build --shards N`: N datastores whose concatenation is the unsharded datastore."""

from __future__ import annotations

import json

import numpy as np
import pytest

from datastore import Datastore, SourceDocument, build_datastore
from datastore.commands import shard_dir, split_documents
from memlm.errors import MemlmError


def test_split_documents_is_contiguous_and_balanced():
    docs = [SourceDocument([1] * n, f"f{i}", {}) for i, n in enumerate((50, 10, 300, 40, 40, 60, 200, 100))]
    groups = split_documents(docs, 3)
    assert [d for g in groups for d in g] == docs  # contiguous, in order, nothing lost
    sizes = [sum(len(d.ids) for d in g) for g in groups]
    assert max(sizes) - min(sizes) <= 300  # documents stay whole: balance is up to one document


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    rows = [{"text": f"Document {i}. " + "words and more words " * (3 + i % 5)} for i in range(9)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def build(corpus, out, shards):
    return build_datastore("tiny", str(corpus), out, index="Flat", context=32, stride=16, batch_size=1,
                           device="cpu", dtype="float32", progress=False, num_shards=shards)


def test_shards_concatenate_to_the_unsharded_datastore(corpus, tmp_path):
    whole = Datastore.open(build(corpus, tmp_path / "whole", 1))
    out = build(corpus, tmp_path / "sharded", 3)
    shards = [Datastore.open(shard_dir(out, i, 3)) for i in range(3)]
    assert sum(len(s) for s in shards) == len(whole)
    # batch_size 1: every window runs alone, so the keys do not depend on which shard holds it
    np.testing.assert_array_equal(np.concatenate([np.asarray(s.values) for s in shards]), np.asarray(whole.values))
    np.testing.assert_array_equal(np.concatenate([np.asarray(s.keys) for s in shards]), np.asarray(whole.keys))
    assert len({s.manifest.corpus_fingerprint for s in shards}) == 3
    assert len({s.manifest.model_fingerprint for s in shards} | {whole.manifest.model_fingerprint}) == 1
    with pytest.raises(MemlmError, match="already holds 3 finished shards"):
        build(corpus, tmp_path / "sharded", 3)


def test_too_many_shards_is_refused(corpus, tmp_path):
    with pytest.raises(MemlmError, match="too few documents"):
        build(corpus, tmp_path / "many", 20)
