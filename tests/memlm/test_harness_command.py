"""memlm as an lm-evaluation-harness model, offline: a loglikelihood_rolling perplexity task
and a multiple-choice task over local jsonl files (YAML tasks in tmp_path); `--model memlm` with no datastore
equals lm-eval's own `hf` model on the same weights, and kNN-LM lowers the word perplexity."""

from __future__ import annotations

import json

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from lm_eval.tasks import TaskManager

from memlm.cli.harness import MemlmLM
from memlm.model.tokenizer import Tokenizer

SPEECH = "the state of the union is strong and growing, and the people are free. "


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = tmp_path_factory.mktemp("harness")
    model_dir = tmp / "llama"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=64, max_position_embeddings=256, vocab_size=260, bos_token_id=256,
                                 eos_token_id=257, tie_word_embeddings=False)).save_pretrained(model_dir)
    Tokenizer.byte_level().save(model_dir)
    docs = tmp / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"Speech {i}: " + SPEECH * 2}) + "\n" for i in range(4)))
    mc = tmp / "mc.jsonl"
    mc.write_text("".join(json.dumps({"question": f"Speech {i}: the state of the union is",
                                      "choices": [" strong", " weak", " blue"], "answer": 0}) + "\n" for i in range(3)))
    tasks = tmp / "tasks"
    tasks.mkdir()
    common = "dataset_path: json\ntest_split: test\n"
    (tasks / "rolling.yaml").write_text(
        f"task: memlm_rolling\n{common}dataset_kwargs:\n  data_files:\n    test: {docs}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    (tasks / "mc.yaml").write_text(
        f"task: memlm_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {mc}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    store = tmp / "store"
    from datastore import build_datastore

    build_datastore(str(model_dir), str(docs), store, context=64, stride=32, progress=False)
    # include_defaults=False: only these two tasks, not an index of the harness's thousands of built-in YAMLs (seconds).
    return {"model": model_dir, "tasks": TaskManager(include_path=str(tasks), include_defaults=False), "store": store}


def run(setup, model, tasks=("memlm_rolling", "memlm_mc")) -> dict:
    out = lm_eval.simple_evaluate(model=model, tasks=list(tasks), task_manager=setup["tasks"], batch_size=2,
                                  device="cpu")
    return out["results"]


def test_memlm_equals_lm_evals_hf_model_and_knnlm_lowers_word_perplexity(setup):
    # every document fits one window of both (about 155 tokens < 256): the same conditioning token by token
    ours = run(setup, MemlmLM(pretrained=str(setup["model"]), context=256, stride=128, batch_size=2))
    from lm_eval.models.huggingface import HFLM

    theirs = run(setup, HFLM(pretrained=str(setup["model"]), prefix_token_id=256, dtype="float32", max_length=256, device="cpu",
                             batch_size=2))
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["memlm_rolling"][metric] == pytest.approx(theirs["memlm_rolling"][metric], rel=1e-4), metric
    assert ours["memlm_mc"]["acc,none"] == theirs["memlm_mc"]["acc,none"]
    knn = run(setup, MemlmLM(pretrained=str(setup["model"]), datastore=str(setup["store"]), lmbda=0.5, k=8,
                             batch_size=2), tasks=("memlm_rolling",))
    assert knn["memlm_rolling"]["word_perplexity,none"] < ours["memlm_rolling"]["word_perplexity,none"]


def test_generate_until_stops_before_the_stop_string(setup):
    from lm_eval.api.instance import Instance

    lm = MemlmLM(pretrained=str(setup["model"]))
    free = lm.generate_until([Instance("generate_until", {}, ("the state", {"max_gen_toks": 12}), 0)])[0]
    assert len(free.encode()) <= 12 * 4 and free
    stop = free[4:6]
    cut = lm.generate_until([Instance("generate_until", {}, ("the state", {"max_gen_toks": 12, "until": [stop]}), 0)])
    assert cut == [free[: free.index(stop)]]
