"""A datastore records the weight format its keys were computed in: `memlm datastore build --weights` writes it
to the manifest, a manifest without it reads as the float model of its build, eval and generate take it when
--weights and --dtype are unset, another format given is refused in one line unless --accept-weights-mismatch
accepts it, and `datastore add` encodes in it."""

from __future__ import annotations

import json

import pytest

from datastore import Datastore
from datastore.manifest import MANIFEST_NAME, Manifest
from memlm.cli import main


def run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


@pytest.fixture
def int8_store(capsys, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"Speech {i}: the union is strong.", "year": 1990 + i})
                                for i in range(8)) + "\n")
    store = tmp_path / "store"
    code, err = run(capsys, "datastore", "build", "--model", "tiny", "--data", str(corpus), "--split", "year<1995",
                    "--out", str(store), "--context", "64", "--stride", "32", "--weights", "int8", "--quiet")
    assert code == 0, err
    return corpus, store


def test_build_records_the_format_and_eval_refuses_another_unless_accepted(capsys, int8_store):
    corpus, store = int8_store
    manifest = Manifest.read(store)
    assert manifest.weights == "int8" and manifest.build["model_dtype"] == "bfloat16"
    assert Datastore.open(store).info().weights == "int8"
    common = ["eval", "--model", "tiny", "--data", str(corpus), "--split", "year>=1995", "--datastore", str(store),
              "--k", "4", "--context", "64", "--stride", "32", "--quiet"]
    code, err = run(capsys, *common, "--weights", "float32")
    assert code == 1 and err.count("\n") == 1, err
    assert "computed with --weights int8, the model runs --weights float32" in err and "--accept-weights-mismatch" in err
    assert run(capsys, *common, "--weights", "int8")[0] == 0
    code, err = run(capsys, *common)
    assert code == 0 and "taken from the datastore: --weights int8" in err, err
    assert run(capsys, *common, "--weights", "float32", "--accept-weights-mismatch")[0] == 0


def test_generate_refuses_another_format_in_one_line(capsys, int8_store):
    _, store = int8_store
    code, err = run(capsys, "generate", "the union", "--model", "tiny", "--datastore", str(store),
                    "--max-new-tokens", "2", "--weights", "int4")
    assert code == 1 and err.count("\n") == 1 and "--weights int8" in err, err


def test_an_old_manifest_reads_as_its_float_model(int8_store):
    _, store = int8_store
    raw = json.loads((store / MANIFEST_NAME).read_text())
    del raw["weights"]
    assert Manifest.from_json(json.dumps(raw)).weights == "bfloat16"  # its build's model_dtype
    del raw["build"]["model_dtype"]
    assert Manifest.from_json(json.dumps(raw)).weights == "float32"


def test_add_encodes_in_the_datastores_format(capsys, int8_store, tmp_path):
    corpus, store = int8_store
    code, err = run(capsys, "datastore", "add", str(store), "--data", str(corpus), "--split", "year>=1995", "--quiet")
    assert code == 0, err
    assert Manifest.read(store).weights == "int8" and Manifest.read(store).generation == 1
