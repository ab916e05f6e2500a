"""SmolLM2-135M-Instruct (Q4_1 GGUF) through transformers (gguf_file=) and through memlm's decoder: the same
kNN keys and the same kNN-LM perplexity within tolerance.

Shape legend: T tokens, C key width.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' gguf_file= loader needs it

from memlm.jobs.knnlm_eval import evaluate_knnlm
from memlm.jobs.windows import WindowConfig
from memlm.model.decoder import Decoder
from memlm.model.hf_model import HFCausalLM
from memlm.model.tokenizer import document_boundary
from memlm.model.weights import load_pretrained
from memlm.jobs.windows import exact_searcher_over_documents
from memlm.retrieval.knnlm import KNNLMConfig

TEXT = ("The Congress of the United States has the power to lay and collect taxes, to borrow money on the credit "
        "of the United States, and to regulate commerce with foreign nations and among the several states. ")


@pytest.mark.slow
def test_smollm2_through_transformers_gives_memlms_keys_and_perplexity(smollm2_gguf, smollm2_model):
    ours = smollm2_model  # load_pretrained("smollm2-135m"): that same file, loaded once (tests/conftest.py)
    theirs = load_pretrained(f"hf:{smollm2_gguf}")
    assert isinstance(ours.model, Decoder) and isinstance(theirs.model, HFCausalLM)
    assert theirs.model.config.key_module == "model.layers.29.mlp"
    assert theirs.fingerprint == ours.fingerprint  # the same file; the key names differ (input:..., ffn_input.29)
    assert theirs.model.config.key_description != ours.model.config.key_description
    tokens = ours.tokenizer.encode(TEXT)
    assert theirs.tokenizer.encode(TEXT) == tokens
    idx = torch.tensor([[document_boundary(ours.tokenizer), *tokens]])  # (1, T)
    with torch.inference_mode():
        a, b = ours.model(idx), theirs.model(idx)
    torch.testing.assert_close(b.knn_key, a.knn_key, rtol=1e-3, atol=1e-3)  # (1, T, C)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-3, atol=1e-3)  # (1, T, V)

    # kNN-LM over the text repeated: the datastore is the first copies, evaluation the last
    docs = [tokens * 2, tokens * 2]
    window = WindowConfig(context=64, stride=32, batch_size=2)
    results = []
    for p in (ours, theirs):
        boundary = document_boundary(p.tokenizer)
        store = exact_searcher_over_documents(p.model, docs[:1], window, boundary)
        results.append(evaluate_knnlm(p.model, docs[1:], store, window, KNNLMConfig(k=16, lmbda=0.25), boundary,
                                      progress=False))
    for key in ("base_perplexity", "knnlm_perplexity"):
        assert results[1][key] == pytest.approx(results[0][key], rel=1e-3)
    assert results[1]["knnlm_perplexity"] < results[1]["base_perplexity"]
