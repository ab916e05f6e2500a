"""The memlm command line: the only part of memlm that imports `datastore` or `services`."""

import sys

from memlm.cli.threads import set_wait_policy

set_wait_policy(sys.argv[1:])  # before the imports below load torch's and FAISS's OpenMP runtimes

from memlm.cli.commands import build_parser, main  # noqa: E402

__all__ = ["build_parser", "main"]
