"""`memlm plan`: memory per shard, shards, and replicas for a datastore of T tokens.

    memlm plan --tokens 1e9 --dim 576 --index IVF65536,PQ64 [--qps 1000] [--nprobe 512]

Sizes come from the index itself (faiss's code size and list count for the factory string: one entry per
token, its code plus an int64 id in the inverted lists; the coarse quantizer's nlist x d float32 centroids)
and from the datastore's files (float16 keys, int32 values, int32 document and position per entry). Search
time comes from figures measured by benchmarks/shard_capacity.py (its JSON, --figures; best run on the serving hardware): one
thread's fixed cost per query, cost per coarse centroid, per probed list (its look-up table) and per PQ code
scanned; a query scans nprobe lists of N_shard / nlist codes on every shard, and a replica searches on --cores threads. Every shard
answers every query (the router fans out), so each shard needs the target rate; replicas are at least 2,
so one may die (services/router/replicas.py fails over). Estimates for planning, not guarantees: a cold disk, a
skewed list size and network hops are not in them.

Shape legend: N entries, d key dimension.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memlm.errors import MemlmError

DEFAULT_FIGURES = Path(__file__).resolve().with_name("shard_capacity.json")
"""The figures shipped with the package (benchmarks/shard_capacity.py measures them anew)."""
MIN_REPLICAS = 2
"""Replicas per shard at least: one may die while the other answers (services/router/replicas.py)."""
MEMORY_HEADROOM = 0.8
"""Fraction of a host's memory an index may take (the rest: the server, queries, the page cache)."""
GIB = 2**30


@dataclass(frozen=True)
class PlanInputs:
    """What to plan for."""

    tokens: int
    """Datastore entries N (one per corpus token)."""
    dim: int
    """Key dimension d."""
    factory: str
    """FAISS factory string of the index, an IVF one (e.g. "IVF65536,PQ64")."""
    nprobe: int
    """Inverted lists probed per query."""
    qps: float | None
    """Target queries per second over the whole tier; None: report what one replica sustains."""
    host_memory_gib: float
    """Memory of one shard replica's host, in GiB."""
    cores: int
    """Search threads of one replica (faiss parallelises a batch of queries over them)."""
    host_disk_gib: float
    """Disk of one shard replica's host for on-disk lists, in GiB."""
    on_disk: bool
    """Inverted lists in a memory-mapped file (memlm datastore build --on-disk): only the quantizer resident."""


@dataclass(frozen=True)
class Plan:
    """The plan's figures (bytes and seconds)."""

    code_bytes: int
    """Bytes of one entry's code in the inverted lists."""
    nlist: int
    """Inverted lists of each shard's index."""
    lists_bytes: float
    """Inverted lists of all shards (codes and int64 ids)."""
    quantizer_bytes: float
    """One shard's coarse quantizer (nlist x d float32)."""
    files_bytes: float
    """Keys, values and provenance files of all shards (on disk, read for exact re-ranking)."""
    shards: int
    """Shards: the fewest whose resident index (on-disk lists: whose lists) fits MEMORY_HEADROOM of a host's
    memory (disk)."""
    resident_bytes_per_shard: float
    """What one shard replica holds in memory."""
    query_seconds: float
    """One query on one shard on one thread."""
    qps_per_replica: float
    """Queries per second one replica of a shard sustains on `cores` threads."""
    replicas: int
    """Replicas per shard for the target rate (at least MIN_REPLICAS)."""


def make_plan(inputs: PlanInputs, figures: dict[str, Any], nlist: int, code_bytes: int) -> Plan:
    """The plan for `inputs` from benchmarks/shard_capacity.json's "scan" figures (scaled to code_bytes)."""
    scan = figures["scan"]
    n = float(inputs.tokens)
    lists = n * (code_bytes + 8)  # codes + int64 ids
    quantizer = float(nlist * inputs.dim * 4)
    budget = inputs.host_memory_gib * GIB * MEMORY_HEADROOM
    if quantizer >= budget:
        raise MemlmError(f"the coarse quantizer alone ({quantizer / GIB:.1f} GiB) exceeds {MEMORY_HEADROOM:.0%} of "
                         f"--host-memory-gib {inputs.host_memory_gib:g}; use fewer lists")
    if inputs.on_disk:  # the lists must fit the host's disk; only the quantizer is resident
        shards = max(1, math.ceil(lists / (inputs.host_disk_gib * GIB * MEMORY_HEADROOM)))
    else:
        shards = max(1, math.ceil(lists / (budget - quantizer)))
    resident = quantizer + (0.0 if inputs.on_disk else lists / shards)
    scanned = inputs.nprobe * (n / shards) / nlist  # codes a query scans on one shard
    per_code = scan["ns_per_code"] * 1e-9 * code_bytes / scan["pq_m"]  # the scan is linear in code bytes
    seconds = (scan["us_per_query_fixed"] * 1e-6 + scan["ns_per_coarse_list"] * 1e-9 * nlist
               + scan["us_per_list"] * 1e-6 * inputs.nprobe + per_code * scanned)
    qps_replica = inputs.cores / seconds
    replicas = MIN_REPLICAS if inputs.qps is None else max(MIN_REPLICAS, math.ceil(inputs.qps / qps_replica))
    return Plan(code_bytes=code_bytes, nlist=nlist, lists_bytes=lists, quantizer_bytes=quantizer,
                files_bytes=n * (inputs.dim * 2 + 4 + 8), shards=shards, resident_bytes_per_shard=resident,
                query_seconds=seconds, qps_per_replica=qps_replica, replicas=replicas)


def format_plan(inputs: PlanInputs, plan: Plan, figures_path: Path, figures: dict[str, Any]) -> str:
    rate = "no --qps given: replicas for availability only" if inputs.qps is None else f"{inputs.qps:g} queries/s"
    return "\n".join([
        f"datastore     {inputs.tokens:.3g} entries of d {inputs.dim}, index {inputs.factory} ({plan.nlist} lists, "
        f"{plan.code_bytes} B codes + 8 B ids), nprobe {inputs.nprobe}" + (", lists on disk" if inputs.on_disk else ""),
        (f"index         {plan.lists_bytes / GIB:,.1f} GiB of lists, {plan.quantizer_bytes / GIB:.2f} GiB quantizer per "
        f"shard; keys/values/provenance files {plan.files_bytes / GIB:,.0f} GiB on disk"),
        (f"shards        {plan.shards} (each resident {plan.resident_bytes_per_shard / GIB:,.1f} GiB <= "
        f"{MEMORY_HEADROOM:.0%} of {inputs.host_memory_gib:g} GiB"
        + (f"; lists {plan.lists_bytes / plan.shards / GIB:,.0f} GiB on disk each)" if inputs.on_disk else ")")),
        (f"search        {plan.query_seconds * 1e3:.2f} ms a query per shard on one thread -> "
        f"{plan.qps_per_replica:,.0f} queries/s per replica on {inputs.cores} threads"),
        (f"replicas      {plan.replicas} per shard ({rate}; at least {MIN_REPLICAS}) -> "
        f"{plan.shards * plan.replicas} retrieval servers behind one router"),
        (f"figures       {figures_path} ({figures.get('machine', '?')}; scan of IVF{figures['scan']['nlist']},"
        f"PQ{figures['scan']['pq_m']} over {figures['scan']['n']:,} vectors)"),
    ])


def read_figures(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise MemlmError(f"no measured figures at {path}: run `python benchmarks/shard_capacity.py` first "
                         "(or pass --figures PATH)")
    figures = json.loads(path.read_text())
    if "scan" not in figures:
        raise MemlmError(f"{path} has no scan figures: run `python benchmarks/shard_capacity.py --only scan`")
    return figures


def cmd_plan(args: argparse.Namespace) -> None:
    import faiss

    from datastore.index import default_nprobe, make_index

    index = make_index(args.index, args.dim)
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is None:
        raise MemlmError(f"memlm plan needs an IVF index (e.g. IVF65536,PQ64), got {args.index!r}")
    inputs = PlanInputs(tokens=int(args.tokens), dim=args.dim, factory=args.index,
                        nprobe=args.nprobe or default_nprobe(index), qps=args.qps,
                        host_memory_gib=args.host_memory_gib, cores=args.cores, host_disk_gib=args.host_disk_gib,
                        on_disk=args.on_disk)
    figures = read_figures(args.figures)
    print(format_plan(inputs, make_plan(inputs, figures, ivf.nlist, ivf.code_size), args.figures, figures))


def add_plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="memory per shard, shards and replicas for a datastore of N tokens")
    p.add_argument("--tokens", type=float, required=True, help="datastore entries, e.g. 1e9")
    p.add_argument("--dim", type=int, required=True, help="key dimension d (576 for SmolLM2-135M)")
    p.add_argument("--index", required=True, help='IVF factory string, e.g. "IVF65536,PQ64"')
    p.add_argument("--nprobe", type=int, default=None, help="lists probed per query (default: the build's rule)")
    p.add_argument("--qps", type=float, default=None, help="target queries per second over the tier")
    p.add_argument("--host-memory-gib", type=float, default=256.0, help="memory of one replica's host, GiB")
    p.add_argument("--cores", type=int, default=16, help="search threads of one replica")
    p.add_argument("--host-disk-gib", type=float, default=8192.0, help="disk for --on-disk lists of one host, GiB")
    p.add_argument("--on-disk", action="store_true", help="lists memory-mapped (datastore build --on-disk)")
    p.add_argument("--figures", type=Path, default=DEFAULT_FIGURES, help="benchmarks/shard_capacity.py's JSON")
    p.set_defaults(func=cmd_plan)
