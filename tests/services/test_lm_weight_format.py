"""The LM server in a weight format: GetInfo reports the format and compute dtype, Generate answers in it, a
datastore whose keys came from another format is refused at load, and the OpenAI front's /v1/models entry
carries the format GetInfo reports."""

from __future__ import annotations

import pytest
import torch

from memlm.errors import MemlmError
from memlm.jobs.windows import WindowConfig, exact_searcher_over_documents
from memlm.model.tokenizer import document_boundary
from memlm.model.weights import load_pretrained
from memlm.v1 import language_model_pb2 as lm_pb2
from services.lm.client import LanguageModelClient
from services.lm.server import create_lm_server
from services.openai_front.server import model_entry


@pytest.fixture(scope="module")
def int8_tiny():
    return load_pretrained("tiny", dtype=torch.bfloat16, weights="int8")


def test_get_info_reports_the_weight_format_and_generate_runs_in_it(int8_tiny, loop_thread):
    port = loop_thread.start(create_lm_server, "127.0.0.1:0", int8_tiny, model_name="tiny")
    with LanguageModelClient(f"127.0.0.1:{port}", timeout=60) as c:
        info = c.info()
        assert (info.weights, info.compute_dtype) == ("int8", "bfloat16")
        assert info.model_fingerprint == int8_tiny.fingerprint  # the same weights, in another format
        events = list(c.generate("the lazy dog", max_new_tokens=4, temperature=0.0))
    assert events and events[-1].completion_tokens == 4


def test_a_datastore_of_another_format_is_refused_at_load(int8_tiny, loop_thread):
    tok = int8_tiny.tokenizer
    float_model = load_pretrained("tiny").model
    keys_of_float32 = exact_searcher_over_documents(
        float_model, [tok.encode("the quick brown fox " * 4)], WindowConfig(48, 24, 4), document_boundary(tok),
        model_fingerprint=int8_tiny.fingerprint, tokenizer_fingerprint=tok.fingerprint)
    assert keys_of_float32.info().weights == "float32"
    with pytest.raises(MemlmError, match="computed with --weights float32, the model runs --weights int8"):
        loop_thread.start(create_lm_server, "127.0.0.1:0", int8_tiny, keys_of_float32)


def test_the_openai_model_entry_names_the_format():
    info = lm_pb2.LanguageModelServiceGetInfoResponse(model="tiny", weights="int4", compute_dtype="bfloat16")
    entry = model_entry("tiny", info)
    assert entry["id"] == "tiny" and entry["object"] == "model"
    assert (entry["weights"], entry["compute_dtype"]) == ("int4", "bfloat16")
