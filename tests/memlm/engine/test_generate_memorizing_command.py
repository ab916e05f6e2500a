"""`memlm generate --memory memorizing` runs on the engine: over a `memlm train --memory
memorizing` checkpoint it takes the checkpoint's layer, sizes and trained kNN attention (a different --knn-layer is
refused in one line); any other model gets a fresh gate, said on stderr and recorded in --json. Oracle:
the reference decoder with the same MemoryConfig and KnnAttention."""

from __future__ import annotations

import json

import torch

from memlm.cli import main
from reference_decoding import reference_generate
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.model.memory_config import MemoryConfig
from memlm.memory.memorizing import (
    load_knn_attention,
    new_knn_attention,
    save_knn_attention,
)
from memlm.model.checkpoint import TextSettings, save_checkpoint
from memlm.model.tokenizer import document_boundary
from memlm.model.weights import load_pretrained

PROMPT = "a prompt longer than one segment of the memory, so that the kNN memory fills"


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def library_tokens(pre, memory: MemoryConfig, knn_attention, n: int) -> list[int]:
    tok = pre.tokenizer
    events = reference_generate(pre.model, tok, tok.encode(PROMPT), max_new_tokens=n, sampling=SamplingConfig(temperature=0.0),
                                boundary_token=document_boundary(tok), eos_id=tok.eos_id, memory=memory,
                                knn_attention=knn_attention)
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def test_a_memorizing_checkpoint_generates_with_its_layer_and_gate(capsys, tmp_path) -> None:
    tiny = load_pretrained("tiny")
    memory = MemoryConfig("memorizing", segment=8, mem_len=8, sink_tokens=2, knn_layer=0, knn_mem_size=64, knn_top_k=4,
                          knn_backend="exact")
    module = new_knn_attention(tiny.model.config)
    with torch.no_grad():
        module.gate_logit.copy_(torch.linspace(-1.0, 1.0, module.n_head))  # a "trained" gate, open
    ckpt = save_checkpoint(tmp_path / "ckpt", tiny.model, tiny.tokenizer,
                           settings=TextSettings(document_boundary(tiny.tokenizer), memory),
                           write_files=lambda d: save_knn_attention(module, d))
    out_json = tmp_path / "m.json"
    code, _, err = run(capsys, "generate", "--model", str(ckpt), "--memory", "memorizing", "--max-new-tokens", "30",
                         "--sampling-temperature", "0", "--json", str(out_json), PROMPT)
    assert code == 0, err
    result = json.loads(out_json.read_text())
    pre = load_pretrained(str(ckpt))
    want = library_tokens(pre, memory, load_knn_attention(ckpt), 30)
    assert result["results"][0]["tokens"] == want
    assert want != library_tokens(pre, MemoryConfig("xl", segment=8, mem_len=8, sink_tokens=2), None, 30)
    recorded = result["settings"]["memorizing"]
    assert (recorded["knn_layer"], recorded["knn_mem_size"], recorded["gate_trained"]) == (0, 64, True)
    assert recorded["mean_gate"] == torch.sigmoid(module.gate_logit).tolist()
    code, _, err = run(capsys, "generate", "--model", str(ckpt), "--memory", "memorizing", "--knn-layer", "1", PROMPT)
    assert code == 1 and "--knn-layer" in err and err.count("\n") == 1, err


def test_any_other_model_gets_a_fresh_gate_said_and_recorded(capsys, tmp_path) -> None:
    out_json = tmp_path / "f.json"
    code, _, err = run(capsys, "generate", "--model", "tiny", "--memory", "memorizing", "--segment", "8", "--mem-len",
                       "8", "--knn-layer", "1", "--knn-mem-size", "32", "--knn-top-k", "4", "--max-new-tokens", "30",
                       "--sampling-temperature", "0", "--json", str(out_json), PROMPT)
    assert code == 0, err
    assert "no trained kNN attention" in err
    tiny = load_pretrained("tiny")
    memory = MemoryConfig("memorizing", segment=8, mem_len=8, knn_layer=1, knn_mem_size=32, knn_top_k=4)
    result = json.loads(out_json.read_text())
    assert result["results"][0]["tokens"] == library_tokens(tiny, memory, new_knn_attention(tiny.model.config), 30)
    assert result["settings"]["memorizing"]["gate_trained"] is False and result["settings"]["knn_mem_size"] == 32
