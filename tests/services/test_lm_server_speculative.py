"""Speculative decoding through the Generate rpc, real servers on port 0: greedy Generate with
`speculative` is token-identical to greedy Generate without it (kNN-LM and the base LM drafting from the
datastore) over several prompts, with mean_accepted_tokens > 1 and searches in the finish; what cannot run is
refused naming its field.

The datastore is a real Flat datastore of the tiny model's own greedy text (REST's setting: the continuation is
in the datastore, so drafts are often right), the prompts cut from it or unrelated to it.
"""

from __future__ import annotations

import random

import grpc
import pytest

from datastore import BuildSettings, BuildSource, Datastore, build_from_tokens
from memlm.engine.drafts import SpeculativeConfig
from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import GenerationRequest
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.jobs.windows import WindowConfig
from memlm.model.tokenizer import document_boundary
from memlm.model.weights import load_pretrained
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.v1 import language_model_pb2 as lm_pb2
from services.lm.args import server_sources
from services.lm.client import (
    Finish,
    KnnRequest,
    LanguageModelClient,
    MemoryRequest,
    TextDelta,
)
from services.lm.requests import LMLimits
from services.lm.server import start_lm_server
from services.retrieval.client import RetrievalClient
from services.retrieval.server import create_retrieval_server
from services.retrieval.successors import successors_by_generation
from services.common.server import ServiceError

WINDOW = WindowConfig(64, 32, 4)
KNN = KNNLMConfig(k=8, lmbda=0.5, temperature=5.0)
LIMITS = LMLimits(max_score_tokens=400, max_step_tokens=64)
SEEDS = ["the cat sat", "once upon a time", "in the beginning", "hello world", "a b c d", "memory lane"]
NEW = 24


@pytest.fixture(scope="module")
def tiny():
    return load_pretrained("tiny")


@pytest.fixture(scope="module")
def own_text(tiny) -> list[list[int]]:
    """The tiny model's greedy continuations of SEEDS (prompt + 48 tokens each), token ids."""
    tok = tiny.tokenizer
    reqs = [GenerationRequest(tuple(tok.encode(p)), 48, SamplingConfig(temperature=0.0),
                              boundary_token=document_boundary(tok)) for p in SEEDS]
    runs = run_all(Engine(tiny.model, tok), reqs)
    return [[*r.prompt_ids, *(e.token_id for e in ev if isinstance(e, TokenEvent))] for r, ev in zip(reqs, runs)]


@pytest.fixture(scope="module")
def servers(tiny, own_text, tmp_path_factory, module_loop):
    """"spec": the own-text datastore in process with its draft source; "plain": no datastore; "remote": the
    datastore behind a real retrieval server (its Successors rpc serves pointers, not drafts)."""
    tok = tiny.tokenizer
    source = BuildSource(model_name="tiny", model_fingerprint=tiny.fingerprint, tokenizer_fingerprint=tok.fingerprint,
                         corpus="own", corpus_fingerprint="c" * 64, boundary_token=document_boundary(tok))
    out = build_from_tokens(tiny.model, own_text, tmp_path_factory.mktemp("spec") / "ds", source,
                            BuildSettings(window=WINDOW, index_factory="Flat"), progress=False, log=lambda m: None)
    store = Datastore.open(out)
    fewer = server_sources(store, remote=False, gate_dir=None, model_fingerprint="", key_layer="")
    spec = module_loop.run(start_lm_server("127.0.0.1:0", tiny, store, knn_defaults=KNN, limits=LIMITS, fewer=fewer))
    plain = module_loop.run(start_lm_server("127.0.0.1:0", tiny, limits=LIMITS))
    retrieval = module_loop.start(create_retrieval_server, "127.0.0.1:0", store,
                                  successors=successors_by_generation(lambda: (store, 0)))
    link = RetrievalClient(f"127.0.0.1:{retrieval}")
    remote = module_loop.run(start_lm_server("127.0.0.1:0", tiny, link, knn_defaults=KNN, limits=LIMITS, fewer=server_sources(
        link, remote=True, gate_dir=None, model_fingerprint="", key_layer="")))
    module_loop.servers += [spec.running.server, plain.running.server, remote.running.server]
    yield {"spec": f"127.0.0.1:{spec.running.port}", "plain": f"127.0.0.1:{plain.running.port}",
           "remote": f"127.0.0.1:{remote.running.port}"}
    link.close()


def prompts(docs: list[list[int]], n: int, seed: int = 0) -> list[list[int]]:
    """n prompts: cuts of the datastore's texts and unrelated token ids."""
    rng = random.Random(seed)
    out = [list(range(40, 46)), [120, 7, 99]]
    while len(out) < n:
        doc = rng.choice(docs)
        out.append(doc[: rng.randrange(3, len(doc) - 8)])
    return out


def run(client: LanguageModelClient, prompt, **kwargs) -> tuple[list[int], Finish]:
    ids, finish = [], None
    for event in client.generate(prompt, max_new_tokens=NEW, temperature=0.0, **kwargs):
        if isinstance(event, TextDelta):
            ids += event.token_ids
        else:
            finish = event
    return ids, finish


@pytest.mark.parametrize("knn", [KnnRequest(), None], ids=["knn-lm", "base-lm"])
def test_greedy_speculative_generate_is_token_identical_to_plain(servers, own_text, knn):
    accepted = []
    with LanguageModelClient(servers["spec"]) as client:
        for prompt in prompts(own_text, 8):
            plain, plain_end = run(client, prompt, knn=knn)
            spec, spec_end = run(client, prompt, knn=knn, speculative=True)
            assert spec == plain, prompt
            assert spec_end.completion_tokens == plain_end.completion_tokens == len(plain)
            assert plain_end.mean_accepted_tokens == 0.0 and spec_end.mean_accepted_tokens >= 1.0
            if knn is not None:  # plain kNN-LM: one search a token; a speculative row searches each verified position
                most = 1 + SpeculativeConfig().draft_tokens  # positions a pass can search
                assert plain_end.searches == len(plain) and 1 <= spec_end.searches <= most * len(plain)
            accepted.append(spec_end.mean_accepted_tokens)
        one, _ = run(client, prompts(own_text, 3)[2], knn=knn, speculative=True, draft_tokens=1)
        assert one == run(client, prompts(own_text, 3)[2], knn=knn)[0]
    assert sum(accepted) / len(accepted) > 1.0, accepted  # drafts were accepted: fewer passes than tokens


def refusal(address: str, **kwargs) -> ServiceError:
    with LanguageModelClient(address) as client, pytest.raises(ServiceError) as e:
        run(client, [40, 41, 42], **kwargs)
    return e.value


def test_refusals_name_their_field(servers):
    for name, knn in (("plain", None), ("remote", KnnRequest())):  # no datastore; one through a retrieval service
        e = refusal(servers[name], speculative=True, knn=knn)
        assert e.code == grpc.StatusCode.FAILED_PRECONDITION and e.details.startswith("speculative:"), e.details
    e = refusal(servers["spec"], speculative=True, memory_mode="xl", memory=MemoryRequest(segment_tokens=16))
    assert e.code == grpc.StatusCode.UNIMPLEMENTED and "speculative" in e.details and "xl" in e.details
    e = refusal(servers["spec"], speculative=True, knn=KnnRequest(attribution_top_n=2))
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "speculative" in e.details
    e = refusal(servers["spec"], draft_tokens=3)
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "draft_tokens" in e.details
    e = refusal(servers["spec"], speculative=True, draft_tokens=LIMITS.max_step_tokens)
    assert e.code == grpc.StatusCode.OUT_OF_RANGE and "draft_tokens" in e.details
    e = refusal(servers["spec"], draft_from="history")
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "draft_from" in e.details


@pytest.mark.parametrize(("name", "knn"), [("plain", None), ("remote", KnnRequest())], ids=["no-datastore", "remote"])
def test_history_drafts_need_no_datastore_in_the_server(servers, own_text, name, knn):
    """draft_from history reads only the row's own text: a server without a datastore (base LM), or whose datastore is
    behind a retrieval service (kNN-LM), serves it, token-identical to plain Generate."""
    with LanguageModelClient(servers[name]) as client:
        for prompt in prompts(own_text, 4):
            plain, _ = run(client, prompt, knn=knn)
            spec, end = run(client, prompt, knn=knn, speculative=True, draft_from="history")
            assert spec == plain and end.mean_accepted_tokens >= 1.0, prompt


@pytest.mark.parametrize("source", ["history", "both", "datastore"])
@pytest.mark.parametrize("knn", [KnnRequest(), None], ids=["knn-lm", "base-lm"])
def test_greedy_generate_with_each_draft_source_is_token_identical(servers, own_text, source, knn):
    """GenerateRequest.draft_from reaches the engine: the same tokens as plain Generate, drafts verified; a
    base-LM row drafting from its own text alone never searches (from the datastore it does)."""
    searches = 0
    with LanguageModelClient(servers["spec"]) as client:
        for prompt in prompts(own_text, 4):
            plain, _ = run(client, prompt, knn=knn)
            spec, end = run(client, prompt, knn=knn, speculative=True, draft_from=source)
            assert spec == plain and end.mean_accepted_tokens >= 1.0, prompt
            searches += end.searches
    if knn is None:
        assert (searches == 0) == (source == "history"), searches


def test_draft_from_on_the_wire():
    """Every SpeculativeConfig source has its DraftFrom value and back; unset = the default; an unknown value and
    the field without speculative are refused naming it."""
    from memlm.engine.drafts import DRAFT_FROM
    from services.lm.args import FewerSources, speculative_of
    from services.lm.client import DRAFT_FROM_VALUES
    from services.common.server import InvalidRequest

    assert set(DRAFT_FROM_VALUES) == set(DRAFT_FROM)
    assert sorted(DRAFT_FROM_VALUES.values()) == [v for v in lm_pb2.DraftFrom.values() if v]  # all of the enum
    fewer = FewerSources(drafts=lambda: None)
    for name, value in DRAFT_FROM_VALUES.items():
        got = speculative_of(lm_pb2.GenerateRequest(speculative=True, draft_from=value), None, 0, fewer, 64, True)
        assert got.draft_from == name
    unset = speculative_of(lm_pb2.GenerateRequest(speculative=True), None, 0, fewer, 64, True)
    assert unset.draft_from == SpeculativeConfig().draft_from
    with pytest.raises(InvalidRequest, match="draft_from"):
        speculative_of(lm_pb2.GenerateRequest(speculative=True, draft_from=9), None, 0, fewer, 64, True)
    with pytest.raises(InvalidRequest, match="draft_from"):
        speculative_of(lm_pb2.GenerateRequest(draft_from=lm_pb2.DRAFT_FROM_HISTORY), None, 0, fewer, 64, True)


def test_sampled_speculative_generate_runs_to_its_length(servers, own_text):
    """Sampled rows verify too (memlm.engine.speculative's exact rule; the distribution is the engine tests'):
    a seeded call makes its tokens, reproducibly."""
    with LanguageModelClient(servers["spec"]) as client:
        calls = [[e for e in client.generate(own_text[0][:6], max_new_tokens=NEW, temperature=1.0, seed=3,
                                             knn=KnnRequest(), speculative=True)] for _ in range(2)]
    ends = [c[-1] for c in calls]
    assert all(isinstance(f, Finish) and f.mean_accepted_tokens >= 1.0 for f in ends)
    assert all((f.reason, f.completion_tokens) == ("length", NEW) or f.reason == "eos" for f in ends)
    assert [d.token_ids for d in calls[0][:-1]] == [d.token_ids for d in calls[1][:-1]]


def test_negative_draft_tokens_and_the_default_on_the_wire():
    """draft_tokens < 0 is refused (the client sends only >= 1); 0 is SpeculativeConfig's default."""
    from memlm.errors import MemlmError
    from services.lm.args import NO_FEWER, FewerSources, speculative_of
    from services.common.server import InvalidRequest

    fewer = FewerSources(drafts=lambda: None)
    assert speculative_of(lm_pb2.GenerateRequest(speculative=True), None, 0, fewer, 64, True) == SpeculativeConfig()
    got = speculative_of(lm_pb2.GenerateRequest(speculative=True, draft_tokens=7), None, 0, fewer, 64, True)
    assert got.draft_tokens == 7
    with pytest.raises(InvalidRequest, match="draft_tokens"):
        speculative_of(lm_pb2.GenerateRequest(speculative=True, draft_tokens=-1), None, 0, fewer, 64, True)
    default = SpeculativeConfig().draft_tokens  # the default is bounded by the step too, not only a sent value
    with pytest.raises(InvalidRequest, match="draft_tokens"):
        speculative_of(lm_pb2.GenerateRequest(speculative=True), None, 0, fewer, default, True)
    with pytest.raises(InvalidRequest, match="speculative"):  # a transformers model: not on the engine
        speculative_of(lm_pb2.GenerateRequest(speculative=True), None, 0, fewer, 64, False)
    with pytest.raises(InvalidRequest, match="speculative"):
        speculative_of(lm_pb2.GenerateRequest(speculative=True), None, 0, NO_FEWER, 64, True)

    def no_provenance():
        raise MemlmError("datastore d has format version 2, without each entry's document and position")

    with pytest.raises(InvalidRequest, match="speculative") as e:  # refused before the stream, not mid-call
        speculative_of(lm_pb2.GenerateRequest(speculative=True), None, 0, FewerSources(drafts=no_provenance), 64, True)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "position" in str(e.value)


def test_memlm_client_generate_speculative(servers, capsys):
    """`memlm client generate --speculative --draft-tokens N`: the same text as without, and the finish line
    reports searches and mean_accepted_tokens."""
    from memlm.cli import main

    base = ["client", "generate", "--address", servers["spec"], "--knn", "--temperature", "0", "--max-new-tokens", "12"]
    assert main([*base, "the cat sat"]) == 0
    plain = capsys.readouterr()
    assert main([*base, "--speculative", "--draft-tokens", "3", "the cat sat"]) == 0
    spec = capsys.readouterr()
    assert spec.out == plain.out and "searches 12" in plain.err and "mean_accepted_tokens" not in plain.err
    assert "searches" in spec.err and "mean_accepted_tokens" in spec.err, spec.err
    assert main(["client", "generate", "--address", servers["spec"], "--draft-tokens", "3", "hi"]) != 0
    assert "draft_tokens" in capsys.readouterr().err
    assert main([*base, "--speculative", "--draft-from", "history", "the cat sat"]) == 0
    assert capsys.readouterr().out == plain.out
    # --draft-from travels: the base LM drafting from its own text makes no search, from the datastore it does.
    lm = ["client", "generate", "--address", servers["spec"], "--temperature", "0", "--max-new-tokens", "12",
          "--speculative"]
    assert main([*lm, "--draft-from", "history", "the cat sat"]) == 0
    assert "searches" not in capsys.readouterr().err
    assert main([*lm, "--draft-from", "datastore", "the cat sat"]) == 0
    assert "searches" in capsys.readouterr().err
