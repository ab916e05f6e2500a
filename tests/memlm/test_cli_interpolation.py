"""`memlm eval --lambda auto --knn-temperature auto`: the interpolation chosen on the tuning split is in the
JSON and saved beside it, loadable; --save-interpolation with a given lambda is refused in one line."""

import json

from memlm.cli import main
from memlm.jobs.interpolation_eval import METHODS
from memlm.retrieval.interpolation import load_method


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_auto_reports_and_saves_the_chosen_interpolation(capsys, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"text": f"Speech number {i}: the state of the union is strong and growing.", "year": 1990 + i}
            for i in range(12)]
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    store = tmp_path / "store"
    code, _, err = run(capsys, "datastore", "build", "--model", "tiny", "--data", str(corpus), "--split", "year<1996",
                       "--out", str(store), "--context", "64", "--stride", "32", "--quiet")
    assert code == 0, err
    common = ["eval", "--model", "tiny", "--data", str(corpus), "--split", "year>=1999", "--datastore", str(store),
              "--k", "8", "--tune-data", str(corpus), "--tune-split", "1996<=year<=1998", "--quiet"]
    out_json = tmp_path / "r.json"
    code, _, err = run(capsys, *common, "--lambda", "auto", "--knn-temperature", "auto", "--json", str(out_json))
    assert code == 0, err
    result = json.loads(out_json.read_text())
    chosen = result["interpolation"]
    assert chosen["method"] in METHODS and set(chosen["held_apart_perplexity"]) == set(METHODS)
    method, settings = load_method(tmp_path / "r.interpolation.json")
    assert method.method == chosen["method"] and settings["k"] == 8 and len(settings["fitted_documents"]) == 3
    assert result["tuned"] and 0 <= result["lambda"] <= 1
    code, _, err = run(capsys, *common, "--lambda", "0.5", "--knn-temperature", "auto", "--save-interpolation",
                       str(tmp_path / "m.json"))
    last = err.strip().splitlines()[-1]
    assert code == 1 and "--save-interpolation needs --lambda auto --knn-temperature auto" in last
    assert "Traceback" not in err and not (tmp_path / "m.json").exists()
