"""Pickled weights (pytorch_model.bin) load only when allowed: refused by default with the flag named, and
with allow_pickle / --allow-pickle-weights the same model as its safetensors copy; on eval, generate,
datastore build and serve lm.

Shape legend: T tokens, V vocab.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from memlm.cli import main
from memlm.cli.commands import build_parser
from memlm.errors import MemlmError
from memlm.model.pretrained import files_fingerprint
from memlm.model.tokenizer import Tokenizer
from memlm.model.weights import load_pretrained

FLAG = "--allow-pickle-weights"
VOCAB = 260  # the byte tokenizer's 259 ids, and one spare
CONTEXT = 32


def tiny_gpt2(seed: int):
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=VOCAB, bos_token_id=256,
                           eos_token_id=257)
    return tf.GPT2LMHeadModel(config)


def save_pickled(model, directory) -> None:
    """The layout transformers wrote before safetensors: config.json and a torch.save'd state dict."""
    directory.mkdir()
    model.config.save_pretrained(directory)
    torch.save(model.state_dict(), directory / "pytorch_model.bin")
    Tokenizer.byte_level().save(directory)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The same random GPT-2 saved as safetensors and as a pickle, and a directory holding both, whose
    pickle carries other weights."""
    root = tmp_path_factory.mktemp("pickle")
    model = tiny_gpt2(seed=0)
    safe, pickled, both = root / "safe", root / "pickled", root / "both"
    model.save_pretrained(safe)
    Tokenizer.byte_level().save(safe)
    save_pickled(model, pickled)
    shutil.copytree(safe, both)
    torch.save(tiny_gpt2(seed=1).state_dict(), both / "pytorch_model.bin")
    return {"safe": safe, "pickled": pickled, "both": both}


def logits(pretrained) -> torch.Tensor:
    idx = torch.tensor([pretrained.tokenizer.encode("the state of the union is strong")])  # (1, T)
    with torch.no_grad():
        return pretrained.model(idx).logits  # (1, T, V)


def test_a_pickle_is_refused_by_default_with_the_flag_named(dirs):
    with pytest.raises(MemlmError, match=rf"only pickled weights \(pytorch_model.bin\).*{FLAG}") as e:
        load_pretrained(dirs["pickled"])
    assert "\n" not in str(e.value)
    with pytest.raises(MemlmError, match=FLAG):
        load_pretrained(f"hf:{dirs['pickled']}")


def test_an_allowed_pickle_loads_the_same_model_as_its_safetensors(dirs):
    safe = load_pretrained(dirs["safe"])
    pickled = load_pretrained(dirs["pickled"], allow_pickle=True)
    torch.testing.assert_close(logits(pickled), logits(safe), rtol=0, atol=0)
    assert pickled.fingerprint == files_fingerprint([dirs["pickled"] / "pytorch_model.bin"])
    assert pickled.fingerprint != safe.fingerprint


def test_safetensors_win_over_a_pickle_beside_them(dirs):
    """The files loaded are the files fingerprinted: the safetensors, even where pickles are allowed."""
    safe = load_pretrained(dirs["safe"])
    both = load_pretrained(dirs["both"], allow_pickle=True)
    torch.testing.assert_close(logits(both), logits(safe), rtol=0, atol=0)
    assert both.fingerprint == safe.fingerprint


def test_memlms_decoder_refuses_a_pickled_llama_and_names_the_way_through_transformers(tmp_path):
    import transformers as tf

    config = tf.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=64, max_position_embeddings=64, vocab_size=VOCAB)
    save_pickled(tf.LlamaForCausalLM(config), tmp_path / "llama")
    with pytest.raises(MemlmError, match=rf"hf:{tmp_path / 'llama'} {FLAG}"):
        load_pretrained(tmp_path / "llama", allow_pickle=True)
    assert load_pretrained(f"hf:{tmp_path / 'llama'}", allow_pickle=True).model.config.model_type == "llama"


COMMANDS = {  # each command's required arguments
    "eval": ["eval", "--model", "M", "--data", "D"],
    "generate": ["generate", "--model", "M", "hello"],
    "datastore build": ["datastore", "build", "--model", "M", "--data", "D", "--out", "O"],
    "serve lm": ["serve", "lm", "--model", "M"],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_the_flag_parses_on_each_command_that_loads_a_model(command):
    parser = build_parser()
    assert parser.parse_args([*COMMANDS[command], FLAG]).allow_pickle_weights is True
    assert not parser.parse_args(COMMANDS[command]).allow_pickle_weights


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    rows = [{"text": f"Speech number {i}: the state of the union is strong and growing."} for i in range(4)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_eval_and_generate_refuse_a_pickle_unless_allowed_then_match_the_safetensors(capsys, tmp_path, dirs):
    data, window = corpus(tmp_path), ["--context", CONTEXT, "--stride", CONTEXT // 2, "--quiet"]
    code, _, err = run(capsys, "eval", "--model", dirs["pickled"], "--data", data, *window)
    assert code == 1 and FLAG in err and err.count("\n") == 1, err
    results = {}
    for name, extra in (("safe", []), ("pickled", [FLAG])):
        out = tmp_path / f"{name}.json"
        code, _, err = run(capsys, "eval", "--model", dirs[name], "--data", data, *window, "--json", out, *extra)
        assert code == 0, err
        results[name] = json.loads(out.read_text())
    assert results["pickled"]["perplexity"] == results["safe"]["perplexity"]

    code, _, err = run(capsys, "generate", "--model", dirs["pickled"], "--max-new-tokens", 4, "hello")
    assert code == 1 and FLAG in err, err
    tokens = {}
    for name, extra in (("safe", []), ("pickled", [FLAG])):
        out = tmp_path / f"gen-{name}.json"
        code, _, err = run(capsys, "generate", "--model", dirs[name], "--max-new-tokens", 4,
                           "--sampling-temperature", 0, "--json", out, *extra, "the state")
        assert code == 0, err
        tokens[name] = json.loads(out.read_text())["results"][0]["tokens"]
    assert tokens["pickled"] == tokens["safe"] and tokens["safe"]


def test_datastore_build_takes_the_flag(capsys, tmp_path, dirs):
    data, window = corpus(tmp_path), ["--context", CONTEXT, "--stride", CONTEXT // 2, "--quiet"]
    store = tmp_path / "store"
    code, _, err = run(capsys, "datastore", "build", "--model", dirs["pickled"], "--data", data, "--out", store,
                       *window)
    assert code == 1 and FLAG in err, err
    code, _, err = run(capsys, "datastore", "build", "--model", dirs["pickled"], "--data", data, "--out", store,
                       *window, FLAG)
    assert code == 0, err
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["model_fingerprint"] == files_fingerprint([dirs["pickled"] / "pytorch_model.bin"])


def test_the_ray_builds_workers_load_as_the_driver(dirs):
    """The loader each Ray actor runs (datastore.ray_build.load_model_by_name) takes the build's flag."""
    from datastore.ray_build import load_model_by_name

    with pytest.raises(MemlmError, match=FLAG):
        load_model_by_name(str(dirs["pickled"]), "cpu", "float32", None)
    model = load_model_by_name(str(dirs["pickled"]), "cpu", "float32", None, None, True)
    idx = torch.tensor([[1, 2, 3]])  # (1, T)
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, load_pretrained(dirs["safe"]).model(idx).logits, rtol=0, atol=0)


def test_serve_lm_loads_with_the_flag(capsys, monkeypatch, dirs):
    """The flag reaches the server's model loader (open_model_and_searcher), which then loads the pickle."""
    import services.lm.server as server

    seen = {}

    async def serve_lm(model, **options):
        seen.update(options)
        server.open_model_and_searcher(model, allow_pickle_weights=options["allow_pickle_weights"])

    monkeypatch.setattr(server, "serve_lm", serve_lm)
    code, _, err = run(capsys, "serve", "lm", "--model", dirs["pickled"], "--port", 0)
    assert code == 1 and FLAG in err and seen["allow_pickle_weights"] is False, err
    code, _, err = run(capsys, "serve", "lm", "--model", dirs["pickled"], "--port", 0, FLAG)
    assert code == 0 and seen["allow_pickle_weights"] is True, err
