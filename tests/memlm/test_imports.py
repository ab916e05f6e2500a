"""The import graph of memlm, datastore and services: no cycles (also none hidden in a function-level
import), and dependencies run one way (memlm imports neither datastore nor services; DESIGN.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("memlm", "datastore", "services")


def _modules() -> dict[str, Path]:
    mods = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if "v1" in parts:  # generated protobuf code
                continue
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> our modules it imports anywhere in its body (top level or inside functions)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from memlm.model import weights` imports the module memlm.model.weights
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            else:
                continue
            edges |= {t for t in targets if t in mods and t != name and not name.startswith(t + ".")}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (cycle := visit(n)):
            return cycle
    return None


def test_find_cycle_finds_one() -> None:
    # weights -> checkpoint -> weights was the cycle before memlm.model.pretrained (issue 8).
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle() -> None:
    graph = import_graph()
    assert "memlm.model.checkpoint" in graph["memlm.model.weights"]  # the graph sees function bodies too
    assert find_cycle(graph) is None


COMMAND_LINE = {"memlm.cli", "memlm.eval_command", "memlm.train_command", "memlm.spalm_command", "memlm.link_options",
                "memlm.generate_command", "memlm.datastore_command", "memlm.gate_command", "memlm.harness_command",
                "memlm.plan_command"}
"""The command line wires datastores and servers into the library; it alone may import them."""


def test_memlm_library_imports_neither_datastore_nor_services() -> None:
    offenders = sorted(
        (name, dep) for name, deps in import_graph().items()
        if name.split(".")[0] == "memlm" and name not in COMMAND_LINE
        for dep in deps if dep.split(".")[0] in ("datastore", "services")
    )
    assert offenders == []
