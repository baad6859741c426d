"""The README's commands use the CLI's real subcommands and flags."""

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
