"""`memlm generate`: prompts as one batch through the engine, --json tokens and log-probs, kNN-LM over a
built datastore, XL memory, and one-line refusals."""

from __future__ import annotations

import json

import pytest

from memlm.cli import main
from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.model.tokenizer import document_boundary
from memlm.model.weights import load_pretrained


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's usage errors (exit 2, one line: memlm.cli.OneLineErrors)
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def engine_tokens(prompts: list[str], n: int, sampling: SamplingConfig) -> list[list[int]]:
    tiny = load_pretrained("tiny")
    tok = tiny.tokenizer
    reqs = [GenerationRequest(tuple(tok.encode(p)), n, sampling, boundary_token=document_boundary(tok),
                              eos_id=tok.eos_id) for p in prompts]
    results = run_all(Engine(tiny.model, tok, EngineConfig(max_batch=1)), reqs)
    return [[e.token_id for e in events if isinstance(e, TokenEvent)] for events in results]


def test_prompts_run_as_one_batch_and_json_has_tokens_and_logprobs(capsys, tmp_path) -> None:
    out_json = tmp_path / "g.json"
    prompts = ["hello world", "the cat sat", "x"]
    code, out, err = run(capsys, "generate", "--model", "tiny", "--max-new-tokens", "9", "--sampling-temperature",
                         "0.8", "--seed", "11", "--json", str(out_json), *prompts)
    assert code == 0, err
    assert "tokens/s" in out and out.count("--- [") == 3 and "batch 3" in out
    result = json.loads(out_json.read_text())
    got = [r["tokens"] for r in result["results"]]
    # One at a time through the engine with the same seed: the same tokens as the batch of three.
    assert got == engine_tokens(prompts, 9, SamplingConfig(temperature=0.8, seed=11))
    for r in result["results"]:
        assert len(r["logprobs"]) == len(r["tokens"]) == r["completion_tokens"] == 9
        assert all(lp <= 0 for lp in r["logprobs"]) and r["logprobs"] == r["base_logprobs"]
        assert r["finish_reason"] == "length"
    assert result["settings"]["seed"] == 11 and result["tokens_per_s"] > 0


def test_knn_lm_over_a_built_datastore_and_xl_memory(capsys, tmp_path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"Speech {i}: the union is strong."}) for i in range(6)) + "\n")
    store = tmp_path / "store"
    code, _, err = run(capsys, "datastore", "build", "--model", "tiny", "--data", str(corpus), "--out", str(store),
                       "--context", "64", "--stride", "32", "--quiet")
    assert code == 0, err
    out_json = tmp_path / "knn.json"
    code, out, err = run(capsys, "generate", "--model", "tiny", "--datastore", str(store), "--k", "8", "--lambda",
                         "0.9", "--knn-temperature", "1", "--sampling-temperature", "0", "--max-new-tokens", "6",
                         "--json", str(out_json), "Speech", "the union")
    assert code == 0, err
    results = json.loads(out_json.read_text())["results"]
    assert all(r["logprobs"] != r["base_logprobs"] for r in results)  # the mixture, not the base LM
    # --search-backend torch: exact search over the float16 keys on the model's device, the Flat index's neighbours
    code, out, err = run(capsys, "generate", "--model", "tiny", "--datastore", str(store), "--k", "8", "--lambda",
                         "0.9", "--knn-temperature", "1", "--sampling-temperature", "0", "--max-new-tokens", "6",
                         "--search-backend", "torch", "--json", str(out_json), "Speech", "the union")
    assert code == 0, err
    torch_results = json.loads(out_json.read_text())["results"]
    assert [r["tokens"] for r in torch_results] == [r["tokens"] for r in results]
    for a, b in zip(torch_results, results):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)
    code, out, err = run(capsys, "generate", "--model", "tiny", "--memory", "xl", "--segment", "4", "--mem-len", "8",
                         "--max-new-tokens", "30", "--sampling-temperature", "0", "a long prompt past one segment")
    assert code == 0, err
    assert "30 tokens" in out


def test_compressive_memory_equals_the_library(capsys, tmp_path) -> None:
    from reference_decoding import reference_generate
    from memlm.model.memory_config import MemoryConfig

    out_json, prompt = tmp_path / "c.json", "a long prompt past a few segments of memory"
    code, _, err = run(capsys, "generate", "--model", "tiny", "--memory", "compressive", "--segment", "4", "--mem-len",
                       "6", "--cmem-len", "3", "--compress-rate", "2", "--sink-tokens", "2", "--max-new-tokens", "40",
                       "--sampling-temperature", "0", "--json", str(out_json), prompt)
    assert code == 0, err
    tiny = load_pretrained("tiny")
    memory = MemoryConfig("compressive", mem_len=6, cmem_len=3, compress_rate=2, sink_tokens=2, segment=4)
    events = reference_generate(tiny.model, tiny.tokenizer, tiny.tokenizer.encode(prompt), max_new_tokens=40,
                                sampling=SamplingConfig(temperature=0.0), boundary_token=document_boundary(tiny.tokenizer),
                                eos_id=tiny.tokenizer.eos_id, memory=memory)
    (result,) = json.loads(out_json.read_text())["results"]
    assert result["tokens"] == [e.token_id for e in events if isinstance(e, TokenEvent)]


@pytest.mark.parametrize(("flags", "message"), [
    (["--segment", "8"], "--segment needs --memory xl"),
    (["--k", "8"], "--k needs --datastore or --retrieval"),
    (["--retrieval", "b:1", "--search-backend", "torch"], "--search-backend needs --datastore"),
    (["--datastore", "a", "--retrieval", "b:1"], "not both"),
    (["--memory", "spalm"], "invalid choice"),
    (["--memory", "xl", "--knn-top-k", "4"], "--knn-top-k applies to --memory memorizing only, not xl"),
    (["--knn-service", "a:1"], "--knn-service needs --memory memorizing --knn-backend service"),
    (["--memory", "memorizing", "--knn-backend", "service"], "needs --knn-service HOST:PORT"),
    (["--memory", "xl", "--cmem-len", "4"], "--cmem-len needs --memory compressive"),
    (["--memory", "compressive", "--compress-fn", "conv"], "pooling"),
    (["--top-p", "1.5", "--sampling-temperature", "1"], "top_p must be in (0, 1]"),
])
def test_refusals_are_one_line(capsys, flags, message) -> None:
    code, _, err = run(capsys, "generate", "--model", "tiny", *flags, "hello")
    assert code in (1, 2) and message in err and err.count("\n") == 1, err


def test_cuda_graphs_flag_gives_the_same_tokens(capsys, tmp_path) -> None:
    # --cuda-graphs on a CPU runs the fixed-shape decode step eagerly (memlm.engine.decode_graphs): same tokens
    prompts = ["hello world", "the cat sat", "x"]
    out_json = tmp_path / "g.json"
    code, _, err = run(capsys, "generate", "--model", "tiny", "--max-new-tokens", "9", "--sampling-temperature",
                       "0.8", "--seed", "11", "--cuda-graphs", "--json", str(out_json), *prompts)
    assert code == 0, err
    got = [r["tokens"] for r in json.loads(out_json.read_text())["results"]]
    assert got == engine_tokens(prompts, 9, SamplingConfig(temperature=0.8, seed=11))
    code, _, err = run(capsys, "generate", "--model", "tiny", "--memory", "xl", "--cuda-graphs", "hi")
    assert code != 0 and "plain KV cache" in err
