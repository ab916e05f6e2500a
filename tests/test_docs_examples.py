"""The documentation's runnable examples run: every shell block marked `<!-- runnable -->` in README.md and the
pages of mkdocs.yml, in reading order, in one working folder (a later page uses what an earlier one built),
on the tiny preset (docs/hooks.py TINY_PRESET). Fixed ports become free ones; a line ending in `&` starts a
server and the next line runs once it prints that it is listening."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMMAND_TIMEOUT_S = 600
SERVER_START_TIMEOUT_S = 180
_spec = importlib.util.spec_from_file_location("memlm_docs_hooks", ROOT / "docs" / "hooks.py")
hooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hooks)


def _pages() -> list[Path]:
    """README.md, then the site's pages in the order of mkdocs.yml's nav."""
    nav = re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    return [ROOT / "README.md", *(ROOT / "docs" / p for p in nav if (ROOT / "docs" / p).is_file())]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_free_ports(commands: list[str]) -> list[str]:
    """The commands with each port a server is started on (`--port N`) replaced by a free one, everywhere."""
    fixed = sorted({n for c in commands for n in re.findall(r"--port (\d+)", c)})
    free = {n: str(_free_port()) for n in fixed}
    return [re.sub(r"(?<=--port )(\d+)|(?<=:)(\d+)\b", lambda m: free.get(m.group(0), m.group(0)), c)
            for c in commands]


def _environment(shims: Path) -> dict[str, str]:
    """`memlm` on the PATH as this interpreter's `-m memlm`, this checkout first on the import path."""
    shims.mkdir(exist_ok=True)
    memlm = shims / "memlm"
    memlm.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m memlm "$@"\n')
    memlm.chmod(0o755)
    return {**os.environ, "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _start_server(command: str, cwd: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str | None]:
    """A background command that prints `listening on ...` when ready: (process, None) or (process, why not)."""
    process = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in process.stdout:
            seen.append(line)
            if line.startswith("listening on"):
                ready.set()
        ready.set()  # the output ended: the server exited

    threading.Thread(target=read, daemon=True).start()
    ready.wait(SERVER_START_TIMEOUT_S)
    if process.poll() is not None or not any(line.startswith("listening on") for line in seen):
        return process, "".join(seen[-20:]) or "no output"
    return process, None


def run_examples(text: str, cwd: Path, env: dict[str, str]) -> list[str]:
    """Runs the runnable blocks of one Markdown text in `cwd`; the failures, each with its output's tail."""
    failures, servers = [], []
    try:
        for block in hooks.runnable_blocks(text):
            for command in _with_free_ports(hooks.runnable_commands(block)):
                if command.endswith("&"):
                    process, problem = _start_server(command.removesuffix("&").strip(), cwd, env)
                    servers.append(process)
                    if problem:
                        failures.append(f"[{command}] did not start listening:\n{problem}")
                        return failures
                    continue
                done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                                      timeout=COMMAND_TIMEOUT_S)
                if done.returncode != 0:
                    tail = (done.stdout + done.stderr)[-3000:]
                    failures.append(f"[{command}] exited {done.returncode}:\n{tail}")
                    return failures  # later commands use what this one should have made
    finally:
        for process in servers:
            os.killpg(process.pid, signal.SIGTERM)
        for process in servers:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
    return failures


def test_the_runnable_examples_run(tmp_path):
    env = _environment(tmp_path / "bin")
    work = tmp_path / "work"
    work.mkdir()
    ran = []
    for page in _pages():
        text = page.read_text()
        if hooks.RUNNABLE not in text:
            continue
        start = time.perf_counter()
        failures = run_examples(text, work, env)
        assert not failures, f"{page.relative_to(ROOT)}:\n" + "\n".join(failures)
        ran.append(f"{page.relative_to(ROOT)} {time.perf_counter() - start:.0f} s")
    # The main job's page is among them: a marker lost in an edit would otherwise go unnoticed.
    assert any(r.startswith("docs/getting-started.md") for r in ran), ran
    print("\n".join(ran))


def test_a_failing_example_fails(tmp_path):
    page = f"{hooks.RUNNABLE}\n```bash\nmemlm eval --model smollm2-135m --data no-such-corpus\n```\n"
    failures = run_examples(page, tmp_path, _environment(tmp_path / "bin"))
    assert len(failures) == 1 and "no-such-corpus" in failures[0]


def test_runnable_examples_take_the_tiny_preset_and_free_ports():
    commands = hooks.runnable_commands("memlm serve lm --model smollm2-135m \\\n  --port 50052 &\n"
                                       "memlm client score --address 127.0.0.1:50052 x  # a comment\n")
    assert commands[0].startswith("memlm serve lm --model tiny") and commands[0].endswith("&")
    moved = _with_free_ports(commands)
    port = re.search(r"--port (\d+)", moved[0]).group(1)
    assert port != "50052" and f"127.0.0.1:{port} " in moved[1]


def test_a_marker_without_a_shell_block_is_refused():
    with pytest.raises(ValueError, match="line 2"):
        hooks.runnable_blocks("text\n<!-- runnable -->\nno block\n")
