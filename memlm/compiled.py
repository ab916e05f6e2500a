"""Small C kernels compiled at first use, where a library's kernel does not fit the job (memlm.model.panel_gemm,
memlm.retrieval.by_id_kernels).

A kernel module hands its C source and compiler flags to `compile_library`, which builds it with the system C
compiler into cache_dir()/kernels/<stem>_<hash of source and flags>.so once (written under a temporary name and
renamed, so concurrent processes are safe; a later process finds it there), and the module's loader opens it. Where
there is no compiler, or the build or the load fails, `load_or_warn` logs why once per kernel module and gives
None: callers keep their library path. The CPU's features are read from /proc/cpuinfo (`cpu_flags`), so that a
vector build is only made for a CPU that runs it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from memlm.files import atomic_path, cache_dir

LINK_FLAGS = ("-shared", "-fPIC", "-std=c99")

RADIX_SORT_C = r"""
/* a[0 .. n) sorted stably by their bits from first_bit up, each key XOR flip first (flip 1 << 63: signed int64
   order): an LSD radix sort, least significant byte first, a byte every key shares skipped; tmp holds n. Needs
   <stdint.h> and <string.h>. */
static void radix_sort_u64(uint64_t *a, uint64_t *tmp, int64_t n, int first_bit, uint64_t flip) {
    uint64_t *from = a, *to = tmp;
    for (int shift = first_bit; shift < 64 && n > 0; shift += 8) {
        int64_t count[257] = {0};
        for (int64_t i = 0; i < n; i++) count[(((from[i] ^ flip) >> shift) & 255) + 1]++;
        if (count[(((from[0] ^ flip) >> shift) & 255) + 1] == n) continue;
        for (int b = 0; b < 256; b++) count[b + 1] += count[b];
        for (int64_t i = 0; i < n; i++) to[count[((from[i] ^ flip) >> shift) & 255]++] = from[i];
        uint64_t *t = from; from = to; to = t;
    }
    if (from != a) memcpy(a, from, (size_t)n * sizeof(uint64_t));
}
"""
"""The C kernels' one radix sort (memlm.retrieval.nearest_kernel, memlm.retrieval.by_id_kernels), pasted into their
sources."""
COMPILE_SECONDS = 120


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (the first `flags` line of /proc/cpuinfo; empty where there is none)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def compile_library(source: str, stem: str, flags: tuple[str, ...], folder: Path | None = None) -> Path:
    """The shared library of C `source` built with `flags` in `folder` (default cache_dir()/kernels), compiled only
    when no build of the same source and flags is there. Raises OSError or subprocess.SubprocessError."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    digest = hashlib.sha256("\0".join((source, *flags, *LINK_FLAGS)).encode()).hexdigest()[:16]
    path = (folder or cache_dir() / "kernels") / f"{stem}_{digest}.so"
    if path.is_file():
        return path
    with atomic_path(path, concurrent=True) as tmp:  # concurrent builders each write their own file
        c_file = tmp.with_suffix(".c")
        try:
            c_file.write_text(source)
            subprocess.run([compiler, *flags, *LINK_FLAGS, "-o", str(tmp), str(c_file)], check=True,
                           capture_output=True, timeout=COMPILE_SECONDS)
        finally:
            c_file.unlink(missing_ok=True)
    return path


def load_or_warn(build: Callable[[], ctypes.CDLL], log: logging.Logger, what: str) -> ctypes.CDLL | None:
    """build() (compile_library then the module's loader), or None with a warning naming `what` and why (the
    compiler's message too) where it raised OSError or subprocess.SubprocessError. Callers cache the result, so
    the warning comes once a process."""
    try:
        return build()
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("memlm: no compiled %s (%s%s)", what, e,
                    f": {detail.decode(errors='replace')[:500]}" if detail else "")
        return None
