"""Authentication under load and misuse: callers without the token cannot lock token holders out, readiness answers
under full load, and authentication cannot be switched off by accident (empty tokens, tokens in `ps`,
exposed plaintext binds, mTLS on every client).

Real servers on port 0; `memlm serve lm` runs as a real process where its argv or its stderr is checked.
Every wait is bounded by a deadline.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from memlm.cli import commands as cli
from services.lm.client import KnnRequest, LanguageModelClient
from services.lm.server import create_lm_server
from services.retrieval.client import RetrievalClient
from services.retrieval.server import create_retrieval_server
from services.common.security import ClientTls, ServerTls
from services.common.server import ServerOptions, ServiceError

SERVING = health_pb2.HealthCheckResponse.SERVING
ROOT = Path(__file__).resolve().parents[2]


def health_check(address: str, timeout: float = 10) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status


# ---------------------------------------------------------------------------------------------
# Finding 3: separate budgets


@contextlib.contextmanager
def held_watch_streams(address: str, n: int):
    """Open n health Watch streams without a token and hold them; yields (admitted, refused) once every
    stream has its first answer (SERVING: open on the server; RESOURCE_EXHAUSTED: refused)."""
    channel = grpc.insecure_channel(address)
    watches = [health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
               for _ in range(n)]
    try:
        admitted, refused = 0, 0
        for watch in watches:
            try:
                assert next(watch).status == SERVING
                admitted += 1
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
                refused += 1
        yield admitted, refused
    finally:
        for watch in watches:
            watch.cancel()
        channel.close()


def test_64_unauthenticated_watch_streams_do_not_lock_out_a_token_holder(loop_thread, searcher):
    options = ServerOptions(token="s3cret")  # max_concurrent_rpcs 64, max_open_rpcs 16: the defaults
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", searcher, options=options)
    address = f"127.0.0.1:{port}"
    with held_watch_streams(address, 64) as (admitted, refused):
        # The streams cost the token holder nothing: GetInfo and Search succeed, readiness answers.
        xq = np.random.default_rng(1).standard_normal((3, searcher.dim)).astype(np.float32)  # (Q, d)
        with RetrievalClient(address, token="s3cret", timeout=10) as client:
            assert client.info().n == len(searcher.keys)
            np.testing.assert_array_equal(client.search(xq, 4).ids, searcher.search(xq, 4).ids)
        assert health_check(address) == SERVING
        # The open budget bounds the streams: 16 held, the rest refused.
        assert (admitted, refused) == (options.max_open_rpcs, 64 - options.max_open_rpcs)
        # A caller without the token is still told UNAUTHENTICATED: the full Watch budget is not its budget.
        with RetrievalClient(address, timeout=10) as stranger, pytest.raises(ServiceError) as e:
            stranger.info()
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_the_lm_server_serves_its_token_holder_past_64_watch_streams(loop_thread, tiny):
    # The reproduction: `serve lm --token`, 64 Watch streams, then GetInfo with the right token.
    port = loop_thread.start(create_lm_server, "127.0.0.1:0", tiny, options=ServerOptions(token="lm-token"))
    address = f"127.0.0.1:{port}"
    with held_watch_streams(address, 64), LanguageModelClient(address, token="lm-token", timeout=10) as client:
        assert client.info().model_fingerprint == tiny.fingerprint
        assert len(client.score(["hello there"])[0].tokens) > 0
        assert health_check(address) == SERVING


def get_info_status(channel: grpc.Channel, token: str) -> grpc.StatusCode:
    """The status of one raw GetInfo call (the client caches GetInfo, so it is called by hand here)."""
    call = channel.unary_unary("/memlm.v1.RetrievalService/GetInfo")
    try:
        call(b"", timeout=10, metadata=(("authorization", f"Bearer {token}"),))
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def test_health_check_answers_while_every_authenticated_slot_is_busy(loop_thread, searcher, gated_searcher):
    gated = gated_searcher
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", gated,
                             options=ServerOptions(max_concurrent_rpcs=2, token="t0ken"))
    address = f"127.0.0.1:{port}"
    xq = np.random.default_rng(0).standard_normal((2, searcher.dim)).astype(np.float32)  # (Q, d)
    clients = [RetrievalClient(address, token="t0ken", timeout=30) for _ in range(2)]
    for c in clients:
        c.info()  # connected (and max_queries known) before the gate closes
    out: list = []
    threads = [threading.Thread(target=lambda c=c: out.append(c.search(xq, 4))) for c in clients]
    channel = grpc.insecure_channel(address)
    try:
        for t in threads:
            t.start()
        assert gated.entered.wait(10)
        # Both searches hold a slot once a third call is refused; the second may still be on its way.
        deadline = time.monotonic() + 10
        while get_info_status(channel, "t0ken") == grpc.StatusCode.OK and time.monotonic() < deadline:
            time.sleep(0.01)
        assert get_info_status(channel, "t0ken") == grpc.StatusCode.RESOURCE_EXHAUSTED  # every slot is busy
        assert health_check(address) == SERVING  # and readiness still answers
    finally:
        gated.release.set()
        for t in threads:
            t.join(30)
        for c in clients:
            c.close()
        channel.close()
    assert len(out) == 2  # the busy calls finished normally
    np.testing.assert_array_equal(out[0].ids, searcher.search(xq, 4).ids)


# ---------------------------------------------------------------------------------------------
# Finding 4: authentication cannot be switched off by accident


@pytest.mark.parametrize("argv, env, line", [
    (["--token", ""], {}, "memlm: error: --token: the token is empty; leave it unset for no authentication"),
    ([], {"MEMLM_TOKEN": ""}, "memlm: error: $MEMLM_TOKEN: the token is empty; leave it unset for no authentication"),
    (["--token-file", "EMPTY"], {}, "memlm: error: --token-file EMPTY: the token is empty; leave it unset for no "
                                    "authentication"),
    (["--token", "a", "--token-file", "EMPTY"], {}, "memlm: error: give --token or --token-file, not both"),
    (["--shard-token", ""], {}, "memlm: error: --shard-token: the token is empty; leave it unset for no authentication"),
])
def test_an_empty_token_is_refused_in_one_line(argv, env, line, tmp_path, monkeypatch, capsys):
    (tmp_path / "EMPTY").write_text("\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MEMLM_TOKEN", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # Refused before anything is bound or dialled (the shard address is never reached).
    assert cli.main(["serve", "router", "--shard", "127.0.0.1:9", *argv]) == 1
    assert capsys.readouterr().err.splitlines() == [line]
    with pytest.raises(ValueError, match="empty"):
        ServerOptions(token="")  # the library refuses it too, on both ends
    with pytest.raises(ValueError, match="empty"):
        LanguageModelClient("127.0.0.1:9", token="")


def test_exposure_warning_names_what_is_missing(pki):
    tls = ServerTls(certificate_chain=pki["server"][0], private_key=pki["server"][1])
    mtls = ServerTls(certificate_chain=pki["server"][0], private_key=pki["server"][1], client_ca=pki["ca"])
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert ServerOptions().exposure_warning(host) is None  # loopback: nobody else can reach it
    both = ServerOptions().exposure_warning("0.0.0.0")
    assert "TLS" in both and "authentication" in both and "\n" not in both
    assert ServerOptions().exposure_warning("::") == both.replace("0.0.0.0", "::")
    assert "authentication" not in ServerOptions(token="t").exposure_warning("10.0.0.5")
    assert "TLS" not in ServerOptions(tls=tls).exposure_warning("myhost.example")
    assert ServerOptions(tls=tls, token="t").exposure_warning("0.0.0.0") is None
    assert ServerOptions(tls=mtls).exposure_warning("0.0.0.0") is None  # client certificates authenticate


class ServeProcess:
    """`memlm serve ...` as a real process: started, read until `listening on`, stopped with SIGTERM."""

    def __init__(self, argv: list[str], env: dict[str, str], deadline_s: float = 60) -> None:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("MEMLM_") or k == "MEMLM_CACHE"}
        self.proc = subprocess.Popen([sys.executable, "-m", "memlm.cli", "serve", *argv], cwd=ROOT,
                                     env={**clean, "PYTHONPATH": str(ROOT), **env}, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.port = self._port(deadline_s)

    def _port(self, deadline_s: float) -> int:
        deadline = time.monotonic() + deadline_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    line = self.proc.stdout.readline()
                    if line.startswith("listening on "):
                        self.startup_stderr = self._stderr_so_far()
                        return int(line.rsplit(":", 1)[1])
                    if not line:  # exited
                        break
        self.stop()
        raise AssertionError(f"server did not start: {self.stderr}")

    def _stderr_so_far(self) -> str:
        """What the process wrote to stderr up to now (it flushes before `listening on`), without blocking."""
        fd = self.proc.stderr.fileno()
        os.set_blocking(fd, False)
        chunks = []
        try:
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
        except BlockingIOError:
            pass
        return b"".join(chunks).decode()

    def argv(self) -> bytes:
        return Path(f"/proc/{self.proc.pid}/cmdline").read_bytes()

    def stop(self) -> None:
        if self.proc.returncode is not None:
            return
        self.proc.terminate()
        try:
            _, self.stderr = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, self.stderr = self.proc.communicate(timeout=30)


def mtls_server(pki) -> ServerTls:
    """Server credentials that require a client certificate from the test CA."""
    return ServerTls(certificate_chain=pki["server"][0], private_key=pki["server"][1], client_ca=pki["ca"])


def pem_files(pki, tmp_path: Path) -> dict[str, str]:
    files = {"ca": pki["ca"], "cert": pki["client"][0], "key": pki["client"][1]}
    for name, data in files.items():
        (tmp_path / f"{name}.pem").write_bytes(data)
    return {name: str(tmp_path / f"{name}.pem") for name in files}


@pytest.fixture(scope="module")
def router_process(module_loop, searcher, pki, tmp_path_factory):
    """`memlm serve router` on 0.0.0.0 (plaintext) with its token from a file, over one shard that wants
    a client certificate and a token (also from a file): the process, the shard's address."""
    tmp = tmp_path_factory.mktemp("router")
    files = pem_files(pki, tmp)
    (tmp / "router.token").write_text("router-s3cret-7f9a\n")
    (tmp / "shard.token").write_text("shard-s3cret-1c2d\n")
    shard = module_loop.start(create_retrieval_server, "127.0.0.1:0", searcher,
                              options=ServerOptions(tls=mtls_server(pki), token="shard-s3cret-1c2d"))
    process = ServeProcess(
        ["router", "--shard", f"localhost:{shard}", "--host", "0.0.0.0",
         "--token-file", str(tmp / "router.token"), "--shard-token-file", str(tmp / "shard.token"),
         "--shard-ca", files["ca"], "--shard-tls-cert", files["cert"], "--shard-tls-key", files["key"]],
        env={})
    yield process, shard
    process.stop()


def test_token_file_works_and_the_token_is_not_in_argv(router_process, searcher):
    process, _ = router_process
    assert b"s3cret" not in process.argv() and b"router.token" in process.argv()
    address = f"127.0.0.1:{process.port}"
    xq = np.random.default_rng(2).standard_normal((3, searcher.dim)).astype(np.float32)  # (Q, d)
    with RetrievalClient(address, token="router-s3cret-7f9a", timeout=10) as client:
        # Through the router's mTLS + token shard link, the shard's exact answer.
        np.testing.assert_array_equal(client.search(xq, 4).ids, searcher.search(xq, 4).ids)
    for token in (None, "router-s3cret-7f9ax"):
        with RetrievalClient(address, token=token, timeout=10) as stranger, pytest.raises(ServiceError) as e:
            stranger.info()
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_plaintext_bind_on_every_interface_prints_one_warning(router_process):
    process, _ = router_process
    warnings = [line for line in process.startup_stderr.splitlines() if "warning" in line]
    assert warnings == ["memlm: warning: serving on 0.0.0.0 without TLS (--tls-cert/--tls-key): anyone who can "
                        "reach it can use it"]


# ---------------------------------------------------------------------------------------------
# Finding 4: mutual TLS end to end: `memlm client` and `serve lm`'s retrieval link present certificates


def test_memlm_client_presents_a_client_certificate(loop_thread, tiny, pki, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MEMLM_TOKEN", raising=False)
    port = loop_thread.start(create_lm_server, "127.0.0.1:0", tiny, options=ServerOptions(tls=mtls_server(pki)))
    files = pem_files(pki, tmp_path)
    call = ["client", "score", "--address", f"localhost:{port}", "--timeout", "10", "--tls-ca", files["ca"]]
    assert cli.main([*call, "--tls-cert", files["cert"], "--tls-key", files["key"], "hello there"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 2 and rows[1].split()[0] == "0" and int(rows[1].split()[1]) > 0  # one scored text
    # Without the certificate the handshake fails: one line, exit 1.
    assert cli.main([*call, "hello there"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"memlm: error: localhost:{port}: UNAVAILABLE")


def test_serve_lm_reaches_an_mtls_retrieval_server_with_its_certificate(loop_thread, tiny, index, pki, tmp_path):
    retrieval = loop_thread.start(create_retrieval_server, "127.0.0.1:0", index,
                                  options=ServerOptions(tls=mtls_server(pki)))
    files = pem_files(pki, tmp_path)
    # The retrieval server refuses a client without a certificate ...
    with RetrievalClient(f"localhost:{retrieval}", tls=ClientTls(root_ca=pki["ca"]), timeout=5) as bare, \
            pytest.raises(ServiceError) as e:
        bare.info()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    # ... and serves `memlm serve lm --retrieval-tls-cert/--retrieval-tls-key` (a real process).
    process = ServeProcess(["lm", "--model", "tiny", "--device", "cpu", "--retrieval", f"localhost:{retrieval}",
                            "--retrieval-ca", files["ca"], "--retrieval-tls-cert", files["cert"],
                            "--retrieval-tls-key", files["key"], "--k", "8", "--lambda", "0.5"], env={})
    try:
        with LanguageModelClient(f"127.0.0.1:{process.port}", timeout=30) as client:
            [knn] = client.score(["the lazy dog and the quick fox"], knn=KnnRequest())
        assert len(knn.tokens) > 0
        assert [t.logprob for t in knn.tokens] != [t.base_logprob for t in knn.tokens]  # the datastore was searched
    finally:
        process.stop()


@pytest.mark.parametrize("flag", ["--max-concurrent-rpcs", "--max-open-rpcs"])
def test_a_call_budget_below_one_is_refused_in_one_line(flag, capsys):
    assert cli.main(["serve", "router", "--shard", "127.0.0.1:9", flag, "0"]) == 1
    assert capsys.readouterr().err.splitlines() == [f"memlm: error: {flag} must be at least 1, got 0"]


def test_serve_lm_without_a_client_certificate_is_refused_by_an_mtls_retrieval_server(loop_thread, index, pki,
                                                                                        tmp_path):
    retrieval = loop_thread.start(create_retrieval_server, "127.0.0.1:0", index,
                                  options=ServerOptions(tls=mtls_server(pki)))
    files = pem_files(pki, tmp_path)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MEMLM_") or k == "MEMLM_CACHE"}
    done = subprocess.run(
        [sys.executable, "-m", "memlm.cli", "serve", "lm", "--model", "tiny", "--device", "cpu",
         "--retrieval", f"localhost:{retrieval}", "--retrieval-ca", files["ca"]],
        cwd=ROOT, env={**clean, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "listening on" not in done.stdout
    errors = [line for line in done.stderr.splitlines() if line.startswith("memlm: error:")]
    assert len(errors) == 1 and f"localhost:{retrieval}" in errors[0], done.stderr
