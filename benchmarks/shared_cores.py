"""Decode throughput beside two busy processes vs quiet, with OpenMP's default wait and with a passive one.

`memlm generate` (SmolLM2-135M-Instruct Q4_1, batch-1 greedy, --new-tokens tokens; the command's own
generation timer) runs as a child process under four conditions, alternating over --rounds rounds (the
median per condition): quiet or beside --busy processes that each run float32 matrix products on one
thread (the compute of a training run), and with each OpenMP wait of POLICIES (libgomp's default spin, passive, shorter
spins; `memlm serve` spins 10,000 times, memlm.cli.threads). The figure is each policy's slowdown,
quiet tokens/s over busy tokens/s; a fair share of 2 cores beside 2 busy processes would be 2x. Every
condition must produce the same greedy tokens (the command exits 1 otherwise). Run it on a machine that is
otherwise idle: the load before and after is recorded.

    python benchmarks/shared_cores.py [--new-tokens 64] [--busy 2] [--rounds 2] [--results DIR]

Writes docs/results/data/shared_cores.json (benchmarks/harness.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import harness

PROMPT = "My fellow Americans, tonight"
BURNER = ("import torch\ntorch.set_num_threads(1)\na = torch.randn(384, 384)\nwhile True:\n    a = torch.tanh(a @ a)\n")
POLICIES = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
            "spin 10k": {"GOMP_SPINCOUNT": "10000"}, "spin 100k": {"GOMP_SPINCOUNT": "100000"}}
"""OpenMP's wait between parallel regions: libgomp's default (spin about 300k times, then sleep), passive (sleep at
once), and shorter spins before sleeping."""


def generate(args: argparse.Namespace, policy: dict[str, str], out: Path) -> dict:
    """One `memlm generate` run under the wait `policy` (environment variables); its JSON report."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | policy
    cmd = [sys.executable, "-m", "memlm", "generate", "--model", args.model, PROMPT, "--max-new-tokens",
           str(args.new_tokens), "--sampling-temperature", "0", "--json", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=harness.ROOT)
    if done.returncode != 0:
        raise SystemExit(f"memlm generate failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--busy", type=int, default=2, help="busy processes beside the decode")
    p.add_argument("--rounds", type=int, default=2)
    harness.add_options(p, "shared_cores")
    args = p.parse_args()
    result = harness.Result.from_args(args)
    result.children = True
    rates: dict[tuple[str, str], list[float]] = {}
    tokens: dict[tuple[str, str], list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="memlm-shared-cores-") as tmp:
        for i in range(args.rounds):
            for load in ("quiet", "busy"):
                burners = [subprocess.Popen([sys.executable, "-c", BURNER], env=dict(os.environ, OMP_NUM_THREADS="1"))
                           for _ in range(args.busy if load == "busy" else 0)]
                try:
                    for name, policy in POLICIES.items():
                        report = generate(args, policy, Path(tmp) / f"{load}-{name}-{i}.json")
                        rates.setdefault((load, name), []).append(report["tokens_per_s"])
                        tokens[(load, name)] = report["results"][0]["tokens"]
                        print(f"# round {i + 1}, {load}, wait {name}: {report['tokens_per_s']:.1f} tokens/s; load "
                              f"{harness.load()}", flush=True)
                finally:
                    for b in burners:
                        b.kill()
                        b.wait()
    first = next(iter(tokens.values()))
    result.check("the same greedy tokens under every condition", all(t == first for t in tokens.values()))
    median = {key: statistics.median(v) for key, v in rates.items()}
    print(f"{'wait policy':<12} {'quiet tok/s':>12} {'busy tok/s':>11} {'slowdown':>9}")
    for name in POLICIES:
        slowdown = median[("quiet", name)] / median[("busy", name)]
        result.rows.append({"wait_policy": name, "quiet_tokens_per_s": median[("quiet", name)],
                            "busy_tokens_per_s": median[("busy", name)], "slowdown": slowdown})
        print(f"{name:<12} {median[('quiet', name)]:12.1f} {median[('busy', name)]:11.1f} {slowdown:8.2f}x")
    passive = next(r["slowdown"] for r in result.rows if r["wait_policy"] == "passive")
    print(f"goal: slowdown beside {args.busy} busy processes <= 2.2x; passive {passive:.2f}x: "
          f"{'met' if passive <= 2.2 else 'NOT met'}")
    result.settings = {"model": args.model, "new_tokens": args.new_tokens, "busy_processes": args.busy,
                       "rounds": args.rounds, "cores": len(os.sched_getaffinity(0)), "statistic": "median"}
    result.figures = {f"{r['wait_policy']}_{k}": r[k] for r in result.rows for k in ("slowdown", "busy_tokens_per_s")}
    result.headline("shared_cores", "; ".join(
        f"{r['wait_policy']} {r['quiet_tokens_per_s']:.1f} -> {r['busy_tokens_per_s']:.1f} tokens/s ({r['slowdown']:.2f}x)"
        for r in result.rows))
    result.write()


if __name__ == "__main__":
    main()
