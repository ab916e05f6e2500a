"""A datastore build on Ray workers vs a local build with the same total threads, side by side in one run.

Both sides are the whole `memlm datastore build` command over the same text and settings, each its own
process: the local build with --threads torch threads in one process, the Ray build (`--ray local --workers
--threads`) with one thread in each of --threads encoder actors, so both use the same cores. The sides
alternate over --repeats rounds (the median per side). The two datastores must be identical file for file
(the Ray build's promise), checked in every round: the command exits 1 otherwise. Ray's start-up is inside
the Ray side's wall time, as a user pays it.

    python benchmarks/ray_build.py [--max-tokens 20000] [--threads 2] [--repeats 2] [--results DIR]

Writes docs/results/data/ray_build.json (benchmarks/harness.py).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

MEMLM = [sys.executable, "-m", "memlm"]


def digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` but the manifest (which records the build's own timings and host)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "manifest.json"}


def build(argv: list[str], out: Path, threads: int) -> float:
    """Run one `memlm datastore build` into `out`; its wall seconds."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    done = subprocess.run([*MEMLM, "datastore", "build", *argv, "--out", str(out), "--quiet"], env=env,
                          capture_output=True, text=True, cwd=harness.ROOT)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"datastore build failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default="sotu")
    p.add_argument("--split", default="1990<=year<=2000")
    p.add_argument("--max-tokens", type=int, default=20000)
    p.add_argument("--threads", type=int, default=2, help="total threads of each side")
    p.add_argument("--repeats", type=int, default=2)
    harness.add_options(p, "ray_build")
    args = p.parse_args()
    result = harness.Result.from_args(args)
    result.children = True
    argv = ["--model", args.model, "--data", args.data, "--split", args.split, "--max-tokens", str(args.max_tokens),
            "--context", "512", "--stride", "512"]
    seconds: dict[str, list[float]] = {"local": [], "ray": []}
    with tempfile.TemporaryDirectory(prefix="memlm-ray-build-") as tmp:
        for i in range(args.repeats):
            local, ray = Path(tmp) / f"local-{i}", Path(tmp) / f"ray-{i}"
            seconds["local"].append(build(argv, local, args.threads))
            seconds["ray"].append(build([*argv, "--ray", "local", "--workers", str(args.threads)], ray, 1))
            result.check(f"Ray build identical to the local build, round {i + 1}", digest(local) == digest(ray))
            print(f"# round {i + 1}: local {seconds['local'][-1]:.1f} s, Ray {seconds['ray'][-1]:.1f} s; "
                  f"load {harness.load()}", flush=True)
    local_s, ray_s = statistics.median(seconds["local"]), statistics.median(seconds["ray"])
    print(f"{args.max_tokens} tokens: local build ({args.threads} threads, one process) {local_s:.1f} s, Ray build "
          f"({args.threads} workers x 1 thread) {ray_s:.1f} s; Ray / local speed {local_s / ray_s:.2f}x")
    result.settings = {"model": args.model, "data": f"{args.data} {args.split}", "tokens": args.max_tokens,
                       "threads_each_side": args.threads, "repeats": args.repeats, "statistic": "median"}
    result.figures = {"local_s": harness.stats(seconds["local"]), "ray_s": harness.stats(seconds["ray"]),
                      "ray_speed_over_local": local_s / ray_s}
    result.headline("ray_build", f"{local_s / ray_s:.2f}x local speed ({args.threads} Ray workers x 1 thread vs "
                                 f"1 process x {args.threads} threads)")
    result.write()


if __name__ == "__main__":
    main()
