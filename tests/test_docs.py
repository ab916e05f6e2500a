"""The documentation against the code: the generated command reference holds every subcommand and flag of
the parser, every `memlm ...` command written in README.md or docs/ parses with flags that exist, and the
gRPC page lists every rpc and message of proto/."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from memlm.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def _load_hooks():
    spec = importlib.util.spec_from_file_location("memlm_docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = _load_hooks()


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("memlm",)):
    """(path, parser) for the parser and every subcommand below it."""
    yield path, parser
    for name, _help, sub in hooks._subparsers(parser):
        yield from _commands(sub, path + (name,))


def _sections(markdown: str) -> dict[str, str]:
    """Command path ('memlm datastore build') -> the text of its section in the rendered reference."""
    parts = re.split(r"^#+ `([^`]+)`\n", markdown, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _assert_reference_complete(parser: argparse.ArgumentParser) -> None:
    sections = _sections(hooks.render_cli(parser))
    for path, sub in _commands(parser):
        name = " ".join(path)
        assert name in sections, f"{name} has no section in the command reference"
        for action in sub._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            for option in action.option_strings:
                assert f"`{option}`" in sections[name], f"{name} {option} is missing from the command reference"
            if not action.option_strings:
                assert f"`{action.metavar or action.dest}` (positional)" in sections[name], (
                    f"{name}: positional {action.dest} is missing from the command reference")


def test_cli_reference_has_every_subcommand_and_flag():
    _assert_reference_complete(build_parser())


def test_cli_reference_follows_the_parser():
    # The reference is made from the parser, not kept beside it: a flag and a subcommand added to the
    # parser appear in it, and the completeness check above would catch a renderer that dropped them.
    parser = build_parser()
    eval_parser = dict((n, p) for n, _h, p in hooks._subparsers(parser))["eval"]
    eval_parser.add_argument("--zz-new-flag", type=int, default=3, help="a flag the docs never mentioned")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub.add_parser("zz-new-command", help="a command the docs never mentioned").add_argument("--zz-only-here")
    sections = _sections(hooks.render_cli(parser))
    assert "`--zz-new-flag`" in sections["memlm eval"] and "default `3`" in sections["memlm eval"]
    assert "`--zz-only-here`" in sections["memlm zz-new-command"]
    assert "`--zz-only-here`" not in sections["memlm eval"]
    _assert_reference_complete(parser)


# ----------------------------------------------------------------------------- commands written in the docs

def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _shell_commands(text: str):
    """Each `memlm ...` command line of the shell code blocks of a Markdown text, continuations joined."""
    for block in re.findall(r"^```(?:bash|sh|shell|console)\n(.*?)^```", text, flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith(("memlm ", ".venv/bin/memlm ")):
                yield line


def _check_command(parser: argparse.ArgumentParser, line: str) -> list[str]:
    """Problems of one written command: unknown subcommands or flags (values and placeholders pass)."""
    tokens = shlex.split(line, comments=True)[1:]
    current, path, problems, takes_value = parser, ["memlm"], [], False
    for tok in tokens:
        if takes_value:  # the value of the flag before
            takes_value = False
            continue
        if tok in ("...", "|", "&&", ";", ">", "&") or tok.startswith(("[", "<")):
            if tok in ("|", "&&", ";"):
                break
            continue
        subs = {n: p for n, _h, p in hooks._subparsers(current)}
        if tok.startswith("--"):
            flag = tok.split("=", 1)[0]
            action = current._option_string_actions.get(flag)
            if action is None:
                problems.append(f"{' '.join(path)}: no flag {flag}")
            takes_value = action is not None and action.nargs != 0 and "=" not in tok
        elif subs and not tok.startswith("-"):
            if tok not in subs:
                problems.append(f"{' '.join(path)}: no subcommand {tok}")
                break
            current = subs[tok]
            path.append(tok)
    if hooks._subparsers(current) and not problems:
        problems.append(f"{' '.join(path)}: a subcommand is missing")
    return problems


def test_every_documented_command_uses_existing_subcommands_and_flags():
    parser = build_parser()
    problems = []
    for f in _doc_files():
        for line in _shell_commands(f.read_text()):
            problems += [f"{f.relative_to(ROOT)}: {p}  [{line}]" for p in _check_command(parser, line)]
    assert not problems, "\n".join(problems)


def test_the_command_check_catches_a_wrong_flag():
    parser = build_parser()
    assert _check_command(parser, "memlm eval --model tiny --data sotu") == []
    assert _check_command(parser, "memlm --cpu-gemm mkl serve lm --model tiny") == []
    assert _check_command(parser, "memlm eval --model tiny --no-such-flag 3")
    assert _check_command(parser, "memlm datastore frobnicate DIR")
    assert _check_command(parser, "memlm serve --port 1")


# ----------------------------------------------------------------------------- gRPC

@pytest.mark.parametrize("proto", sorted((ROOT / "proto" / "memlm" / "v1").glob("*.proto")), ids=lambda p: p.name)
def test_grpc_page_lists_every_rpc_and_message(proto):
    page = hooks.render_proto()
    text = proto.read_text()
    names = re.findall(r"^\s*(?:rpc|message|service|enum)\s+(\w+)", text, flags=re.M)
    assert names, f"{proto.name} declares nothing"
    for name in names:
        assert f"`{name}" in page, f"{proto.name}: {name} is missing from the gRPC page"
    assert text.splitlines()[-1].strip() in page  # the file is included whole


def test_nav_pages_exist():
    nav = re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    generated = {hooks.CLI_PAGE, hooks.GRPC_PAGE}
    missing = [p for p in nav if p not in generated and not (ROOT / "docs" / p).is_file()]
    assert nav and not missing, missing
