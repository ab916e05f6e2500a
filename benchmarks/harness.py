"""One harness for every benchmark's result: the figures with the command, commit, machine and versions
they were measured with, written as one JSON file that the docs' results pages are generated from
(scripts/gen_results.py; tests/test_results.py fails when a page disagrees with its JSON)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "data"
"""Where results land: one `<name>.json` per benchmark, checked in."""


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in ("torch", "faiss", "numpy"):
        module = sys.modules.get(name)
        if module is None:
            try:
                module = __import__(name)
            except ImportError:
                continue
        found[name] = str(getattr(module, "__version__", "unknown"))
    return found


def machine() -> dict[str, Any]:
    """The machine a figure was measured on: CPU model, cores this process may use, load, versions."""
    torch = sys.modules.get("torch")
    return {
        "cpu": _cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "gpu": torch.cuda.get_device_name(0) if torch is not None and torch.cuda.is_available() else None,
        "versions": _versions(),
    }


class Result:
    """A benchmark's result as it runs: `start()` records the load before, `write()` the rest.

    figures: name -> value (numbers or short strings); rows: a list of dicts, one per setting, for tables.
    settings: the non-default settings the figures depend on (weights, dtype, GEMM, datastore, flags).
    """

    def __init__(self, name: str, *, settings: dict[str, Any] | None = None) -> None:
        self.name = name
        self.settings = dict(settings or {})
        self.figures: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []
        self.load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        self.started = datetime.datetime.now(datetime.timezone.utc)

    def write(self, out_dir: Path = RESULTS) -> Path:
        """Write `<out_dir>/<name>.json` and return its path."""
        record = {
            "name": self.name,
            "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
            "commit": _git("rev-parse", "HEAD"),
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "date": self.started.isoformat(timespec="seconds"),
            "wall_s": round((datetime.datetime.now(datetime.timezone.utc) - self.started).total_seconds(), 2),
            "machine": machine() | {"load_1min_before": self.load_before},
            "settings": self.settings,
            "figures": self.figures,
            "rows": self.rows,
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{self.name}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
        os.replace(tmp, path)  # a crash leaves the old result, never half a file
        return path
