"""Sizes in bytes as operators write them on the command line: `512M`, `4G`, `1.5G`, `65536`.

The one parser of byte flags (`--max-memory-session-bytes`, `--max-memory-total-bytes`, `--max-kv-bytes`):
a number with an optional binary suffix K, M, G or T (powers of 1024, also written KiB / KB, case
ignored), and its inverse for messages.
"""

from __future__ import annotations

import argparse
import re

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """`text` as a whole number of bytes >= 1 (`512M` = 512 * 2**20); ValueError naming the accepted form."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ValueError(f"{text!r} is not a size: give bytes, or a number with K, M, G or T (powers of 1024), "
                         "e.g. 512M or 4G")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 1:
        raise ValueError(f"{text!r} is under one byte")
    return n


def byte_size(text: str) -> int:
    """parse_bytes as an argparse `type` (a bad value is a usage error naming it)."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def format_bytes(n: int) -> str:
    """n bytes the way parse_bytes reads them back where exact (`4G`), else with two decimals (`1.50G`)."""
    for suffix in ("T", "G", "M", "K"):
        unit = _UNITS[suffix.lower()]
        if n >= unit:
            return f"{n // unit}{suffix}" if n % unit == 0 else f"{n / unit:.2f}{suffix}"
    return f"{n}"
