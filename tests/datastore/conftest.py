"""Shared fixtures: a tiny random model, random token documents, and a small finished datastore (the pieces
themselves live in store_helpers.py, which tests import by name)."""

from __future__ import annotations

from pathlib import Path

import pytest
from store_helpers import PROVENANCE, WINDOW, make_docs, make_model

from datastore import BuildSettings, build_from_tokens


@pytest.fixture(scope="session")
def tiny_model():
    return make_model()


@pytest.fixture(scope="session")
def docs():
    return make_docs()


@pytest.fixture(scope="session")
def built(tmp_path_factory, tiny_model, docs) -> Path:
    """A finished datastore of `docs` (1483 keys) with an IVF index whose probes skip most lists."""
    out = tmp_path_factory.mktemp("ds") / "store"
    settings = BuildSettings(window=WINDOW, index_factory="IVF16,Flat", nprobe=4, shard_batches=2)
    return build_from_tokens(tiny_model, docs, out, PROVENANCE, settings, progress=False, log=lambda m: None)
