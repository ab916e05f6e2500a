"""MkDocs hook: pages generated from the code at build time, so that they cannot drift from it.

- `reference/cli.md` walks `memlm.cli.build_parser()` (every subcommand, every flag, its help and default);
- `reference/grpc.md` lists the services, rpcs and messages of `proto/memlm/v1/*.proto` with their
  comments, then includes each file whole.

Neither page is kept in the repository; `tests/test_docs.py` checks the CLI page against the parser.

A shell block preceded by the line `<!-- runnable -->` is an example that runs: `runnable_commands` gives its
commands on the tiny preset and `tests/test_docs_examples.py` runs them; the build fails on a marker that
no shell block follows.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto" / "memlm" / "v1"
CLI_PAGE = "reference/cli.md"
GRPC_PAGE = "reference/grpc.md"
RUNNABLE = "<!-- runnable -->"
TINY_PRESET = {"--model smollm2-135m": "--model tiny", "pretrained=smollm2-135m": "pretrained=tiny"}
"""What a runnable example's model becomes when it runs in the tests: the tiny preset, random weights."""


# ----------------------------------------------------------------------------- command line

def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each subcommand of `parser`, in the order they were added."""
    out = []
    for action in parser._actions:  # argparse has no public way to walk subparsers
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                out.append((name, helps.get(name, ""), sub))
    return out


def _cell(text: str) -> str:
    """Text made safe for one Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ").strip()


def _flag_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.option_strings:
            names = ", ".join(f"`{s}`" for s in action.option_strings)
            if action.nargs != 0:
                names += f" `{action.metavar or action.dest.upper()}`" if not action.choices else ""
        else:
            names = f"`{action.metavar or action.dest}` (positional)"
        help_text = (action.help or "") if action.help != argparse.SUPPRESS else ""
        try:
            help_text = help_text % {**vars(action), "prog": parser.prog}
        except (KeyError, TypeError, ValueError):
            pass
        extra = []
        if action.choices:
            extra.append("one of " + ", ".join(f"`{c}`" for c in action.choices))
        if action.option_strings and action.nargs != 0 and action.default not in (None, argparse.SUPPRESS):
            extra.append(f"default `{action.default}`")
        if action.required and action.option_strings:
            extra.append("required")
        cell = _cell(help_text) + (" (" + "; ".join(extra) + ")" if extra else "")
        rows.append(f"| {_cell(names)} | {cell} |")
    return rows


def _render_command(path: list[str], help_text: str, parser: argparse.ArgumentParser, out: list[str]) -> None:
    depth = min(len(path) + 1, 6)
    out.append(f"{'#' * depth} `{' '.join(path)}`\n")
    if help_text:
        out.append(help_text.strip() + "\n")
    out.append("```text\n" + parser.format_usage().strip() + "\n```\n")
    rows = _flag_rows(parser)
    if rows:
        out.append("| argument | what it does |\n|---|---|")
        out.extend(rows)
        out.append("")
    for name, sub_help, sub in _subparsers(parser):
        _render_command(path + [name], sub_help, sub, out)


def render_cli(parser: argparse.ArgumentParser) -> str:
    """The command reference of `parser` as Markdown: one section per (sub)command with every flag."""
    out = [
        "# Command reference\n",
        "Generated from `memlm.cli.build_parser()` when the site is built; `memlm COMMAND --help` prints "
        "the same.\n",
    ]
    _render_command([parser.prog], parser.description or "", parser, out)
    return "\n".join(out) + "\n"


def cli_page() -> str:
    from memlm.cli import build_parser  # imported here: the parser's modules load torch

    return render_cli(build_parser())


# ----------------------------------------------------------------------------- gRPC

_BLOCK = re.compile(r"((?:^[ \t]*//.*\n)*)^[ \t]*(service|rpc|message|enum)\s+(\w+)(.*)$", re.M)


def _comment(block: str) -> str:
    return " ".join(line.strip().removeprefix("//").strip() for line in block.splitlines() if line.strip())


def render_proto(proto_dir: Path = PROTO_DIR) -> str:
    """The wire format as Markdown: services, rpcs and messages with their comments, then each file."""
    out = [
        "# gRPC API\n",
        "Generated from the `.proto` files in `proto/memlm/v1/` (package `memlm.v1`) when the site is "
        "built; those files are the one source of the wire format. Tensors travel as dtype, shape and "
        "raw little-endian row-major bytes. Every server also answers `grpc.health.v1` and reflection.\n",
    ]
    files = sorted(proto_dir.glob("*.proto"))
    for f in files:
        text = f.read_text()
        out.append(f"## `{f.name}`\n")
        header = re.match(r"((?:^//.*\n)+)", text)
        if header:
            out.append(_comment(header.group(1)) + "\n")
        services, types = [], []
        for m in _BLOCK.finditer(text):
            comment, kind, name, rest = _comment(m.group(1)), m.group(2), m.group(3), m.group(4)
            if kind == "service":
                services.append(f"\n**service `{name}`**: {comment}\n")
            elif kind == "rpc":
                sig = re.match(r"\s*\(([\w.]+)\)\s*returns\s*\((stream\s+)?([\w.]+)\)", rest)
                call = f"`{name}({sig.group(1)}) -> {sig.group(2) or ''}{sig.group(3)}`" if sig else f"`{name}`"
                services.append(f"- {call}: {comment}")
            else:
                types.append(f"| `{name}` | {kind} | {_cell(comment)} |")
        out.extend(services)
        if types:
            out.append("\n| type | kind | what it is |\n|---|---|---|")
            out.extend(types)
        out.append(f"\n??? note \"{f.name} in full\"\n")
        out.append("    ```proto")
        out.extend(("    " + line).rstrip() for line in text.splitlines())
        out.append("    ```\n")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- runnable examples

_MARKED = re.compile(r"^" + re.escape(RUNNABLE) + r"[ \t]*\n(```(?:bash|sh|shell)\n(.*?)^```)?", re.M | re.S)


def runnable_blocks(markdown: str) -> list[str]:
    """The shell blocks marked runnable, in page order; ValueError for a marker that no shell block follows."""
    blocks = []
    for m in _MARKED.finditer(markdown):
        if m.group(1) is None:
            line = markdown.count("\n", 0, m.start()) + 1
            raise ValueError(f"line {line}: {RUNNABLE} must stand right above a ```bash block")
        blocks.append(m.group(2))
    return blocks


def runnable_commands(block: str) -> list[str]:
    """The command lines of a runnable block (continuations joined, comments and blanks dropped) on the
    tiny preset (TINY_PRESET)."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        for real, tiny in TINY_PRESET.items():
            line = line.replace(real, tiny)
        commands.append(line)
    return commands


# ----------------------------------------------------------------------------- MkDocs hook

def on_page_markdown(markdown, page, config, files):
    """Fails the build on a runnable marker that is not right above a shell block."""
    from mkdocs.exceptions import PluginError

    try:
        runnable_blocks(markdown)
    except ValueError as e:
        raise PluginError(f"{page.file.src_uri}: {e}") from None
    return markdown


def on_files(files, config):
    """Adds the generated pages to the site (they exist only in the build)."""
    from mkdocs.structure.files import File

    for uri, content in ((CLI_PAGE, cli_page()), (GRPC_PAGE, render_proto())):
        existing = files.get_file_from_path(uri)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, uri, content=content))
    return files
