"""The size rules of issue 8 ("no module over ~500 lines, no function over ~80"), checked on every
hand-written module of memlm, datastore and services (generated protobuf code excluded)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
KNOWN_LONG: set[str] = set()
"""Functions over the limit that are known and owed a split; an entry that has been fixed must go."""


def _sources() -> list[Path]:
    return sorted(p for package in ("memlm", "datastore", "services") for p in (ROOT / package).rglob("*.py")
                  if "v1" not in p.relative_to(ROOT).parts)


def long_functions(path: Path, limit: int) -> dict[str, int]:
    """'path:name' -> lines of every function (methods and nested ones too) longer than `limit`."""
    rel = path.relative_to(ROOT).as_posix()
    return {f"{rel}:{node.name}": node.end_lineno - node.lineno + 1
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit}


def test_long_functions_are_found(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    body = "\n".join(f"        x{i} = {i}" for i in range(5))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\nclass C:\n    def long(self):\n{body}\n")
    assert long_functions(tmp_path / "m.py", 5) == {"m.py:long": 6}


def test_no_module_over_the_limit() -> None:
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in _sources()}
    assert {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_no_function_over_the_limit() -> None:
    found = {}
    for path in _sources():
        found |= long_functions(path, MAX_FUNCTION_LINES)
    assert sorted(set(found) - KNOWN_LONG) == []
    assert sorted(KNOWN_LONG - set(found)) == []  # fixed: remove it from KNOWN_LONG
