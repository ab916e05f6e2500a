"""The results page is generated from the benchmark harness's JSON and agrees with it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gen_results = _load(ROOT / "scripts" / "gen_results.py", "gen_results")
harness = _load(ROOT / "benchmarks" / "harness.py", "harness")


def test_the_results_page_equals_its_json() -> None:
    assert gen_results.PAGE.read_text() == gen_results.render()


def test_a_written_result_renders_with_its_command_and_figures(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["benchmarks/x.py", "--tokens", "64"])
    result = harness.Result("x", settings={"weights": "SmolLM2-135M-Instruct Q4_1"})
    result.figures["tokens_per_s"] = 12.5
    result.rows.append({"batch": 8, "tokens_per_s": 80.25})
    path = result.write(tmp_path)
    record = json.loads(path.read_text())
    assert record["command"] == "python benchmarks/x.py --tokens 64"
    assert record["machine"]["cores"] >= 1 and "numpy" in record["machine"]["versions"]
    page = gen_results.render(tmp_path)
    assert "python benchmarks/x.py --tokens 64" in page
    assert "| tokens_per_s | 12.5 |" in page and "| 8 | 80.25 |" in page
    assert "SmolLM2-135M-Instruct Q4_1" in page
    # a changed figure makes the page disagree with its JSON
    record["figures"]["tokens_per_s"] = 13.0
    path.write_text(json.dumps(record))
    assert gen_results.render(tmp_path) != page
