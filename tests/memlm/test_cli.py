"""The command line: user errors are one line on stderr and exit 1, never a traceback."""

import json

import pytest

from memlm.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "--model", "no-such-model", "--data", "x.txt"], "cannot load 'no-such-model'"),
        (["eval", "--model", "tiny", "--data", "/no/such/corpus.jsonl"], "corpus file not found"),
        (["fetch", "no-such-thing"], "unknown name"),
    ],
)
def test_user_errors_are_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 1
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_empty_corpus_is_a_user_error(capsys, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, _, err = run(capsys, "eval", "--model", "tiny", "--data", str(empty))
    assert code == 1 and "no documents" in err and err.count("\n") == 1


def test_context_longer_than_the_model_is_a_user_error(capsys, tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text("hello world " * 20)
    code, _, err = run(capsys, "eval", "--model", "tiny", "--data", str(text), "--context", "4096")
    assert code == 1 and "--context 4096" in err and err.count("\n") == 1


def test_eval_writes_a_json_result(capsys, tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 10)
    out_json = tmp_path / "result.json"
    code, out, _ = run(capsys, "eval", "--model", "tiny", "--data", str(text), "--context", "64", "--stride", "16",
                       "--quiet", "--json", str(out_json))
    assert code == 0
    result = json.loads(out_json.read_text())
    assert result["tokens"] == len(text.read_text().encode())  # byte tokenizer: one token per byte
    assert result["perplexity"] > 1 and "perplexity" in out


def test_datastore_build_info_and_knnlm_eval_end_to_end(capsys, tmp_path):
    """The datastore CLI wiring: build, info, and eval --datastore with tuned lambda/T."""
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"text": f"Speech number {i}: the state of the union is strong and growing.", "year": 1990 + i}
            for i in range(12)]
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    store = tmp_path / "store"
    code, out, err = run(capsys, "datastore", "build", "--model", "tiny", "--data", str(corpus), "--split",
                         "year<2000", "--out", str(store), "--context", "64", "--stride", "32", "--quiet")
    assert code == 0, err
    assert (store / "manifest.json").is_file()
    code, out, _ = run(capsys, "datastore", "info", str(store))
    assert code == 0 and "entries" in out
    # building again into a finished datastore is refused, never a silent overwrite
    code, _, err = run(capsys, "datastore", "build", "--model", "tiny", "--data", str(corpus), "--split",
                       "year<2000", "--out", str(store), "--context", "64", "--stride", "32", "--quiet")
    assert code == 1 and err.count("\n") == 1
    result_path = tmp_path / "knn.json"
    code, out, err = run(capsys, "eval", "--model", "tiny", "--data", str(corpus), "--split", "year>=2001",
                         "--context", "64", "--stride", "32", "--datastore", str(store), "--k", "8",
                         "--lambda", "auto", "--knn-temperature", "auto", "--tune-data", str(corpus),
                         "--tune-split", "year==2000", "--quiet", "--json", str(result_path))
    assert code == 0, err
    result = json.loads(result_path.read_text())
    assert result["tuned"] is True and 0.0 <= result["lambda"] <= 1.0
    # the speeches repeat one sentence: retrieval from earlier speeches must help the random tiny model
    assert result["knnlm_perplexity"] < result["base_perplexity"]


# -- no flag silently ignored, settings taken from artifacts, tuning apart from evaluation -------


def speeches(tmp_path, n=12):
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"text": f"Speech number {i}: the state of the union is strong and growing.", "year": 1990 + i}
            for i in range(n)]
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return corpus


def test_memory_none_with_a_segment_scores_each_segment_alone(capsys, tmp_path):
    """--memory none --segment S scores each segment alone, not the default sliding window."""
    from memlm.jobs.evaluate import evaluate_perplexity
    from memlm.jobs.segment_eval import evaluate_memory
    from memlm.jobs.windows import WindowConfig
    from memlm.model.memory_config import MemoryConfig
    from memlm.model.tokenizer import document_boundary
    from memlm.model.weights import load_pretrained

    text = tmp_path / "doc.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    out_json = tmp_path / "r.json"
    code, _, err = run(capsys, "eval", "--model", "tiny", "--data", str(text), "--memory", "none", "--segment", "16",
                       "--quiet", "--json", str(out_json))
    assert code == 0, err
    result = json.loads(out_json.read_text())
    tiny = load_pretrained("tiny")
    docs = [tiny.tokenizer.encode(text.read_text())]
    boundary = document_boundary(tiny.tokenizer)
    alone = evaluate_memory(tiny.model, docs, MemoryConfig("none", segment=16), boundary_token=boundary)
    window = evaluate_perplexity(tiny.model, docs, WindowConfig(64, 32), boundary, progress=False)
    assert result["segment"] == 16 and result["memory"] == "none"
    assert result["perplexity"] == pytest.approx(alone["perplexity"], rel=1e-6)
    assert result["perplexity"] != pytest.approx(window["perplexity"], rel=1e-3)  # the oracle tells them apart


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--memory", "none", "--mem-len", "64"], "--mem-len needs --memory xl or compressive"),
        (["--memory", "none", "--segment", "16", "--sink-tokens", "2"], "--sink-tokens needs --memory xl"),
        (["--memory", "xl", "--context", "64"], "--context does not apply with --memory"),
        (["--memory", "xl", "--stride", "8"], "--stride does not apply with --memory"),
        (["--memory", "xl", "--cmem-len", "8"], "--cmem-len applies to --memory compressive only"),
        (["--compress-fn", "max"], "--compress-fn needs --memory xl or compressive"),
        (["--k", "8"], "--k needs --datastore"),
        (["--lambda", "0.5"], "--lambda needs --datastore"),
        (["--knn-temperature", "2"], "--knn-temperature needs --datastore"),
        (["--nprobe", "4"], "--nprobe needs --datastore"),
        (["--exact-rerank"], "--exact-rerank needs --datastore"),
        (["--search-backend", "torch"], "--search-backend needs --datastore"),
        (["--tune-split", "year>1"], "--tune-split needs --datastore"),
        (["--allow-tune-overlap"], "--allow-tune-overlap needs --datastore"),
    ],
)
def test_a_flag_that_does_not_apply_is_refused(capsys, tmp_path, flags, message):
    text = tmp_path / "doc.txt"
    text.write_text("hello world " * 20)
    code, _, err = run(capsys, "eval", "--model", "tiny", "--data", str(text), "--quiet", *flags)
    assert code == 1 and message in err and err.count("\n") == 1, err


@pytest.fixture
def built_store(capsys, tmp_path):
    corpus = speeches(tmp_path)
    store = tmp_path / "store"
    code, _, err = run(capsys, "datastore", "build", "--model", "tiny", "--data", str(corpus), "--split",
                       "year<1996", "--out", str(store), "--context", "64", "--stride", "32", "--quiet")
    assert code == 0, err
    return corpus, store


def test_tuning_that_shares_a_document_with_the_evaluation_is_refused(capsys, tmp_path, built_store):
    """Tune "year>=2003" and evaluate "year>=2001" share the speeches of 2003 onwards."""
    corpus, store = built_store
    common = ["eval", "--model", "tiny", "--data", str(corpus), "--split", "year>=1998", "--datastore", str(store),
              "--k", "8", "--lambda", "auto", "--knn-temperature", "auto", "--tune-data", str(corpus),
              "--tune-split", "year>=2000", "--quiet"]
    code, _, err = run(capsys, *common)
    assert code == 1 and "shares 2 document(s) with the evaluation data" in err and err.count("\n") == 1, err
    out_json = tmp_path / "r.json"
    code, _, err = run(capsys, *common, "--allow-tune-overlap", "--json", str(out_json))
    assert code == 0, err
    result = json.loads(out_json.read_text())
    assert result["allow_tune_overlap"] is True and result["tune_overlap_documents"] == 2
    # disjoint splits pass and say so
    code, _, err = run(capsys, *common[:-3], "--tune-split", "1996<=year<=1997", "--quiet", "--json", str(out_json))
    assert code == 0, err
    result = json.loads(out_json.read_text())
    assert result["allow_tune_overlap"] is False and result["tune_overlap_documents"] == 0


def test_eval_takes_the_datastores_windows_or_refuses_different_ones(capsys, tmp_path, built_store):
    corpus, store = built_store
    out_json = tmp_path / "r.json"
    common = ["eval", "--model", "tiny", "--data", str(corpus), "--split", "year>=2000", "--datastore", str(store),
              "--k", "8", "--quiet"]
    code, _, err = run(capsys, *common, "--json", str(out_json))
    assert code == 0, err
    assert "taken from the datastore: --context 64, --stride 32" in err
    result = json.loads(out_json.read_text())
    assert (result["context"], result["stride"]) == (64, 32)
    code, _, err = run(capsys, *common, "--context", "128")
    assert code == 1 and "--context 128 differs from the datastore's --context 64" in err and err.count("\n") == 1


def test_datastore_info_and_results_name_the_weights(capsys, tmp_path, built_store):
    from memlm.model.config import SMOLLM2_135M, ModelConfig, describe_weights

    assert ModelConfig.from_name("smollm2-135m").name == SMOLLM2_135M == "smollm2-135m-instruct-q4_1"
    assert "SmolLM2-135M-Instruct, Q4_1-quantised" in describe_weights("smollm2-135m")
    _, store = built_store
    code, out, _ = run(capsys, "datastore", "info", str(store))
    assert code == 0 and f"weights       {describe_weights('tiny')}" in out


def test_option_groups_have_one_name_and_type_everywhere():
    """Each option has one name, dest and type on every command that takes it (--knn-temperature, --sink-tokens,
    --context), and train's sink default is the one of eval and serve."""
    from memlm.cli import build_parser
    from memlm.model.memory_config import MemoryConfig
    from memlm.cli.options import KNN_OPTIONS, MEMORY_OPTIONS, WINDOW_OPTIONS, memory_config

    parser = build_parser()
    commands = {"eval": ["eval"], "train": ["train"], "serve lm": ["serve", "lm"], "client score": ["client", "score"],
                "client generate": ["client", "generate"], "datastore build": ["datastore", "build"]}
    tables = {o.flag: o for t in (KNN_OPTIONS, MEMORY_OPTIONS, WINDOW_OPTIONS) for o in t.values()}
    attached = {}
    for name, path in commands.items():
        p = parser
        for word in path:
            p = next(a for a in p._actions if isinstance(a, type(parser._subparsers._group_actions[0]))).choices[word]
        for action in p._actions:
            for option in action.option_strings:
                if option in tables:
                    o = tables[option]
                    assert (action.dest, action.type, action.default) == (o.dest, o.type, None), (name, option)
                    attached.setdefault(option, set()).add(name)
    assert {"eval", "serve lm", "client score", "client generate"} <= attached["--knn-temperature"]
    assert {"eval", "train", "serve lm", "client score"} <= attached["--sink-tokens"]
    assert {"eval", "client score", "datastore build"} <= attached["--context"]
    train_args = parser.parse_args(["train", "--data", "x"])
    assert memory_config(train_args, MemoryConfig()).sink_tokens == MemoryConfig.sink_tokens == 4


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "lm", "--model", "tiny", "--k", "8"], "--k needs --datastore or --retrieval"),
        (["serve", "lm", "--model", "tiny", "--datastore", "x", "--lambda", "auto"], "--lambda auto is tuned by"),
        (["client", "score", "--address", "127.0.0.1:1", "--k", "8", "hi"], "--k needs --knn"),
        (["client", "score", "--address", "127.0.0.1:1", "--knn", "--lambda", "auto", "hi"], "auto is tuned by"),
        (["client", "generate", "--address", "127.0.0.1:1", "--segment", "8", "hi"], "--segment needs --memory xl"),
        (["client", "score", "--address", "127.0.0.1:1", "--memory", "none", "--sink-tokens", "2", "hi"],
         "--sink-tokens needs --memory xl"),
    ],
)
def test_serve_and_client_refuse_flags_that_do_not_apply(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 1 and message in err and err.count("\n") == 1, err


def test_eval_of_a_checkpoint_takes_its_memory_settings_or_refuses_others(capsys, tmp_path):
    """A checkpoint records how its model reads text; eval reproduces it or says no."""
    from memlm.jobs.train import TrainConfig, train
    from memlm.model.memory_config import MemoryConfig

    memory = MemoryConfig("xl", mem_len=16, sink_tokens=2, segment=16)
    docs = [[97 + (i % 26) for i in range(80)]]
    train(TrainConfig(memory=memory, steps=2, batch_size=1, log_every=0, device="cpu", out_dir=str(tmp_path / "c")),
          docs, log=lambda line: None)
    text = tmp_path / "doc.txt"
    text.write_text("abcdefghijklmnopqrstuvwxyz" * 4)
    out_json = tmp_path / "r.json"
    common = ["eval", "--model", str(tmp_path / "c"), "--data", str(text), "--quiet"]
    code, _, err = run(capsys, *common, "--json", str(out_json))
    assert code == 0, err
    assert "taken from checkpoint" in err and "--memory xl" in err and "--sink-tokens 2" in err
    result = json.loads(out_json.read_text())
    assert (result["memory"], result["segment"], result["mem_len"], result["sink_tokens"]) == ("xl", 16, 16, 2)
    code, _, err = run(capsys, *common, "--mem-len", "32")
    assert code == 1 and "--mem-len 32 differs from checkpoint" in err and err.count("\n") == 1


def test_serve_lm_takes_a_checkpoints_memory_defaults_or_refuses_others(capsys, tmp_path):
    from memlm.cli.commands import build_parser, serve_memory_defaults
    from memlm.jobs.train import TrainConfig, train
    from memlm.model.memory_config import MemoryConfig

    memory = MemoryConfig("xl", mem_len=16, sink_tokens=2, segment=16)
    train(TrainConfig(memory=memory, steps=1, batch_size=1, log_every=0, device="cpu", out_dir=str(tmp_path / "c")),
          [[97 + (i % 26) for i in range(40)]], log=lambda line: None)
    parser = build_parser()
    taken = serve_memory_defaults(parser.parse_args(["serve", "lm", "--model", str(tmp_path / "c")]))
    assert (taken.segment, taken.mem_len, taken.sink_tokens) == (16, 16, 2)
    assert "taken from checkpoint" in capsys.readouterr().err
    plain = serve_memory_defaults(parser.parse_args(["serve", "lm", "--model", "tiny"]))
    assert (plain.segment, plain.mem_len, plain.sink_tokens) == (MemoryConfig.segment, MemoryConfig.mem_len,
                                                                  MemoryConfig.sink_tokens)
    code, _, err = run(capsys, "serve", "lm", "--model", str(tmp_path / "c"), "--sink-tokens", "4")
    assert code == 1 and "--sink-tokens 4 differs from checkpoint" in err and err.count("\n") == 1


@pytest.mark.parametrize("gemm", ["mkl", "onednn"])
def test_cpu_gemm_holds_for_the_whole_command_and_is_restored(capsys, monkeypatch, gemm):
    # `memlm --cpu-gemm mkl COMMAND`: the command (a server's threads too: the choice is process-wide) runs the
    # decoder's CPU float32 Linear on F.linear (memlm.model.cpu_gemm.cpu_float32_gemm), and only that: oneDNN
    # stays on for bfloat16 / float16 matmuls.
    import torch

    import memlm.cli.commands
    from memlm.model.cpu_gemm import cpu_float32_gemm
    from memlm.model.decoder import Linear

    seen = {}

    def fake_fetch(name):
        layer = Linear(4, 3)
        x = torch.randn(2, 4)
        with torch.no_grad():
            seen["gemm"] = cpu_float32_gemm(x, layer.weight)
            seen["out"] = layer(x)
            seen["reference"] = torch.nn.functional.linear(x, layer.weight, layer.bias)
        seen["enabled"] = torch.backends.mkldnn.enabled

    assert cpu_float32_gemm(torch.randn(2, 4), torch.randn(3, 4)) is False  # grad enabled: F.linear always
    with torch.no_grad():
        before = cpu_float32_gemm(torch.randn(2, 4), torch.randn(3, 4))
    monkeypatch.setattr(memlm.cli.commands, "cmd_fetch", fake_fetch)
    code, _, _ = run(capsys, "--cpu-gemm", gemm, "fetch", "anything")
    assert code == 0
    assert seen["enabled"] is torch.backends.mkldnn.is_available()  # oneDNN itself stays on
    assert seen["gemm"] is (gemm == "onednn" and torch.backends.mkldnn.is_available())
    if gemm == "mkl":
        assert torch.equal(seen["out"], seen["reference"])  # F.linear itself, bit for bit
    with torch.no_grad():
        assert cpu_float32_gemm(torch.randn(2, 4), torch.randn(3, 4)) is before  # restored after the command
