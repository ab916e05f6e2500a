"""The OpenAI front's HTTP server against misbehaving callers: bad Content-Length, bodies past the limit,
deep nesting, huge integers, wrong types, slow and idle connections, too many connections, TLS and the LM
link's own credentials. Real uvicorn servers on port 0 over a real LM server on the tiny model; raw sockets
where a well-behaved client could not send the request."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.security import ClientTls, ServerTls
from services.common.server import ServerOptions
from services.lm.client import LanguageModelClient
from services.lm.server import create_lm_server, start_lm_server
from services.openai_front.server import Front, FrontLimits, FrontTls, HttpOptions, start_front

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "the quick brown fox"
LIMIT = 1 << 17
"""The strict front's body limit, in bytes."""
WAIT_S = 30
"""Bound on any one read: a server that hangs fails the test instead of stalling it."""


@pytest.fixture(scope="module")
def lm(tiny, module_loop):
    started = module_loop.run(start_lm_server("127.0.0.1:0", tiny, model_name="tiny"))
    module_loop.servers.append(started.running.server)
    client = LanguageModelClient(f"127.0.0.1:{started.running.port}")
    yield client
    client.close()


@pytest.fixture(scope="module")
def strict(lm):
    """A front with a small body limit and short header, body and keep-alive timeouts: its port."""
    options = HttpOptions(header_timeout_s=0.5, body_timeout_s=0.5, keep_alive_timeout_s=0.5)
    with start_front(Front(lm, "tiny", None, FrontLimits(max_body_bytes=LIMIT)), options=options) as running:
        yield running.port


def exchange(port: int, data: bytes, *, sock: socket.socket | None = None) -> tuple[int, dict, bytes]:
    """Send raw bytes, read one HTTP response: (status, lower-case headers, body)."""
    sock = sock or socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    sock.sendall(data)
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()


def post(body: bytes, extra: str = "") -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def openai_error(status: int, headers: dict, body: bytes) -> dict:
    """The error object of an OpenAI-shaped JSON error response (asserting its shape)."""
    assert 400 <= status < 500 and headers["content-type"] == "application/json", (status, headers, body)
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def closed(sock: socket.socket) -> bool:
    """Whether the server closed `sock` without sending anything."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("length", ["-1", "abc", "1, 2", "9" * 5000])
def test_a_malformed_content_length_is_a_json_400(strict, length):
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode()
    status, headers, body = exchange(strict, head + b'{"prompt": "x"}')
    assert status == 400 and openai_error(status, headers, body)["type"] == "invalid_request_error"


def test_headers_past_their_limit_are_a_json_400_before_they_end(strict):
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * (HttpOptions.max_header_bytes + 1)
    status, headers, body = exchange(strict, head)  # the headers never end, yet the answer comes
    assert status == 400 and openai_error(status, headers, body)


def test_a_missing_content_length_is_411_and_a_huge_one_413_before_any_byte_is_read(strict):
    status, headers, body = exchange(strict, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 411 and openai_error(status, headers, body)
    # Only the headers are sent: the answer comes without the petabyte, and the connection ends.
    sock = socket.create_connection(("127.0.0.1", strict), timeout=WAIT_S)
    status, headers, body = exchange(strict, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                     b"Content-Length: 1000000000000000\r\n\r\n", sock=sock)
    assert status == 413 and f"at most {LIMIT}" in openai_error(status, headers, body)["message"]
    assert headers["connection"] == "close" and closed(sock)


def test_a_chunked_body_is_cut_off_at_the_limit(strict):
    sock = socket.create_connection(("127.0.0.1", strict), timeout=WAIT_S)
    chunk = b"x" * (LIMIT // 2 + 1)
    # Two chunks pass the limit; the body never ends (no last chunk), yet the answer comes.
    data = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 2)
    status, headers, body = exchange(strict, data, sock=sock)
    assert status == 413 and openai_error(status, headers, body)
    # Under the limit, a chunked body is read whole and answered.
    small = json.dumps({"prompt": PROMPT, "max_tokens": 2, "temperature": 0}).encode()
    status, _, body = exchange(strict, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                               + b"%x\r\n" % len(small) + small + b"\r\n0\r\n\r\n")
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("body, param, words", [
    (b"[" * 100_000, None, "nests deeper"),  # past the JSON decoder's own recursion limit
    (b'{"prompt": "x", "knn": ' + b"[" * 40 + b"]" * 40 + b"}", None, "nests deeper"),  # within it
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None, "out of range"),
    (b'{"prompt": "x", "seed": 100000000000000000000000000000}', None, "out of range"),
    (b'{"prompt": "x", "seed": -1}', "seed", "must be in"),
    (b'{"prompt": "x", "top_k": 4294967296}', "top_k", "must be in"),
    (b'{"prompt": [1, 2, 1099511627776]}', "prompt", "token ids"),
    (b'{"prompt": "x", "temperature": 1e999}', None, "out of range"),
    (b'{"prompt": "x", "temperature": NaN}', None, "not JSON"),
    (b'{"prompt": "x", "stop": 5}', "stop", "'stop'"),
    (b'{"prompt": "\\ud800"}', "prompt", "surrogate"),
    (b'{"prompt": "x", "model": ["tiny"]}', "model", "'model'"),
    (b'{"prompt": "x", "memory": {"segment_tokens": "many"}}', "segment_tokens", "'segment_tokens'"),
    (b'{"prompt": "x"', None, "not JSON"),
    (b'\xff\xfe{', None, "not JSON"),
    (b"[1, 2]", None, "JSON object"),
])
def test_every_malformed_body_is_a_json_400_naming_what_is_wrong(strict, body, param, words):
    status, headers, data = exchange(strict, post(body))
    error = openai_error(status, headers, data)
    assert status == 400 and error["param"] == param and words in error["message"], error


def test_an_unknown_model_endpoint_or_method_is_a_json_4xx(strict):
    status, headers, body = exchange(strict, post(b'{"prompt": "x", "model": "gpt-4"}'))
    assert status == 404 and openai_error(status, headers, body)["code"] == "model_not_found"
    status, headers, body = exchange(strict, b"GET /v1/chat HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 404 and openai_error(status, headers, body)["code"] == "not_found"
    status, headers, body = exchange(strict, b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 405 and openai_error(status, headers, body)


def test_a_stream_is_server_sent_events_ending_in_done(strict, lm):
    body = json.dumps({"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}).encode()
    status, headers, data = exchange(strict, post(body))
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = data.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-2])
    assert text == "".join(e.text for e in lm.generate(PROMPT, max_new_tokens=6, temperature=0.0) if hasattr(e, "text"))


def test_a_caller_leaving_a_stream_closes_its_generate(strict, monkeypatch):
    import threading

    from services.openai_front import server

    closed_early, chunks = threading.Event(), server.stream_chunks

    def watched(*args):
        try:
            yield from chunks(*args)
        except GeneratorExit:  # closed before its end: the LM client's stream closes too, cancelling the call
            closed_early.set()
            raise

    monkeypatch.setattr(server, "stream_chunks", watched)
    sock = socket.create_connection(("127.0.0.1", strict), timeout=WAIT_S)
    sock.sendall(post(json.dumps({"prompt": PROMPT, "max_tokens": 4000, "stream": True}).encode()))
    assert sock.recv(64).startswith(b"HTTP/1.1 200")
    sock.close()  # long before 4000 tokens
    assert closed_early.wait(WAIT_S)


def test_idle_and_slow_connections_are_closed(strict):
    # A connection that never sends a request, one that trickles its headers, one idle after a response:
    # each is closed by the server, and a body that stops half way is answered 408.
    silent = socket.create_connection(("127.0.0.1", strict), timeout=WAIT_S)
    partial = socket.create_connection(("127.0.0.1", strict), timeout=WAIT_S)
    partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
    kept = socket.create_connection(("127.0.0.1", strict), timeout=WAIT_S)
    status, _, _ = exchange(strict, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", sock=kept)
    assert status == 200
    assert closed(silent) and closed(partial) and closed(kept)
    sock = socket.create_connection(("127.0.0.1", strict), timeout=WAIT_S)
    status, headers, body = exchange(strict, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                     b"Content-Length: 100\r\n\r\n" + b'{"prompt": ', sock=sock)
    assert status == 408 and openai_error(status, headers, body)


def test_past_the_connection_limit_a_request_is_503_not_a_hang(lm):
    options = HttpOptions(max_connections=2, header_timeout_s=60, keep_alive_timeout_s=60)
    with start_front(Front(lm, "tiny", None, FrontLimits()), options=options) as running:
        held = [socket.create_connection(("127.0.0.1", running.port), timeout=WAIT_S) for _ in range(2)]
        for sock in held:  # both connections are served and stay open (keep-alive)
            assert exchange(running.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", sock=sock)[0] == 200
        status, _, _ = exchange(running.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 503
        held.pop().close()
        for _ in range(200):  # the freed place is taken once the server has seen the close
            status, _, _ = exchange(running.port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            if status == 200:
                break
        assert status == 200


def write_pems(tmp_path: Path, **pems: bytes) -> dict[str, Path]:
    for name, data in pems.items():
        (tmp_path / f"{name}.pem").write_bytes(data)
    return {name: tmp_path / f"{name}.pem" for name in pems}


def https(port: int, pki, client: dict[str, Path] | None = None) -> http.client.HTTPSConnection:
    """A connection that trusts the test CA; `client`: the certificate and key files it presents (mTLS)."""
    context = ssl.create_default_context(cadata=pki["ca"].decode())
    if client is not None:
        context.load_cert_chain(client["client_cert"], client["client_key"])
    return http.client.HTTPSConnection("localhost", port, timeout=WAIT_S, context=context)


def test_tls_and_mutual_tls_with_self_signed_certificates(lm, pki, tmp_path):
    files = write_pems(tmp_path, ca=pki["ca"], cert=pki["server"][0], key=pki["server"][1],
                       client_cert=pki["client"][0], client_key=pki["client"][1])
    front = Front(lm, "tiny", None, FrontLimits())
    with start_front(front, options=HttpOptions(tls=FrontTls(files["cert"], files["key"]))) as running:
        conn = https(running.port, pki)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        plain = http.client.HTTPConnection("127.0.0.1", running.port, timeout=WAIT_S)
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):  # no TLS handshake, no answer
            plain.request("GET", "/health")
            plain.getresponse()
    mtls = HttpOptions(tls=FrontTls(files["cert"], files["key"], client_ca=files["ca"]))
    with start_front(front, options=mtls) as running:
        conn = https(running.port, pki, files)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        bare = https(running.port, pki)
        with pytest.raises((ssl.SSLError, http.client.RemoteDisconnected, ConnectionError)):
            bare.request("GET", "/health")
            bare.getresponse()


def test_memlm_serve_openai_over_tls_with_its_own_link_to_a_tls_lm_server(tiny, loop_thread, pki, tmp_path):
    """The flags end to end: the front serves HTTPS and wants its callers' token; it reaches an LM server that
    serves TLS and wants another token, with --lm-ca and --lm-token-file."""
    lm_port = loop_thread.start(create_lm_server, "127.0.0.1:0", tiny, model_name="tiny",
                                options=ServerOptions(tls=ServerTls(pki["server"][0], pki["server"][1]), token="lm-secret"))
    files = write_pems(tmp_path, ca=pki["ca"], cert=pki["server"][0], key=pki["server"][1])
    (tmp_path / "lm.token").write_text("lm-secret\n")
    (tmp_path / "front.token").write_text("front-secret\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MEMLM_") or k == "MEMLM_CACHE"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "memlm", "serve", "openai", "--lm", f"localhost:{lm_port}", "--lm-ca", str(files["ca"]),
         "--lm-token-file", str(tmp_path / "lm.token"), "--token-file", str(tmp_path / "front.token"),
         "--tls-cert", str(files["cert"]), "--tls-key", str(files["key"])],
        cwd=ROOT, env={**clean, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on 127.0.0.1:"), proc.stderr.read() if proc.poll() is not None else line
        port = int(line.strip().rsplit(":", 1)[1])
        body = json.dumps({"prompt": PROMPT, "max_tokens": 5, "temperature": 0})
        for token, want in (("front-secret", 200), ("lm-secret", 401)):  # the link's token is not the callers'
            conn = https(port, pki)
            conn.request("POST", "/v1/completions", body=body, headers={"Authorization": f"Bearer {token}"})
            response = conn.getresponse()
            assert response.status == want and ("error" in json.loads(response.read())) == (want != 200)
        with LanguageModelClient(f"localhost:{lm_port}", tls=ClientTls(root_ca=pki["ca"]), token="lm-secret") as c:
            text = "".join(e.text for e in c.generate(PROMPT, max_new_tokens=5, temperature=0.0) if hasattr(e, "text"))
        conn = https(port, pki)
        conn.request("POST", "/v1/completions", body=body, headers={"Authorization": "Bearer front-secret"})
        data = json.loads(conn.getresponse().read())
        assert data["choices"][0]["text"] == text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("argv, message", [
    (["--tls-cert", "front.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert and --tls-key"),
    (["--lm-tls-cert", "client.pem"], "--lm-tls-cert and --lm-tls-key go together"),
])
def test_tls_flags_that_go_together_are_refused_in_one_line(argv, message, capsys, monkeypatch):
    from memlm.cli import commands as cli

    monkeypatch.delenv("MEMLM_TOKEN", raising=False)
    assert cli.main(["serve", "openai", "--lm", "127.0.0.1:9", *argv]) == 1
    assert capsys.readouterr().err.splitlines() == [f"memlm: error: {message}"]
