"""Command-line options of a client link (a client, or a server's link to another service): TLS CA,
client certificate for mutual TLS, bearer token (flag, file or environment). Shared by `memlm client`,
`serve lm --retrieval`, `serve router --shard` and `memlm eval --knn-service`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from memlm.errors import MemlmError


def secret(args: argparse.Namespace, prefix: str, env: str) -> str | None:
    """The bearer token of `--{prefix}token`, `--{prefix}token-file` or $env (in that order; None = no token).

    A file or the environment keeps the secret out of `ps`. An empty value is an
    error, never "no authentication": leave all three unset for that.
    """
    from services.common.security import check_token

    dest = prefix.replace("-", "_")
    value, path = getattr(args, f"{dest}token"), getattr(args, f"{dest}token_file")
    if value is not None and path is not None:
        raise MemlmError(f"give --{prefix}token or --{prefix}token-file, not both")
    if value is not None:
        where = f"--{prefix}token"
    elif path is not None:
        where, value = f"--{prefix}token-file {path}", Path(path).read_text().strip()  # a trailing newline is no part of it
    elif env in os.environ:
        where, value = f"${env}", os.environ[env]
    else:
        return None
    try:
        return check_token(value)
    except ValueError as e:
        raise MemlmError(f"{where}: {e}") from None


def link_tls(args: argparse.Namespace, prefix: str) -> Any:
    """ClientTls from a link's flags (add_link_security): its CA and, for mutual TLS, a client certificate
    and key; None = plaintext."""
    from services.common.security import ClientTls

    dest = prefix.replace("-", "_")
    ca, cert, key = (getattr(args, f"{dest}{name}") for name in ("ca" if prefix else "tls_ca", "tls_cert", "tls_key"))
    if (cert is None) != (key is None):
        raise MemlmError(f"--{prefix}tls-cert and --{prefix}tls-key go together")
    if ca is None and cert is None:
        return None
    return ClientTls.from_files(root_ca=ca, cert=cert, key=key)


def add_token_options(p: argparse.ArgumentParser, prefix: str, what: str, env: str) -> None:
    """--{prefix}token and --{prefix}token-file (read by `secret`)."""
    p.add_argument(f"--{prefix}token", default=None,
                   help=f"bearer token {what} (visible in `ps`: prefer --{prefix}token-file or ${env})")
    p.add_argument(f"--{prefix}token-file", default=None, metavar="PATH",
                   help=f"file holding the bearer token {what} (default ${env}; never empty)")


def add_link_security(p: argparse.ArgumentParser, prefix: str, what: str, env: str) -> None:
    """How a client reaches `what`: its CA, a client certificate for mutual TLS, its token (read by
    link_tls and secret). prefix "": the client's own flags (--tls-ca, --tls-cert, --token, ...)."""
    p.add_argument("--tls-ca" if not prefix else f"--{prefix}ca", default=None, help=f"CA (PEM) of a TLS {what}")
    p.add_argument(f"--{prefix}tls-cert", default=None, help=f"client certificate (PEM) for a {what} that wants one (mTLS)")
    p.add_argument(f"--{prefix}tls-key", default=None, help=f"private key (PEM) of --{prefix}tls-cert")
    add_token_options(p, prefix, f"the {what} wants", env)
