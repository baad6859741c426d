"""Package boundaries: torch only where tensors are, no import cycles, product packages only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT_PACKAGES = ("engine", "services", "gateway", "ninfer")

# Packages a process without torch must be able to import whole (every module in them, found by walking the
# folders, so a new module is covered the day it lands): the gateway's process, the engine's scheduler and block
# accounting, the shared gRPC plumbing and the CLI; and the engine's pure-Python top-level modules.
TORCH_FREE_PACKAGES = ("gateway", "engine/sched", "engine/cache", "services/server", "ninfer/cli")
TORCH_FREE_MODULES = ["engine", "engine.config", "engine.errors", "engine.sampling_params", "engine.request_stats",
                      "engine.metrics", "engine.tokenizer", "engine.engine_info", "engine.envs",
                      "services.convert"]
# in those packages, the modules that hold an engine (and so torch), and why
TORCH_USERS = {"gateway.serve": "`ninfer serve`'s one-process stack: an engine and the gateway together"}


def torch_free_modules() -> list[str]:
    walked = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                    for pkg in TORCH_FREE_PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    return [m for m in TORCH_FREE_MODULES if (ROOT / (m.replace(".", "/") + ".py")).exists()
            or (ROOT / m.replace(".", "/") / "__init__.py").exists()] + [m for m in walked if m not in TORCH_USERS]


TORCH_FREE = torch_free_modules()


def test_torch_free_modules_import_with_torch_blocked():
    code = ("import sys\nsys.modules['torch'] = None\n"
            + "".join(f"import {m}\n" for m in TORCH_FREE)
            + "import engine\nassert 'torch' not in [k for k, v in sys.modules.items() if v is not None]\n"
            + "from engine import SamplingParams, EngineConfig, InvalidArgumentError, RequestStats\n"
            + "from ninfer.cli.main import build_parser\nbuild_parser().format_help()\nprint('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_the_lazy_engine_package_still_offers_the_offline_api():
    done = subprocess.run([sys.executable, "-c", "import engine; print(engine.LLM.__module__)"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "engine.llm"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Every product module -> the product modules it imports (at any depth of the file, lazy imports
    and TYPE_CHECKING blocks included: a cycle is a cycle in the design even when it runs)."""
    modules = {_module_name(p): p for pkg in PRODUCT_PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and not name.startswith(t + "."):   # a package's own __init__ is no edge
                    graph[name].add(t)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_in_the_product_packages():
    graph = import_graph()
    assert "engine.core" in graph and "engine.sched.scheduler" in graph["engine.core"]   # the walker sees imports
    assert find_cycles(graph) == []


def test_the_wheel_ships_the_product_packages_only():
    import tomllib
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(p.rstrip("*") for p in include) == sorted(PRODUCT_PACKAGES)


@pytest.mark.parametrize("module", ["engine", "services", "gateway"])
def test_product_packages_hold_no_test_helpers(module):
    for path in (ROOT / module).rglob("*.py"):
        assert path.name not in ("testing.py", "conftest.py"), path


# What the engine loop's front door hides: its core, the scheduler, the KV manager, the tokenizer's
# library object, and the inspection hook `call` that tests use.
BEHIND_THE_FRONT_DOOR = ("loop.core", ".core.", ".scheduler", ".kv.", "tokenizer.inner", "loop.call(", ".call(lambda")


@pytest.mark.parametrize("package", ["services", "gateway", "ninfer/cli"])
def test_services_and_tools_use_the_engine_front_door_only(package):
    reached = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in (ROOT / package).rglob("*.py")
               for i, line in enumerate(p.read_text().splitlines(), 1)
               if any(s in line for s in BEHIND_THE_FRONT_DOOR)]
    assert reached == []


def test_no_module_reads_another_modules_private_runner_state():
    private = ("._pool_row", "._free_rows", "kv.prefix_reuse =", "runner._")
    reached = [f"{p.relative_to(ROOT)}:{i}" for pkg in PRODUCT_PACKAGES for p in (ROOT / pkg).rglob("*.py")
               for i, line in enumerate(p.read_text().splitlines(), 1) if any(s in line for s in private)]
    assert reached == []


STATS_KEYS = ('"timings_seconds"', '"prefill_tok_s"', '"computed_prefill_tokens"', '"accepted_per_position"')


def test_request_stats_keys_are_spelled_in_one_place():
    """The figures of a request are `engine.request_stats.RequestStats` (its `to_dict` is the JSON layout); the
    engine snapshot's `last` (engine/metrics.py) is the metrics contract's own record. Every other
    product module goes through the typed object."""
    allowed = {"engine/request_stats.py", "engine/metrics.py"}
    spelled = [str(p.relative_to(ROOT)) for pkg in PRODUCT_PACKAGES for p in (ROOT / pkg).rglob("*.py")
               if not str(p.relative_to(ROOT)).startswith("ninfer/v1")
               and str(p.relative_to(ROOT)) not in allowed and any(k in p.read_text() for k in STATS_KEYS)]
    assert spelled == []


def test_the_engine_keeps_at_most_a_dozen_modules_at_its_top_level():
    """engine/'s subpackages are the architecture (sched, cache, worker, distributed, loading, models, layers, quant,
    kernels, structured); a new module belongs in one of them unless it is the engine's front door or a type of its
    public API."""
    top = sorted(p.name for p in (ROOT / "engine").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 12, top
