"""TLS, mutual TLS and the bearer-token check accept and refuse as they should.

Certificates come from conftest's `pki` fixture (made with `cryptography`, never read from disk).
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tiny_models import logprobs_close

from memlm.jobs.scoring import score_tokens
from memlm.model.tokenizer import document_boundary
from memlm.retrieval.knnlm import KNNLMConfig
from services.lm.client import KnnRequest, LanguageModelClient
from services.lm.server import create_lm_server
from services.retrieval.client import RetrievalClient
from services.retrieval.server import create_retrieval_server
from services.router.server import ShardLinks, create_router_server
from services.common.security import ClientTls, ServerTls
from services.common.server import ServerOptions, ServiceError


def search_ok(client: RetrievalClient, searcher) -> None:
    xq = np.random.default_rng(0).standard_normal((3, searcher.dim)).astype(np.float32)  # (Q, d)
    np.testing.assert_array_equal(client.search(xq, 4).ids, searcher.search(xq, 4).ids)


def refused(client: RetrievalClient) -> grpc.StatusCode:
    """The status of a GetInfo call that must fail (GetInfo needs the token and the handshake)."""
    with pytest.raises(ServiceError) as info:
        client.info()
    return info.value.code


def test_tls_accepts_trusting_clients_and_refuses_others(loop_thread, searcher, pki):
    tls = ServerTls(certificate_chain=pki["server"][0], private_key=pki["server"][1])
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", searcher, options=ServerOptions(tls=tls))
    address = f"localhost:{port}"
    with RetrievalClient(address, tls=ClientTls(root_ca=pki["ca"])) as ok:
        search_ok(ok, searcher)
    with RetrievalClient(f"127.0.0.1:{port}", tls=ClientTls(root_ca=pki["ca"])) as by_ip:  # IP SAN
        search_ok(by_ip, searcher)
    with RetrievalClient(address, tls=ClientTls(root_ca=pki["other_ca"]), timeout=3) as wrong_ca:
        assert refused(wrong_ca) == grpc.StatusCode.UNAVAILABLE
    with RetrievalClient(address, timeout=3) as plaintext:
        assert refused(plaintext) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate_from_the_ca(loop_thread, searcher, pki):
    tls = ServerTls(certificate_chain=pki["server"][0], private_key=pki["server"][1], client_ca=pki["ca"])
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", searcher, options=ServerOptions(tls=tls))
    address = f"localhost:{port}"
    client_tls = ClientTls(root_ca=pki["ca"], certificate_chain=pki["client"][0], private_key=pki["client"][1])
    with RetrievalClient(address, tls=client_tls) as ok:
        search_ok(ok, searcher)
    for bad in (
        ClientTls(root_ca=pki["ca"]),  # no client certificate
        ClientTls(root_ca=pki["ca"], certificate_chain=pki["stranger"][0], private_key=pki["stranger"][1]),
    ):
        with RetrievalClient(address, tls=bad, timeout=3) as client:
            assert refused(client) == grpc.StatusCode.UNAVAILABLE


def test_bearer_token_is_required_except_for_health_checks(loop_thread, searcher):
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", searcher, options=ServerOptions(token="s3cret"))
    address = f"127.0.0.1:{port}"
    with RetrievalClient(address, token="s3cret") as ok:
        search_ok(ok, searcher)
    for token in (None, "wrong", "s3cret-but-longer", "s3cre"):
        with RetrievalClient(address, token=token) as client:
            assert refused(client) == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        # The wrong scheme is refused too.
        stub_call = channel.unary_unary("/memlm.v1.RetrievalService/GetInfo")
        with pytest.raises(grpc.RpcError) as info:
            stub_call(b"", timeout=10, metadata=(("authorization", "Basic s3cret"),))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_router_with_tls_and_tokens_on_both_sides(loop_thread, searcher, pki):
    tls = ServerTls(certificate_chain=pki["server"][0], private_key=pki["server"][1])
    shard = loop_thread.start(create_retrieval_server, "127.0.0.1:0", searcher,
                              options=ServerOptions(tls=tls, token="shard-token"))
    router = loop_thread.start(
        create_router_server, "127.0.0.1:0", [f"localhost:{shard}"],
        shards=ShardLinks(tls=ClientTls(root_ca=pki["ca"]), token="shard-token"),
        options=ServerOptions(tls=tls, token="router-token"),
    )
    with RetrievalClient(f"localhost:{router}", tls=ClientTls(root_ca=pki["ca"]), token="router-token") as ok:
        search_ok(ok, searcher)
    with RetrievalClient(f"localhost:{router}", tls=ClientTls(root_ca=pki["ca"]), token="shard-token") as wrong:
        assert refused(wrong) == grpc.StatusCode.UNAUTHENTICATED


# ---------------------------------------------------------------------------------------------
# The LM server: TLS and a token on its own port, and on its link to a retrieval server


def test_lm_server_with_tls_and_token_over_a_tls_and_token_retrieval_link(loop_thread, pki, tiny, index, docs):
    pretrained, searcher = tiny, index  # conftest: the tiny model and an exact searcher over its keys
    tls = ServerTls(certificate_chain=pki["server"][0], private_key=pki["server"][1])
    trust = ClientTls(root_ca=pki["ca"])
    knn = KNNLMConfig(k=8, lmbda=0.5, temperature=5.0)
    retrieval = loop_thread.start(create_retrieval_server, "127.0.0.1:0", searcher,
                                   options=ServerOptions(tls=tls, token="ret-token"))
    link = RetrievalClient(f"localhost:{retrieval}", tls=trust, token="ret-token")
    lm = loop_thread.start(create_lm_server, "127.0.0.1:0", pretrained, link, knn_defaults=knn,
                           options=ServerOptions(tls=tls, token="lm-token"))
    address = f"localhost:{lm}"
    try:
        with LanguageModelClient(address, tls=trust, token="lm-token") as ok:
            remote = ok.score(docs, knn=KnnRequest())  # the datastore's window (48, 24)
        # kNN-LM through both TLS + token hops equals the in-process computation, token for token.
        local = score_tokens(pretrained.model, docs, context=48, stride=24,
                             boundary_token=document_boundary(pretrained.tokenizer), searcher=searcher, knn=knn)
        for r, s in zip(remote, local):  # Score runs on the engine: float32 rounding of its cache layout only
            assert logprobs_close([t.logprob for t in r.tokens], s.logprob)
            assert [t.logprob for t in r.tokens] != [t.base_logprob for t in r.tokens]  # kNN-LM changed them
        for token, detail in ((None, "missing bearer token"), ("ret-token", "wrong bearer token")):
            with LanguageModelClient(address, tls=trust, token=token) as bad, pytest.raises(ServiceError) as e:
                bad.score(["hi"])
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED and e.value.details.startswith(detail)
        with LanguageModelClient(address, token="lm-token", timeout=3) as plaintext, pytest.raises(ServiceError) as e:
            plaintext.score(["hi"])
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        link.close()


@pytest.mark.parametrize("token, detail", [(None, "missing bearer token"), ("lm-token", "wrong bearer token")])
def test_lm_server_refuses_to_start_on_a_retrieval_link_without_the_right_token(loop_thread, pki, tiny, index,
                                                                                   token, detail):
    pretrained, searcher = tiny, index
    tls = ServerTls(certificate_chain=pki["server"][0], private_key=pki["server"][1])
    retrieval = loop_thread.start(create_retrieval_server, "127.0.0.1:0", searcher,
                                   options=ServerOptions(tls=tls, token="ret-token"))
    with RetrievalClient(f"localhost:{retrieval}", tls=ClientTls(root_ca=pki["ca"]), token=token) as link:
        with pytest.raises(ServiceError) as e:
            loop_thread.run(create_lm_server("127.0.0.1:0", pretrained, link))
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED and e.value.details.startswith(detail)
    assert f"localhost:{retrieval}" in str(e.value)  # the message names the retrieval server
