"""Fixtures for the service tests: a real FAISS Flat searcher, servers on an event loop thread, and LM
servers over the tiny model.

Shape legend: N datastore entries, d key dimension, Q queries, k neighbours.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import ipaddress
import threading

import faiss
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from memlm.jobs.windows import WindowConfig
from memlm.model.tokenizer import document_boundary
from memlm.model.weights import load_pretrained
from memlm.jobs.windows import exact_searcher_over_documents
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.searcher import Neighbors, SearcherInfo, SearchOptions
from services.lm.server import LMLimits, create_lm_server, start_lm_server
from services.retrieval.client import RetrievalClient
from services.retrieval.server import create_retrieval_server

TEST_INFO = SearcherInfo(
    n=0, dim=0, index="Flat", metric="l2", nprobe=1, key_layer="ffn_input.1", model_name="test-model",
    model_fingerprint="model-test", tokenizer_fingerprint="tok-test", corpus="random keys",
    corpus_fingerprint="corpus-test", context=64, stride=32, boundary_token=0, sink_tokens=0,
)
"""What FlatSearcher.info() says besides its own n and dim."""


class FlatSearcher:
    """Exact L2 search over (keys, values) with faiss.IndexFlatL2: the local oracle.

    info_changes: SearcherInfo fields info() reports differently from TEST_INFO (e.g. another model)."""

    def __init__(self, keys: np.ndarray, values: np.ndarray, info_changes: dict | None = None) -> None:
        self.keys = np.ascontiguousarray(keys, dtype=np.float32)  # (N, d)
        self.values = np.asarray(values, dtype=np.int32)  # (N,)
        self.index = faiss.IndexFlatL2(self.keys.shape[1])
        self.index.add(self.keys)
        self.info_changes = dict(info_changes or {})
        self.calls: list[tuple[int, int, SearchOptions | None]] = []  # (Q, k, options) of every search

    @property
    def dim(self) -> int:
        return self.keys.shape[1]

    def info(self) -> SearcherInfo:
        return dataclasses.replace(TEST_INFO, **{"n": len(self.keys), "dim": self.dim, **self.info_changes})

    def search(self, xq: np.ndarray, k: int, options: SearchOptions | None = None) -> Neighbors:
        self.calls.append((len(xq), k, options))
        distances, ids = self.index.search(np.ascontiguousarray(xq, dtype=np.float32), k)  # (Q, k) each
        missing = ids < 0  # FAISS pads with id -1 and FLT_MAX when N < k; Neighbors says +inf
        distances[missing] = np.inf
        values = np.where(missing, -1, self.values[np.maximum(ids, 0)]).astype(np.int32)  # (Q, k)
        return Neighbors(distances, ids, values)


def make_searcher(n: int, d: int, seed: int) -> FlatSearcher:
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n, d)).astype(np.float32)  # (N, d)
    values = rng.integers(0, 50_000, size=n).astype(np.int32)  # (N,)
    return FlatSearcher(keys, values)


class GatedSearcher(FlatSearcher):
    """A FlatSearcher whose searches block until `release` is set; `entered` says one started."""

    def __init__(self, base: FlatSearcher, info_changes: dict | None = None):
        super().__init__(base.keys, base.values, info_changes)
        self.entered = threading.Event()
        self.release = threading.Event()

    def search(self, xq, k, options=None):
        self.entered.set()
        assert self.release.wait(20), "test never released the searcher"
        return super().search(xq, k, options)


class LoopThread:
    """An asyncio loop on a daemon thread, so synchronous clients can call servers in-process."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.servers = []

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self, factory, *args, **kwargs):
        """Run an async `create_*_server(...) -> (server, port)` here; returns the port."""
        server, port = self.run(factory(*args, **kwargs))
        self.servers.append(server)
        return port

    def close(self) -> None:
        for server in self.servers:
            self.run(server.stop(None))
        self.run(asyncio.sleep(0.05))  # let the close-on-stop tasks run
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def module_loop():
    """A LoopThread shared by a module's servers (for module-scoped server fixtures)."""
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def searcher() -> FlatSearcher:
    return make_searcher(3000, 32, seed=0)


@pytest.fixture(name="make_searcher")
def make_searcher_fixture():
    """make_searcher(n, d, seed) -> FlatSearcher over random keys (fixtures, not imports: tests
    work under every pytest import mode)."""
    return make_searcher


@pytest.fixture
def gated_searcher(searcher) -> GatedSearcher:
    return GatedSearcher(searcher)


# ---------------------------------------------------------------------------------------------
# The LM service over the tiny model (test_lm_server.py, test_lm_requests.py, test_security.py)

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Peter Piper picked a peck of pickled peppers.",
]
KNN = KNNLMConfig(k=8, lmbda=0.5, temperature=5.0)
"""The LM servers' kNN-LM defaults (tests read them as servers["knn"])."""
LIMITS = LMLimits(max_score_tokens=400, max_new_tokens=100_000)
"""The limits of the "plain" and "local" servers: prompts under 400 tokens, at most 100_000 new tokens."""


@pytest.fixture(scope="module")
def tiny():
    """The tiny random preset (model, tokenizer, fingerprint)."""
    return load_pretrained("tiny")


@pytest.fixture(scope="module")
def docs(tiny):
    """TEXTS as token ids."""
    return [tiny.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def boundary(tiny) -> int:
    return document_boundary(tiny.tokenizer)


@pytest.fixture(scope="module")
def index(tiny, boundary):
    """An exact searcher over the tiny model's (key, next token) pairs, as a datastore holds them."""
    tok = tiny.tokenizer
    train = [tok.encode(t) for t in TEXTS + ["the lazy dog and the quick fox " * 3]]
    return exact_searcher_over_documents(tiny.model, train, WindowConfig(48, 24, 4), boundary,
                                         model_fingerprint=tiny.fingerprint, tokenizer_fingerprint=tok.fingerprint)


@pytest.fixture(scope="module")
def servers(tiny, index, module_loop):
    """Addresses of: an LM server without datastore ("plain", LIMITS), one with the index in process ("local",
    LIMITS), one over a retrieval server ("remote", default limits); "servicer" (plain's), "loop", "knn"."""
    loop = module_loop

    def start(factory, *args, **kwargs):
        return f"127.0.0.1:{loop.start(factory, *args, **kwargs)}"

    started = loop.run(start_lm_server("127.0.0.1:0", tiny, model_name="tiny", knn_defaults=KNN, limits=LIMITS))
    loop.servers.append(started.running.server)
    plain = f"127.0.0.1:{started.running.port}"
    local = start(create_lm_server, "127.0.0.1:0", tiny, index, knn_defaults=KNN, limits=LIMITS)
    retrieval = start(create_retrieval_server, "127.0.0.1:0", index)
    remote_searcher = RetrievalClient(retrieval)
    remote = start(create_lm_server, "127.0.0.1:0", tiny, remote_searcher, knn_defaults=KNN)
    yield {"plain": plain, "local": local, "remote": remote, "servicer": started.servicer, "loop": loop, "knn": KNN}
    remote_searcher.close()


# ---------------------------------------------------------------------------------------------
# Certificates for the TLS tests (test_security.py, test_auth_faults.py): EC P-256, valid for an hour,
# made here with `cryptography`, never read from disk.

def _pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _cert(subject: str, key, issuer_name, issuer_key, *, ca: bool, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def make_ca(name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _cert(name, key, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), key, ca=True)
    return key, cert


def issue(ca, subject: str, server: bool) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) signed by `ca`."""
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _cert(subject, key, ca_cert.subject, ca_key, ca=False, server=server)
    return cert.public_bytes(serialization.Encoding.PEM), _pem(key)


@pytest.fixture(scope="module")
def pki():
    ca = make_ca("memlm test CA")
    other_ca = make_ca("some other CA")
    server_cert, server_key = issue(ca, "localhost", server=True)
    client_cert, client_key = issue(ca, "memlm client", server=False)
    stranger_cert, stranger_key = issue(other_ca, "stranger", server=False)
    pem = lambda c: c[1].public_bytes(serialization.Encoding.PEM)  # noqa: E731
    return dict(
        ca=pem(ca), other_ca=pem(other_ca), server=(server_cert, server_key),
        client=(client_cert, client_key), stranger=(stranger_cert, stranger_key),
    )
