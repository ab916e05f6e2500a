"""A real on-disk Datastore (IVF with nprobe; IVF-PQ with exact re-rank) behind a real retrieval server on
port 0: the remote searcher answers every SearchOptions exactly as the in-process Datastore does, and
GetInfo carries every SearcherInfo field.

Shape legend: N datastore entries, d key dimension, Q queries, k neighbours.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from datastore import BuildSettings, BuildSource, Datastore, build_from_tokens
from memlm.jobs.windows import WindowConfig
from memlm.model.config import ModelConfig
from memlm.model.decoder import build_model
from memlm.retrieval.searcher import SearchOptions
from services.retrieval.client import RetrievalClient
from services.retrieval.server import create_retrieval_server

VOCAB = 64
PROVENANCE = BuildSource(
    model_name="tiny-test", model_fingerprint="m" * 64, tokenizer_fingerprint="t" * 64,
    corpus="random tokens", corpus_fingerprint="c" * 64, boundary_token=1,
)
OPTIONS = [
    None,
    SearchOptions(nprobe=1),
    SearchOptions(nprobe=16),
    SearchOptions(exact_rerank=True),
    SearchOptions(nprobe=2, exact_rerank=True),
]


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, Datastore]:
    """Two datastores of the same random documents: IVF16,Flat (nprobe 4) and IVF8,PQ8x4 (nprobe 2)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_name("tiny", vocab_size=VOCAB)).eval()
    rng = np.random.default_rng(0)
    docs = [rng.integers(2, VOCAB, size=n).tolist() for n in (400, 90, 700, 260)]
    out = {}
    for factory, nprobe in (("IVF16,Flat", 4), ("IVF8,PQ8x4", 2)):
        settings = BuildSettings(window=WindowConfig(48, 24, 4), index_factory=factory, nprobe=nprobe)
        directory = tmp_path_factory.mktemp("ds") / factory.replace(",", "_")
        build_from_tokens(model, docs, directory, PROVENANCE, settings, progress=False, log=lambda m: None)
        out[factory] = Datastore.open(directory)
    return out


def queries(ds: Datastore, n: int, seed: int) -> np.ndarray:
    """Stored keys perturbed a little: queries near the data, not on it."""
    rng = np.random.default_rng(seed)
    base = np.asarray(ds.keys[rng.choice(len(ds), size=n, replace=False)], dtype=np.float32)  # (Q, d)
    return base + rng.normal(scale=0.05, size=base.shape).astype(np.float32)


@pytest.mark.parametrize("factory", ["IVF16,Flat", "IVF8,PQ8x4"])
def test_remote_datastore_answers_every_option_like_the_local_one(loop_thread, stores, factory):
    ds = stores[factory]
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", ds)
    xq = queries(ds, 40, seed=1)
    with RetrievalClient(f"127.0.0.1:{port}") as client:
        assert client.info() == ds.info()  # every field, through GetInfo
        remote = {o: client.search(xq, 10, o) for o in OPTIONS}
    for options, nb in remote.items():
        local = ds.search(xq, 10, options)
        for name, a, b in zip(("distances", "ids", "values"), nb, local):
            assert a.dtype == b.dtype, name
            np.testing.assert_array_equal(a, b, err_msg=f"{name} with {options}")
    # The options really reach the index: fewer probed lists find other neighbours ...
    assert not np.array_equal(remote[SearchOptions(nprobe=1)].ids, remote[SearchOptions(nprobe=16)].ids)
    # ... and re-ranking replaces approximate distances with exact ones from the float16 keys.
    reranked = remote[SearchOptions(exact_rerank=True)]
    keys = np.asarray(ds.keys, dtype=np.float64)  # (N, d)
    exact = ((xq[:, None, :].astype(np.float64) - keys[reranked.ids]) ** 2).sum(-1)  # (Q, k)
    np.testing.assert_allclose(reranked.distances, exact, rtol=1e-4, atol=1e-3)
    if factory.endswith("PQ8x4"):  # PQ distances are lossy; re-ranked ones are not
        assert np.abs(remote[None].distances - reranked.distances).max() > 1e-2
