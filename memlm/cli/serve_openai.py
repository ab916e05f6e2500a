"""`memlm serve openai`: the OpenAI-compatible HTTP front (services.openai_front.server), its options and
their translation into the front's typed settings (FrontLimits, HttpOptions, the LM link's ClientTls)."""

from __future__ import annotations

import argparse
from typing import Any

from memlm.cli.link_options import add_link_security, add_token_options, link_tls, secret
from memlm.cli.metrics_options import add_metrics_options, metrics_options
from memlm.cli.options import flag, port_number, positive_int
from memlm.errors import MemlmError

LM_LINK, LM_LINK_ENV = "lm-", "MEMLM_LM_TOKEN"
"""Prefix of the LM link's flags (--lm-ca, --lm-tls-cert, --lm-tls-key, --lm-token-file) and its token's variable."""


def _seconds(text: str, zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 <= value < float("inf") or value == 0 and not zero:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds {'>=' if zero else '>'} 0, got {text}")
    return value


def seconds(text: str) -> float:
    """A finite number of seconds > 0 (a timeout of 0 would refuse every request)."""
    return _seconds(text, zero=False)


def grace(text: str) -> float:
    """--grace: a finite number of seconds >= 0 (0: cancel in-flight requests at once)."""
    return _seconds(text, zero=True)


def cmd_serve_openai(args: argparse.Namespace) -> None:
    from pathlib import Path

    from services.openai_front.server import FrontLimits, FrontTls, HttpOptions, serve_openai

    if bool(args.tls_cert) != bool(args.tls_key):
        raise MemlmError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise MemlmError("--tls-client-ca needs --tls-cert and --tls-key")
    tls = None
    if args.tls_cert:
        tls = FrontTls(Path(args.tls_cert), Path(args.tls_key), Path(args.tls_client_ca) if args.tls_client_ca else None)
    http = HttpOptions(tls=tls, max_connections=args.max_connections, header_timeout_s=args.header_timeout,
                       body_timeout_s=args.body_timeout, keep_alive_timeout_s=args.keep_alive_timeout,
                       max_header_bytes=args.max_header_bytes, grace_s=args.grace)
    limits = FrontLimits(max_body_bytes=args.max_body_bytes, max_prompts=args.max_prompts, max_tokens=args.max_tokens)
    from memlm.cli.commands import auth_file_from  # imported here: commands imports this module

    auth_file = auth_file_from(args)
    serve_openai(args.lm, host=args.host, port=args.port,
                 token=secret(args, "", "MEMLM_TOKEN") if auth_file is None else None, auth_file=auth_file,
                 model_name=args.model_name, limits=limits, timeout=args.timeout, http=http,
                 lm_tls=link_tls(args, LM_LINK), lm_token=secret(args, LM_LINK, LM_LINK_ENV),
                 metrics=metrics_options(args))


def add_openai_parser(ssub: Any) -> None:
    from services.openai_front.server import FrontLimits, HttpOptions  # the one home of the front's defaults

    o = ssub.add_parser("openai", help="OpenAI-compatible HTTP front (/v1/completions, /v1/models, /health) "
                        "over `memlm serve lm`")
    o.add_argument("--lm", required=True, help="HOST:PORT of `memlm serve lm`")
    o.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    o.add_argument("--port", type=port_number, default=0, help="port (0: any free port; the chosen one is printed)")
    o.add_argument("--tls-cert", default=None, help="certificate chain (PEM) to serve HTTPS")
    o.add_argument("--tls-key", default=None, help="private key (PEM) of --tls-cert")
    o.add_argument("--tls-client-ca", default=None, help="CA (PEM) that callers' certificates must chain to (mTLS)")
    add_token_options(o, "", "callers must send (also sent on to the LM server when the link has none of its own)",
                      "MEMLM_TOKEN")
    o.add_argument("--auth-file", default=None, metavar="PATH",
                   help="TOML file of [[tenant]] tables (name, token_sha256, rpcs) instead of one token; re-read on "
                        "SIGHUP; the LM server is then reached with --lm-token-file only")
    add_link_security(o, LM_LINK, "LM server", LM_LINK_ENV)
    o.add_argument("--model-name", default=None, help="model id to serve (default: the LM server's model name)")
    o.add_argument("--timeout", type=float, default=300.0, help="seconds one LM call (a whole stream) may take")
    for name, what in (("max_body_bytes", "largest request body, checked on Content-Length before it is read "
                        "and on the bytes as they arrive (413 beyond)"),
                       ("max_prompts", "prompts per request"), ("max_tokens", "largest max_tokens")):
        o.add_argument(flag(name), type=positive_int, default=getattr(FrontLimits, name), help=what)
    o.add_argument("--max-connections", type=positive_int, default=HttpOptions.max_connections,
                   help="open connections served at once; a request on one more is answered 503")
    o.add_argument("--max-header-bytes", type=positive_int, default=HttpOptions.max_header_bytes,
                   help="largest request line and headers (400 beyond)")
    for name, what in (("header_timeout", "seconds a connection has to send a request's headers, from its opening "
                        "or its last response (then it is closed)"),
                       ("body_timeout", "seconds a request has to send its body after its headers (408 beyond)"),
                       ("keep_alive_timeout", "seconds an idle keep-alive connection stays open")):
        o.add_argument(flag(name), type=seconds, default=getattr(HttpOptions, f"{name}_s"), metavar="SECONDS",
                       help=what)
    o.add_argument("--grace", type=grace, default=HttpOptions.grace_s, metavar="SECONDS",
                   help="on SIGTERM/SIGINT: refuse new requests, let in-flight ones finish for this long, then cancel them")
    add_metrics_options(o)
    o.set_defaults(func=cmd_serve_openai)
