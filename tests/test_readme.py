"""The README: its commands use the CLI's real subcommands and flags, and it stays a page for users."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from ninfer.cli.main import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def ninfer_invocations(block: str) -> list[list[str]]:
    """Each `ninfer ...` command of a shell snippet, split on & ; && ( ) and comments."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():          # join continued lines
        line = line.split("#", 1)[0]
        for part in re.split(r"&&|;|&|\(|\)", line):
            if not part.strip().split(" ")[0].endswith("ninfer"):       # other tools' commands (curl, smg)
                continue
            words = shlex.split(part)
            if words and (words[0] == "ninfer" or words[0].endswith("/bin/ninfer")):
                out.append(words[1:])
    return out


def test_the_main_job_serves_waits_for_health_and_streams_from_the_gateway():
    first_block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1)
    commands = ninfer_invocations(first_block)
    assert [c[0] for c in commands] == ["serve", "generate"]
    serve, generate = (build_parser().parse_args(c) for c in commands)
    assert generate.gateway == serve.listen and generate.wait_ready > 0
    assert "kill $!" in first_block, "the server is stopped (SIGTERM: it drains) when the stream is done"


def test_both_commands_install_the_same_pins_that_ci_tests():
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    ci = (README.parent / ".ci" / "run").read_text()
    assert "-c constraints.txt" in blocks[0] and "-c constraints.txt" in ci and blocks[1].startswith("bash .ci/run")
    pins = [line for line in (README.parent / "constraints.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    assert all("==" in line for line in pins) and any(line.startswith("torch==") for line in pins)
    assert "python3 -m venv .venv" in blocks[0] and "python3 -m venv .venv" in ci


def test_every_documented_command_parses():
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    placeholders = [re.sub(r"\[[^\]]*\]", "", b).replace("DIR", "/models/x") for b in blocks]   # [optional] parts
    commands = [c for block in placeholders for c in ninfer_invocations(block)]
    assert {c[0] for c in commands} >= {"serve", "engine", "gateway", "generate"}
    for c in commands:
        build_parser().parse_args(c)           # argparse exits on an unknown subcommand or flag



def test_the_first_command_passes_the_cpu_index_to_pip_only_when_it_answers(monkeypatch, capsys):
    """Where download.pytorch.org cannot be reached (a machine behind a package mirror), pip retried it for
    every package: over six minutes and hundreds of warnings. The first command probes it and hands pip
    what the probe prints; .ci/run probes it the same way."""
    import socket
    first = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1)
    probe = re.search(r'(\w+)=\$\(python3 -c "(.*?)" 2>/dev/null \|\| true\)', first)
    assert probe, "the first command probes the index in a python3 -c whose output it keeps"
    variable, code = probe.groups()
    pip = next(part for part in first.split("&&") if "pip install" in part)
    assert f"${variable}" in pip and "download.pytorch.org" not in pip
    for reachable, expected in ((True, "--extra-index-url=https://download.pytorch.org/whl/cpu"), (False, "")):
        def connect(address, timeout=None, reachable=reachable):
            if not reachable:
                raise OSError("unreachable")
            assert address == ("download.pytorch.org", 443) and timeout
            return None
        monkeypatch.setattr(socket, "create_connection", connect)
        try:
            exec(code, {})
        except OSError:
            pass                                   # the shell drops the probe's error (2>/dev/null || true)
        assert capsys.readouterr().out.strip() == expected
    assert "create_connection(('download.pytorch.org', 443)" in (README.parent / ".ci" / "run").read_text()


def test_the_readme_stays_a_users_page_of_at_most_150_lines_with_one_performance_table():
    """What is not for a first reader goes in docs/; a blank line inside the table would split it in two."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail to docs/"
    section = README.read_text().split("## Performance", 1)[1].split("\n## ", 1)[0]
    tables = re.findall(r"(?:^\|.*\|\n)+", section + "\n", re.M)
    assert len(tables) == 1, f"the performance section has {len(tables)} tables"
