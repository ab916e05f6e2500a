"""Any Hugging Face causal LM as the kNN-LM base: tiny random GPT-2, GPT-NeoX, Llama and
Qwen2 models saved with save_pretrained, the key-module rule, memories refused, the CLI end to end.

Shape legend: T tokens, C key width, V vocab.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from datastore import Datastore
from memlm.cli import main
from memlm.errors import MemlmError
from memlm.engine.generate import generate
from reference_decoding import reference_generate
from memlm.jobs.decoding import SamplingConfig
from memlm.jobs.windows import WindowConfig, score_documents
from memlm.model.decoder import Decoder
from memlm.model.hf_model import (
    HFCausalLM,
    HFKVCache,
    find_key_module,
    load_hf_causal_lm,
)
from memlm.model.pretrained import require_decoder
from memlm.model.tokenizer import Tokenizer, document_boundary
from memlm.model.weights import load_pretrained

VOCAB = 260  # the byte tokenizer's 259 ids, and one spare
CONTEXT = 48  # windows of the tests; every model's max_position_embeddings is 64


def tiny_config(arch: str):
    import transformers as tf

    common = {"vocab_size": VOCAB, "bos_token_id": 256, "eos_token_id": 257}
    llama_like = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "intermediate_size": 64, "max_position_embeddings": 64, **common}
    return {
        "gpt2": lambda: tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, **common),
        "gpt_neox": lambda: tf.GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                             intermediate_size=64, max_position_embeddings=64, **common),
        "llama": lambda: tf.LlamaConfig(**llama_like),
        "qwen2": lambda: tf.Qwen2Config(**llama_like),
    }[arch]()


KEY_MODULES = {  # the documented pick of find_key_module: the last block's feed-forward module
    "gpt2": "transformer.h.1.mlp",
    "gpt_neox": "gpt_neox.layers.1.mlp",
    "llama": "model.layers.1.mlp",
    "qwen2": "model.layers.1.mlp",
}
ARCHS = tuple(KEY_MODULES)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """One saved directory per architecture: random weights (seed 0) and the byte tokenizer."""
    from transformers import AutoModelForCausalLM

    dirs = {}
    for arch in ARCHS:
        directory = tmp_path_factory.mktemp(arch)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(tiny_config(arch)).save_pretrained(directory)
        Tokenizer.byte_level().save(directory)
        dirs[arch] = directory
    return dirs


def source(arch: str, directory) -> str:
    # A Llama directory loads into memlm's decoder by default; hf: asks for transformers.
    return f"hf:{directory}" if arch == "llama" else str(directory)


def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    rows = [{"text": f"Speech number {i}: the state of the union is strong and growing.", "year": 1990 + i}
            for i in range(8)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("arch", ARCHS)
def test_the_rule_picks_the_last_feed_forward_module(hf_dirs, arch):
    p = load_pretrained(source(arch, hf_dirs[arch]))
    assert isinstance(p.model, HFCausalLM)
    assert p.model.config.key_module == KEY_MODULES[arch]
    assert p.model.config.key_description == f"input:{KEY_MODULES[arch]}"
    assert (p.model.config.n_embd, p.model.config.vocab_size, p.model.config.max_seq_len) == (32, VOCAB, 64)


def test_the_rule_covers_mistral_and_gemma_blocks():
    import transformers as tf

    kw = {"num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 64, "vocab_size": VOCAB, "head_dim": 8}
    for config in (tf.MistralConfig(**kw), tf.GemmaConfig(**kw), tf.Gemma2Config(**kw)):
        model = tf.AutoModelForCausalLM.from_config(config)
        assert find_key_module(model, 3) == "model.layers.2.mlp"


def test_the_key_is_the_input_of_the_feed_forward_after_its_norm(hf_dirs):
    """Oracle: the same Llama weights through memlm's decoder, whose key is post_attention_layernorm's output."""
    ours = load_pretrained(hf_dirs["llama"])
    theirs = load_pretrained(f"hf:{hf_dirs['llama']}")
    assert isinstance(ours.model, Decoder) and ours.fingerprint == theirs.fingerprint
    idx = torch.tensor([ours.tokenizer.encode("the state of the union is strong")])  # (1, T)
    a, b = ours.model(idx), theirs.model(idx)
    torch.testing.assert_close(b.knn_key, a.knn_key, rtol=1e-4, atol=1e-5)  # (1, T, C)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-4, atol=1e-4)  # (1, T, V)
    # logits_from keeps the last positions only, and none at all when it is T
    assert theirs.model(idx, logits_from=3).logits.shape == (1, idx.shape[1] - 3, VOCAB)
    assert theirs.model(idx, logits_from=idx.shape[1]).logits.shape == (1, 0, VOCAB)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.attention = nn.LayerNorm(4), nn.Linear(4, 4)


class _Model(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(n))


def test_the_rule_names_what_it_looked_at():
    with pytest.raises(MemlmError, match=r"no module list of 3 blocks.*module lists: blocks \(2\).*--key-module"):
        find_key_module(_Model(2), 3)
    with pytest.raises(MemlmError, match=r"blocks\.1 has no feed-forward child \(looked at: norm, attention\)"):
        find_key_module(_Model(2), 2)


def test_key_module_override_and_its_errors(hf_dirs):
    p = load_hf_causal_lm(str(hf_dirs["gpt2"]), key_module="transformer.h.0.mlp")
    assert p.model.config.key_module == "transformer.h.0.mlp"
    default = load_hf_causal_lm(str(hf_dirs["gpt2"]))
    idx = torch.tensor([[1, 2, 3, 4]])  # (1, T)
    assert not torch.equal(p.model(idx).knn_key, default.model(idx).knn_key)  # another layer, other keys
    with pytest.raises(MemlmError, match=r"--key-module transformer.h.7.mlp: no such module.*transformer.h.0"):
        load_hf_causal_lm(str(hf_dirs["gpt2"]), key_module="transformer.h.7.mlp")
    with pytest.raises(MemlmError, match="--key-module applies to models run through transformers"):
        load_pretrained("tiny", key_module="layers.1.mlp")


def test_key_module_flag_of_datastore_build_and_eval(capsys, tmp_path, hf_dirs):
    """--key-module is recorded in the manifest, and eval with the same flag uses the datastore; without
    it the model's key is another module's and the datastore is refused in one line."""
    model, data, store = hf_dirs["gpt2"], corpus(tmp_path), tmp_path / "store"
    window = ["--context", CONTEXT, "--stride", CONTEXT // 2]
    code, _, err = run(capsys, "datastore", "build", "--model", model, "--key-module", "transformer.h.0.mlp",
                       "--data", data, "--out", store, *window, "--quiet")
    assert code == 0, err
    assert json.loads((store / "manifest.json").read_text())["key_layer"] == "input:transformer.h.0.mlp"
    code, _, err = run(capsys, "eval", "--model", model, "--key-module", "transformer.h.0.mlp", "--data", data,
                       "--datastore", store, "--lambda", "0.5", *window, "--quiet")
    assert code == 0, err
    code, _, err = run(capsys, "eval", "--model", model, "--data", data, "--datastore", store, *window, "--quiet")
    assert code == 1 and "input:transformer.h.0.mlp" in err and err.count("\n") == 1, err
    # `datastore add` reopens the model with the manifest's key module (it was refused as another key).
    more = tmp_path / "more.jsonl"
    more.write_text(json.dumps({"text": "A new speech: the union endures and the work goes on.", "year": 2001}) + "\n")
    code, _, err = run(capsys, "datastore", "add", store, "--data", more, "--quiet")
    assert code == 0, err
    assert len(Datastore.open(store).documents()) == 9


@pytest.mark.parametrize("arch", ARCHS)
def test_datastore_knnlm_lambda_zero_and_generation(capsys, tmp_path, hf_dirs, arch):
    """Each architecture builds a datastore and evaluates kNN-LM through the CLI; lambda 0 is the model's
    own perplexity exactly; kNN-LM helps on repeated text; greedy generation with a KV cache equals
    re-running the whole sequence each step."""
    model, data, store = source(arch, hf_dirs[arch]), corpus(tmp_path), tmp_path / "store"
    code, _, err = run(capsys, "datastore", "build", "--model", model, "--data", data, "--split", "year<1995",
                       "--out", store, "--context", CONTEXT, "--stride", CONTEXT // 2, "--quiet")
    assert code == 0, err
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["key_layer"] == f"input:{KEY_MODULES[arch]}" and manifest["dim"] == 32
    results = {}
    for name, extra in (("base", []), ("zero", ["--datastore", store, "--lambda", "0"]),
                        ("knn", ["--datastore", store, "--lambda", "0.5"])):
        out_json = tmp_path / f"{name}.json"
        code, _, err = run(capsys, "eval", "--model", model, "--data", data, "--split", "year>=1995",
                           "--context", CONTEXT, "--stride", CONTEXT // 2, *extra, "--quiet", "--json", out_json)
        assert code == 0, err
        results[name] = json.loads(out_json.read_text())
    assert results["zero"]["knnlm_perplexity"] == results["base"]["perplexity"]
    assert results["zero"]["base_perplexity"] == results["base"]["perplexity"]
    assert results["knn"]["knnlm_perplexity"] < results["base"]["perplexity"]

    p = load_pretrained(model)
    prompt = p.tokenizer.encode("the state")
    boundary = document_boundary(p.tokenizer)
    events = list(generate(p.model, p.tokenizer, prompt, max_new_tokens=20, sampling=SamplingConfig(temperature=0),
                           boundary_token=boundary))
    generated = [e.token_id for e in events[:-1]]
    assert events[-1].completion_tokens == len(generated) == 20
    seq = [boundary, *prompt]
    for token in generated:  # the oracle: no cache, the whole sequence every step
        with torch.inference_mode():
            logits = p.model(torch.tensor([seq])).logits[0, -1]  # (V,)
        assert int(logits[:p.tokenizer.vocab_size].argmax()) == token
        seq.append(token)


def test_a_cache_state_counts_and_refuses_to_overflow(hf_dirs):
    p = load_pretrained(str(hf_dirs["gpt2"]))
    from memlm.model.decoder import KVCache

    out = p.model(torch.tensor([[1, 2, 3]]), state=KVCache(None, 0, 4))
    assert isinstance(out.state, HFKVCache) and out.state.length == 3
    assert p.model(torch.tensor([[4]]), state=out.state).state.length == 4
    with pytest.raises(ValueError, match="KV cache full"):
        p.model(torch.tensor([[5, 6]]), state=p.model(torch.tensor([[1, 2, 3]]), state=KVCache(None, 0, 4)).state)


@pytest.mark.parametrize("arch", ("gpt2", "gpt_neox", "qwen2"))
def test_kv_bytes_per_token_is_what_transformers_cache_holds(hf_dirs, arch):
    # The LM server's KV budget (memlm.engine.kv_cache.kv_bytes_per_token) against the cache transformers fills.
    from memlm.engine.kv_cache import kv_bytes_per_token
    from memlm.model.decoder import KVCache

    p = load_pretrained(str(hf_dirs[arch]))
    tokens = 5
    state = p.model(torch.tensor([[1, 2, 3, 4, 5]]), state=KVCache(None, 0, 16)).state
    held = sum(t.numel() * t.element_size() for layer in _layers(state.past) for t in layer)
    assert kv_bytes_per_token(p.model.config, torch.float32) * tokens == held


def _layers(cache):
    """(keys, values) of each layer of a transformers Cache."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def test_memories_need_memlms_decoder(capsys, tmp_path, hf_dirs):
    p = load_pretrained(str(hf_dirs["qwen2"]))
    with pytest.raises(MemlmError, match="--memory xl needs memlm's decoder"):
        require_decoder(p.model, "--memory xl")
    data = corpus(tmp_path)
    for kind in ("xl", "compressive", "memorizing"):
        code, _, err = run(capsys, "eval", "--model", hf_dirs["qwen2"], "--data", data, "--memory", kind,
                           "--segment", "16", "--quiet")
        last = err.strip().splitlines()[-1]  # memorizing first warns that its gate is untrained
        assert code == 1 and f"--memory {kind} needs memlm's decoder" in last and "Traceback" not in err, err
    code, _, err = run(capsys, "generate", "--model", hf_dirs["qwen2"], "--memory", "xl", "--max-new-tokens", "2", "hello")
    assert code == 1 and "--memory xl needs memlm's decoder" in err and err.count("\n") == 1, err
    # the ordinary Llama directory still loads into memlm's decoder, memories and all
    assert isinstance(load_pretrained(hf_dirs["llama"]).model, Decoder)


def test_score_documents_keys_cover_every_target(hf_dirs):
    p = load_pretrained(str(hf_dirs["gpt_neox"]))
    doc = p.tokenizer.encode("x" * 100)
    scored = list(score_documents(p.model, [doc], WindowConfig(context=CONTEXT, stride=16, batch_size=3),
                                  document_boundary(p.tokenizer)))
    assert sum(len(s.targets) for s in scored) == len(doc)
    assert all(s.keys.shape == (len(s.targets), 32) for s in scored)


def test_memlm_generate_runs_a_transformers_model_on_the_engine(capsys, tmp_path, hf_dirs):
    """`memlm generate --model hf:DIR` (engine rows with their own transformers cache) = the reference decoder per
    prompt, greedy (its --memory refusal: test_memories_need_memlms_decoder)."""
    model, out = source("gpt2", hf_dirs["gpt2"]), tmp_path / "gen.json"
    code, _, err = run(capsys, "generate", "--model", model, "--max-new-tokens", 6, "--sampling-temperature", 0, "--json", out, "the state", "union")
    assert code == 0, err
    report = json.loads(out.read_text())
    p = load_pretrained(model)
    boundary = document_boundary(p.tokenizer)
    for prompt, result in zip(("the state", "union"), report["results"]):
        events = list(reference_generate(p.model, p.tokenizer, p.tokenizer.encode(prompt), max_new_tokens=6,
                                         sampling=SamplingConfig(temperature=0), boundary_token=boundary, eos_id=p.tokenizer.eos_id))
        assert result["tokens"] == [e.token_id for e in events[:-1]] and len(result["tokens"]) > 0
