"""The switch registry (engine/envs.py): one module reads every NINFER_* variable, each switch is documented and
read, docs/switches.md is generated from it, and a malformed value stops the read with the variable, its value and
what it takes."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from engine import envs

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("engine", "services", "gateway", "ninfer", "tools/bench")
ENVS = ROOT / "engine" / "envs.py"
NAME = re.compile(r"NINFER_[A-Z0-9_]*[A-Z0-9]")


def _files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py") if p != ENVS)


def _environ_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, variable) of each read of a literal NINFER_* name from the environment: os.environ.get / pop /
    setdefault, os.getenv, os.environ[...] and `... in os.environ`."""
    def is_environ(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id == "environ")

    def literal(node) -> str | None:
        ok = isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("NINFER_")
        return node.value if ok else None

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and literal(node.args[0]):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault") and is_environ(f.value)) or (
                    isinstance(f, ast.Attribute) and f.attr == "getenv") or (isinstance(f, ast.Name) and f.id == "getenv"):
                found.append((node.lineno, literal(node.args[0])))
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and literal(node.slice) and isinstance(
                node.ctx, ast.Load):
            found.append((node.lineno, literal(node.slice)))
        elif isinstance(node, ast.Compare) and literal(node.left) and any(
                isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and any(is_environ(c) for c in node.comparators):
            found.append((node.lineno, literal(node.left)))
    return found


def test_the_docs_page_is_the_registry():
    page = (ROOT / "docs" / "switches.md").read_text()
    assert page == envs.markdown(), "docs/switches.md is stale: run python -m engine.envs > docs/switches.md"


def test_no_module_reads_a_switch_outside_the_registry():
    # product code, the tools and the tests alike: every NINFER_* variable goes through engine.envs
    offenders = [f"{p.relative_to(ROOT)}:{line} {name}" for p in _files(*PRODUCT, "tools", "tests")
                 for line, name in _environ_reads(ast.parse(p.read_text(), str(p)))]
    assert not offenders, offenders


def test_the_scan_finds_each_form_of_read():
    code = ('import os\nfrom os import environ, getenv\na = os.environ.get("NINFER_A", "1")\nb = os.getenv("NINFER_B")\n'
            'c = os.environ["NINFER_C"]\nd = "NINFER_D" in os.environ\ne = getenv("NINFER_E")\n'
            'f = environ.pop("NINFER_F", None)\nos.environ["NINFER_SET"] = "1"\ng = os.environ.get("OTHER")\n')
    assert _environ_reads(ast.parse(code)) == [(3, "NINFER_A"), (4, "NINFER_B"), (5, "NINFER_C"), (6, "NINFER_D"),
                                               (7, "NINFER_E"), (8, "NINFER_F")]


def test_every_name_the_product_mentions_is_registered():
    # strings and comments alike: a deleted switch must not live on in a docstring, a help text or a comment
    stale = []
    for p in _files(*PRODUCT, "tools"):
        for tok in tokenize.generate_tokens(io.StringIO(p.read_text()).readline):
            if tok.type in (tokenize.STRING, tokenize.COMMENT):
                stale += [f"{p.relative_to(ROOT)}:{tok.start[0]} {n}" for n in NAME.findall(tok.string)
                          if n not in envs.SWITCHES]
    assert not stale, stale


SCRIPTS = (".ci/run", "tools/**/*.sh")
# pages that name switches as they are; CHANGELOG.md and tried-and-lost.md also name the deleted ones, by design
PAGES = ("README.md", "docs/*.md", "compose/**/*", "deploy/**/*", "bench/results/*.md")
NOT_PAGES = ("CHANGELOG.md", "docs/tried-and-lost.md")


def _globbed(patterns: tuple[str, ...]) -> list[Path]:
    return sorted({p for pat in patterns for p in ROOT.glob(pat) if p.is_file()})


def test_every_name_the_docs_and_scripts_mention_is_registered():
    # a switch deleted from the registry must not live on in a page, a compose file or a script that sets it
    stale = [f"{p.relative_to(ROOT)} {n}" for p in _globbed(PAGES + SCRIPTS)
             if str(p.relative_to(ROOT)) not in NOT_PAGES for n in sorted(set(NAME.findall(p.read_text())))
             if n not in envs.SWITCHES]
    assert not stale, stale


def _shell_reads() -> set[str]:
    """The NINFER_* variables shell scripts expand ($NAME, ${NAME...})."""
    return {m for p in _globbed(SCRIPTS) for m in re.findall(r"\$\{?(NINFER_[A-Z0-9_]*[A-Z0-9])", p.read_text())}


def _references(dirs: tuple[str, ...]) -> set[str]:
    """The registry attributes (envs.NAME) that modules under dirs use."""
    used = set()
    for p in _files(*dirs):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "envs":
                used.add(node.attr)
    return used


def test_every_switch_is_read():
    by_attr = {attr: s for attr, s in vars(envs).items() if isinstance(s, envs.Switch)}
    assert sorted(s.name for s in by_attr.values()) == sorted(envs.SWITCHES)     # one module attribute each
    product, anywhere = _references(PRODUCT), _references(PRODUCT + ("tools", "tests"))
    shell = _shell_reads()
    unread = [s.name for attr, s in by_attr.items()
              if not (attr in product or s.kind == "development" and (attr in anywhere or s.name in shell))]
    assert not unread, unread


def test_each_switch_is_documented_in_one_line_and_its_default_parses():
    for s in envs.SWITCHES.values():
        assert s.kind in envs.KINDS and s.doc and "\n" not in s.doc and s.doc.endswith("."), s.name
        shown = str(int(s.default)) if isinstance(s.default, bool) else str(s.default)
        assert s.parse(shown) == s.default, s.name
    with pytest.raises(ValueError, match="bad switch registration: NINFER_PDL"):
        envs._register("NINFER_PDL", True, envs.parse_bool, "kill switch", "Twice.")
    with pytest.raises(ValueError, match="bad switch registration: OTHER_NAME"):
        envs._register("OTHER_NAME", True, envs.parse_bool, "kill switch", "Not ours.")


@pytest.mark.parametrize("name", sorted(n for n, s in envs.SWITCHES.items() if s.parse is not envs.parse_str))
def test_a_malformed_value_stops_the_read(name, monkeypatch):
    switch = envs.SWITCHES[name]
    takes = {envs.parse_bool: "takes 1 or 0", envs.parse_int: "takes an integer",
             envs.parse_count: "takes a non-negative integer"}[switch.parse]
    for bad in ("maybe", "-1") if switch.parse is envs.parse_count else ("maybe",):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError) as err:
            switch.read()
        assert str(err.value) == f"{name}={bad!r}: {takes}"


def test_values_read_as_documented(monkeypatch):
    for raw, want in (("1", True), ("0", False), ("true", True), ("Off", False), (" yes ", True), ("", False)):
        monkeypatch.setenv("NINFER_PDL", raw)
        assert envs.PDL.read() is want, raw
    monkeypatch.delenv("NINFER_PDL")
    assert envs.PDL.read() is True and not envs.PDL.is_set() and envs.PDL.raw() is None
    monkeypatch.setenv("NINFER_P2P_PUSH_MAX_BYTES", "0")
    assert envs.P2P_PUSH_MAX_BYTES.read() == 0 and envs.P2P_PUSH_MAX_BYTES.raw() == "0"


def test_a_malformed_switch_stops_the_import_of_the_module_it_steers():
    # read at import: the process stops before it serves, naming the variable, its value and what it takes
    r = subprocess.run([sys.executable, "-c", "import engine.worker.paged_kv"], cwd=ROOT, capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin", "NINFER_PREFILL_TMA_HD256": "256"})
    assert r.returncode != 0 and "ValueError: NINFER_PREFILL_TMA_HD256='256': takes 1 or 0" in r.stderr, r.stderr[-400:]
