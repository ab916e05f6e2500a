"""memlm.retrieval.compat: the one check between a datastore's info and the model and layout in use."""

from __future__ import annotations

import dataclasses

import pytest

from memlm.errors import MemlmError
from memlm.retrieval.compat import adopt, check_searcher
from memlm.retrieval.searcher import SearcherInfo

INFO = SearcherInfo(
    n=10, dim=64, index="Flat", metric="l2", nprobe=1, key_layer="ffn_input.1", model_name="tiny",
    model_fingerprint="m" * 64, tokenizer_fingerprint="t" * 64, corpus="c", corpus_fingerprint="c" * 64,
    context=64, stride=32, boundary_token=256, sink_tokens=0,
)
OURS = dict(model_fingerprint="m" * 64, tokenizer_fingerprint="t" * 64, dim=64, key_layer="ffn_input.1",
            boundary_token=256)


def test_a_matching_datastore_passes():
    check_searcher(INFO, **OURS)
    check_searcher(INFO, **OURS, context=64, stride=32)


@pytest.mark.parametrize(
    "ours, message",
    [
        (dict(model_fingerprint="x" * 64), "different model fingerprint"),
        (dict(tokenizer_fingerprint="x" * 64), "different tokenizer fingerprint"),
        (dict(dim=32), "dimension 64, the model's 32"),
        (dict(key_layer="final_hidden"), "keys are ffn_input.1"),
        (dict(boundary_token=1), "start with token 256"),
        (dict(context=128), "--context 128 differs"),
        (dict(stride=16), "--stride 16 differs"),
        (dict(weights="int8"), "computed with --weights float32, the model runs --weights int8"),
    ],
)
def test_each_difference_is_refused_in_one_line(ours, message):
    with pytest.raises(MemlmError, match=message) as e:
        check_searcher(INFO, **{**OURS, **ours})
    assert "\n" not in str(e.value)


def test_another_weight_format_passes_only_when_accepted():
    """Keys of another format are only close to the queries': refused unless the caller accepts it."""
    int4 = dataclasses.replace(INFO, weights="int4")
    check_searcher(int4, **OURS, weights="int4")
    check_searcher(int4, **OURS, accept_weights_mismatch=True)
    with pytest.raises(MemlmError, match="--accept-weights-mismatch"):
        check_searcher(int4, **OURS)


def test_adopt_takes_an_unset_setting_and_refuses_a_different_one():
    taken: list[str] = []
    assert adopt("--context", None, 64, "the datastore", taken) == 64 and taken == ["--context 64"]
    assert adopt("--context", 64, 64, "the datastore", taken) == 64 and taken == ["--context 64"]
    with pytest.raises(MemlmError, match="--context 128 differs from the datastore's --context 64"):
        adopt("--context", 128, 64, "the datastore", taken)


def test_info_fields_the_check_reads_exist():
    fields = {f.name for f in dataclasses.fields(SearcherInfo)}
    assert {"model_fingerprint", "tokenizer_fingerprint", "dim", "key_layer", "boundary_token", "context",
            "stride"} <= fields
