"""Generations: how a finished datastore changes (add, remove, compact) so that a crash at any moment
leaves either the old datastore or the new one, never a mix.

A change never writes a file the committed manifest names. It writes generation g + 1's files under new
names (manifest.generation_file: "keys.g000003.f16"), keeps its scratch in `.generation/` (with
plan.json, what it is doing, from which generation), and commits by renaming one new manifest.json over
the old one (memlm.files.atomic_write): before the rename every reader sees generation g, after it g + 1.
Running the same command again after a kill resumes from its files; another change first discards the
unfinished one (its files of the uncommitted generation are deleted; the committed one is untouched).
After a commit, files of generations older than the previous one are deleted: a reader that read the
previous manifest just before the commit can still open it, and one that has it open keeps its mapped
files (POSIX keeps an unlinked file until its last reader closes it), which is what lets a live retrieval
server answer from the old generation until it has loaded the new one (services/retrieval/server.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from datastore.manifest import (
    DOCUMENTS_VERSION,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    file_generation,
    generation_file,
)
from memlm.errors import MemlmError
from memlm.files import PARTIAL_SUFFIX, atomic_write, sha256_file

WORK_DIR = ".generation"
"""Scratch of a change in progress (removed when its manifest is committed)."""
PLAN_NAME = "plan.json"
LOCK_NAME = ".generation.lock"
"""Held (flock) by the one change running: two at once would both write generation g + 1."""


@contextlib.contextmanager
def exclusive(directory: Path) -> Iterator[None]:
    """Hold the datastore's change lock for the block, or refuse at once when another change holds it.
    The kernel drops a flock with its process, so a killed change never leaves the datastore locked."""
    with open(Path(directory) / LOCK_NAME, "a") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MemlmError(f"another add, remove or compact of {directory} is running; run this one when it "
                             "has finished") from None
        yield  # the lock goes with the file's closing


def begin(directory: Path, op: str, plan: dict, reads: tuple[str, ...], log: Callable[[str], None]
          ) -> tuple[Manifest, Path]:
    """Start (or resume) change `op` of the datastore in `directory`; returns its committed manifest and the
    scratch folder. The plan (op, its arguments, the base generation) decides whether earlier scratch is
    this change's, to resume, or another's, to discard. The committed files of the roles in `reads` (what
    the change copies into the next generation) are checked against their checksums first: a damaged file
    must not pass into a generation with fresh checksums. Call it inside `exclusive(directory)`."""
    directory = Path(directory)
    m = Manifest.read(directory)
    if m.format_version < DOCUMENTS_VERSION:
        raise MemlmError(f"datastore {directory} has format version {m.format_version}, which predates "
                         f"generations (format {DOCUMENTS_VERSION}); rebuild it with this memlm to {op} documents")
    for role in reads:
        path, entry = directory / m.file_name(role), m.files[role]
        if not path.is_file() or path.stat().st_size != entry.bytes or sha256_file(path, remember=False) != entry.sha256:
            raise MemlmError(f"{path} is missing or fails its size or checksum (manifest.json); the datastore is "
                             f"damaged, rebuild it (nothing was changed)")
    work = directory / WORK_DIR
    want = {"op": op, "base_generation": m.generation, **plan}
    path = work / PLAN_NAME
    if path.is_file():
        try:
            before = json.loads(path.read_text())
        except json.JSONDecodeError:
            before = {}
        if before == want:
            log(f"resuming the unfinished {op} of generation {m.generation + 1}")
            return m, work
        what = before.get("op", "change") if before.get("base_generation") == m.generation else "change"
        log(f"discarding an unfinished {what} of {directory} (never committed; generation {m.generation} stays)")
    shutil.rmtree(work, ignore_errors=True)
    remove_uncommitted(directory, m)
    work.mkdir()
    atomic_write(path, json.dumps(want, sort_keys=True), durable=True)
    return m, work


def remove_uncommitted(directory: Path, m: Manifest) -> None:
    """Delete data files of generations after the committed one (left by a change that never committed)."""
    for p in Path(directory).iterdir():
        g = file_generation(p.name.removesuffix(PARTIAL_SUFFIX))
        if g is not None and (g > m.generation or p.name.endswith(PARTIAL_SUFFIX)):
            p.unlink()


def next_file(m: Manifest, role: str) -> str:
    """The name generation m.generation + 1 writes `role` under."""
    return generation_file(role, m.generation + 1)


def named_files(directory: Path, m: Manifest, written: dict[str, str]) -> dict[str, FileEntry]:
    """The next manifest's file entries: those of `m`, and for each role in `written` (role -> file name)
    the new file's size and SHA-256 (read now, never from a cache)."""
    files = {role: FileEntry(e.bytes, e.sha256, m.file_name(role)) for role, e in m.files.items()}
    for role, name in written.items():
        path = Path(directory) / name
        files[role] = FileEntry(path.stat().st_size, sha256_file(path, remember=False), name)
    return files


def commit(directory: Path, old: Manifest, new: Manifest, log: Callable[[str], None], *,
           keep_previous: bool = True) -> None:
    """Publish `new` (generation old + 1) by one atomic rename, then drop the scratch and every data file
    that neither `new` nor (keep_previous) `old` names. Compaction passes keep_previous=False: the removed
    keys must be gone from disk when it returns (a reader that has the old files open keeps them)."""
    directory = Path(directory)
    if new.generation != old.generation + 1:
        raise RuntimeError(f"generation {new.generation} does not follow {old.generation}")
    for role in new.files:
        if not (directory / new.file_name(role)).is_file():
            raise RuntimeError(f"generation {new.generation} names {new.file_name(role)}, which is not there")
    atomic_write(directory / MANIFEST_NAME, new.to_json(), durable=True)
    shutil.rmtree(directory / WORK_DIR, ignore_errors=True)
    keep = {new.file_name(r) for r in new.files} | ({old.file_name(r) for r in old.files} if keep_previous else set())
    for p in directory.iterdir():
        if file_generation(p.name.removesuffix(PARTIAL_SUFFIX)) is not None and p.name not in keep:
            p.unlink()
    log(f"datastore {directory}: generation {new.generation} committed ({new.n:,} entries, "
        f"{new.documents:,} documents)")
