"""The memlm command line: the only part of memlm that imports `datastore` or `services`."""

from memlm.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
