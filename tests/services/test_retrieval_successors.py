"""The retrieval service's Successors rpc: ids -> successors and their values, as the
in-process table answers; RetoMaton's pointer evaluation through a real retrieval server on port 0 equals
the in-process one (both without keys: pointers carry their predecessor's distance); bad ids and a server
without successors get a status naming why; a walk through a live datastore that commits a new generation is
ABORTED, not led to other documents' rows (services.retrieval.walk.OneGeneration)."""

from __future__ import annotations

import shutil
import time

import grpc
import numpy as np
import pytest
import torch
from tiny_models import repeated_phrase_documents

from datastore import BuildSettings, BuildSource, Datastore, build_from_tokens
from datastore.add import add_documents
from datastore.live import LiveDatastore
from memlm.jobs.knnlm_eval import Retrieval, evaluate_knnlm
from memlm.jobs.windows import WindowConfig
from memlm.model.config import ModelConfig
from memlm.model.decoder import build_model
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.pointers import PointerConfig, PointerSource
from memlm.v1 import retrieval_pb2, retrieval_pb2_grpc
from services.retrieval.client import RetrievalClient
from services.retrieval.server import GenerationWatch, create_retrieval_server
from services.retrieval.successors import successors_by_generation, table_of
from services.retrieval.walk import OneGeneration
from services.common.server import ServiceError
from services.common.tensors import to_tensor

V, BOS = 40, 1
WINDOW = WindowConfig(context=32, stride=16, batch_size=4)
SOURCE = BuildSource(model_name="tiny-test", model_fingerprint="m" * 64, tokenizer_fingerprint="t" * 64,
                     corpus="phrases", corpus_fingerprint="c" * 64, boundary_token=BOS)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(ModelConfig.from_name("tiny", vocab_size=V)).eval()


@pytest.fixture(scope="module")
def docs():
    """Documents with repeated phrases, so that pointers survive for several steps."""
    return repeated_phrase_documents(V)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, model, docs):
    out = build_from_tokens(model, docs[:3], tmp_path_factory.mktemp("succ") / "ds", SOURCE,
                            BuildSettings(window=WINDOW, index_factory="Flat"), progress=False, log=lambda m: None)
    return out


@pytest.fixture(scope="module")
def store(store_dir):
    return Datastore.open(store_dir)


def serve(loop_thread, store, with_successors=True) -> str:
    successors = successors_by_generation(lambda: (store, 0)) if with_successors else None
    return f"127.0.0.1:{loop_thread.start(create_retrieval_server, '127.0.0.1:0', store, successors=successors)}"


def test_successors_rpc_answers_as_the_in_process_table(loop_thread, store):
    table = table_of(store)
    ids = np.random.default_rng(0).integers(0, len(store), size=500)  # (M,)
    with RetrievalClient(serve(loop_thread, store), max_message_bytes=8192) as client:  # several calls
        got_next, got_values, generation = client.successors_generation(ids)
    want_next, want_values = table.successors_of(ids)
    assert np.array_equal(got_next, want_next) and np.array_equal(got_values, want_values) and generation == 0
    assert got_next.dtype == np.int64 and got_values.dtype == np.int32
    assert (want_next < 0).sum() > 0 and (want_values[want_next >= 0] >= 0).all()  # ends of documents, values


def test_pointer_evaluation_through_the_service_equals_in_process(loop_thread, store, model, docs):
    knn = KNNLMConfig(k=8, lmbda=0.4, temperature=3.0)
    config = PointerConfig(min_pointers=2, stream_tokens=16)
    local = PointerSource(table_of(store), None)  # carried distances: what a remote walk can know
    here = evaluate_knnlm(model, docs[1:], store, WINDOW, knn, BOS, progress=False, retrieval=Retrieval(config, local))
    with RetrievalClient(serve(loop_thread, store)) as client:
        walk = OneGeneration(client, client)  # the walk's searches and lookups, one generation
        there = evaluate_knnlm(model, docs[1:], walk, WINDOW, knn, BOS, progress=False,
                               retrieval=Retrieval(config, PointerSource(walk, None)))
    assert there["knnlm_nll"] == here["knnlm_nll"] and there["searches"] == here["searches"]
    assert 0 < here["searches_saved"] < here["tokens"] and here["pointer_distances"] == "carried"


def test_bad_ids_and_a_server_without_successors_are_refused(loop_thread, store):
    address = serve(loop_thread, store)
    with grpc.insecure_channel(address) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        for ids, code, field in ((np.array([0, len(store)]), grpc.StatusCode.INVALID_ARGUMENT, "ids.data"),
                                 (np.array([-1]), grpc.StatusCode.INVALID_ARGUMENT, "ids.data"),
                                 (np.zeros(0, np.int64), grpc.StatusCode.INVALID_ARGUMENT, "ids.shape[0]"),
                                 (np.array([0], np.int32), grpc.StatusCode.INVALID_ARGUMENT, "ids")):
            with pytest.raises(grpc.RpcError) as e:
                stub.Successors(retrieval_pb2.SuccessorsRequest(ids=to_tensor(ids)), timeout=10)
            assert e.value.code() == code and e.value.details().startswith(field), e.value.details()
    with RetrievalClient(serve(loop_thread, store, with_successors=False)) as client:
        with pytest.raises(ServiceError) as e:
            client.successors_generation(np.array([0]))
        assert e.value.code == grpc.StatusCode.UNIMPLEMENTED


def test_a_walk_across_a_new_generation_is_aborted(loop_thread, store_dir, store, model, docs, tmp_path):
    """Ids of generation 0 looked up after `memlm datastore add` committed generation 1: the
    lookup is answered from generation 1 (SuccessorsResponse.generation), and the walk that searched in 0
    is ABORTED instead of following rows of another generation; a fresh walk then runs in 1."""
    directory = shutil.copytree(store_dir, tmp_path / "live")
    live = LiveDatastore(directory, log=lambda m: None)
    watch = GenerationWatch(live.refresh, live.served, poll_s=0.05)
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", live, watch=watch,
                             successors=successors_by_generation(live.served))
    with RetrievalClient(f"127.0.0.1:{port}") as client:
        walk = OneGeneration(client, client)
        found = walk.search(np.asarray(store.keys[:6], dtype=np.float32), 4)  # (6, 4) rows of generation 0
        ids = found.ids.reshape(-1)  # (24,)
        assert np.array_equal(walk.successors_of(ids)[0], table_of(store).successors_of(ids)[0])
        add_documents(model, docs[3:], directory, SOURCE, progress=False, log=lambda m: None)
        deadline = time.monotonic() + 30
        while client.generation() != 1:
            assert time.monotonic() < deadline, "the server never served generation 1"
            time.sleep(0.02)
        assert client.successors_generation(ids)[2] == 1  # what the walk would have followed
        with pytest.raises(ServiceError) as e:
            walk.successors_of(ids)
        assert e.value.code == grpc.StatusCode.ABORTED and "0 -> 1" in str(e.value)
        fresh = OneGeneration(client, client)
        fresh.successors_of(fresh.search(np.asarray(store.keys[:6], dtype=np.float32), 4).ids.reshape(-1))
        assert fresh.generation == 1
        # An empty first search is answered locally (generation 0): it must not hold a walk of generation 1 to 0.
        empty_first = OneGeneration(client, client)
        empty_first.search(np.empty((0, store.keys.shape[1]), np.float32), 4)
        query = np.asarray(store.keys[:6], dtype=np.float32)
        empty_first.successors_of(empty_first.search(query, 4).ids.reshape(-1))
        assert empty_first.generation == 1
