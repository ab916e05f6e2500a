"""The import directions are contracts in pyproject.toml (`lint-imports`, run by `make test`); these tests
check what import-linter does not: the library loads no server code at run time, and no package reaches
into another's private names."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("memlm.data", "memlm.model", "memlm.memory", "memlm.retrieval", "memlm.jobs", "memlm.engine")


def test_the_library_loads_neither_datastore_nor_services() -> None:
    code = (f"import json, sys; import {', '.join(LIBRARY)}; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('datastore', 'services'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
    # the check itself sees a server module when one is loaded
    code = code.replace("import json, sys;", "import json, sys; import services.common.tensors;")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "services.common.tensors" in json.loads(out.stdout)


def package_of(module: str) -> str:
    """The subpackage a module belongs to: memlm.jobs.decoding -> memlm.jobs, services.lm.engine -> services.lm."""
    return ".".join(module.split(".")[:2])


def private_imports(path: Path, module: str) -> list[str]:
    """`from other.package import _name` in `path` (module `module`), where `other.package` is another subpackage."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] not in ("memlm", "datastore", "services"):
                continue
            if package_of(node.module) == package_of(module):
                continue
            found += [f"{module} <- {node.module}.{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_private_imports_are_found(tmp_path) -> None:
    (tmp_path / "m.py").write_text("from memlm.jobs.decoding import _flush, public\nfrom memlm.engine.rows import _ok\n")
    assert private_imports(tmp_path / "m.py", "memlm.engine.engine") == ["memlm.engine.engine <- memlm.jobs.decoding._flush"]


def test_no_package_imports_another_packages_private_names() -> None:
    found = []
    for package in ("memlm", "datastore", "services"):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if "v1" in parts:  # generated protobuf code
                continue
            found += private_imports(path, ".".join(parts))
    assert found == []


def engine_private_uses(path: Path) -> list[str]:
    """`engine._name` in `path`: a feature module reaching past the engine's public surface (memlm.engine.engine:
    plan, rows, holds, advance, release and its attributes)."""
    return [f"{path.name}:{node.lineno} engine.{node.attr}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "engine"
            and node.attr.startswith("_")]


def test_engine_private_uses_are_found(tmp_path) -> None:
    (tmp_path / "f.py").write_text("def f(engine):\n    engine._release(1)\n    engine.release(2)\n")
    assert engine_private_uses(tmp_path / "f.py") == ["f.py:2 engine._release"]


def test_engine_features_use_the_engines_public_surface_only() -> None:
    found = [use for path in sorted((ROOT / "memlm" / "engine").glob("*.py")) if path.name != "engine.py"
             for use in engine_private_uses(path)]
    assert found == []


# C held in a Python string, or a compiler started by the product: what is compiled is compiled at install.
COMPILED_CODE = re.compile(r"#include\s*[<\"]|\bcpp_extension\.load(_inline)?\b|\bctypes\.CDLL\b|"
                           r"\[\s*[\"'](gcc|cc|clang|g\+\+)[\"']")


def compiled_code(path: Path) -> list[str]:
    """Lines of `path` that hold C source or start a compiler."""
    return [f"{path.name}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1) if COMPILED_CODE.search(line)]


def test_compiled_code_is_found(tmp_path) -> None:
    (tmp_path / "f.py").write_text('SRC = """\n#include <stdint.h>\n"""\nsubprocess.run(["cc", "-O2"])\nx = 1\n')
    assert compiled_code(tmp_path / "f.py") == ["f.py:2", "f.py:4"]


def test_no_python_file_holds_c_or_starts_a_compiler() -> None:
    found = [hit for package in ("memlm", "datastore", "services") for path in sorted((ROOT / package).rglob("*.py"))
             for hit in compiled_code(path)]
    assert found == []
