"""The rule of tests/conftest.py decides which tests are GPU tests; this checks that no test module outside it
touches a CUDA device, so that `pytest -m gpu` / `-m multi_gpu` select every test that needs one."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import device_kind

TESTS = Path(__file__).resolve().parent
CUDA_WORDS = ("torch.cuda", "device_count", "device=\"cuda", "device='cuda")
ASKING = "torch.cuda.is_available()"           # asking whether there is a device is not using one
# modules that name CUDA without touching a device, and why
CPU_MODULES = {"engine/loading/test_moe_loading.py": "plans memory for a CUDA config on the CPU (plan_memory)",
               "engine/worker/test_memory_plan_16gb.py": "plans a 16 GB CUDA device's memory on the CPU (plan_memory)"}


def _imports(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def _code_without_strings(source: str, tree: ast.AST) -> str:
    """The module's source with docstrings blanked (a sentence about CUDA is not a use of it)."""
    lines = source.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                for i in range(first.lineno - 1, first.end_lineno):
                    lines[i] = ""
    return "\n".join(line.split("#", 1)[0] for line in lines)


def test_every_module_that_touches_cuda_is_a_gpu_module_by_the_rule():
    offenders = []
    for path in sorted(TESTS.rglob("test_*.py")):
        if path == Path(__file__).resolve():
            continue
        source = path.read_text()
        tree = ast.parse(source)
        code = _code_without_strings(source, tree).replace(ASKING, "")
        if str(path.relative_to(TESTS)) in CPU_MODULES:
            continue
        if any(w in code for w in CUDA_WORDS) and device_kind(path, _imports(tree)) is None:
            offenders.append(str(path.relative_to(TESTS)))
    assert not offenders, ("these test modules use CUDA but are not GPU modules by the rule of tests/conftest.py "
                           f"(name them test_*_gpu.py / test_*_multi_gpu.py, or run kernels through "
                           f"tests.support.kernel_backend): {offenders}")


def test_the_rule_names_each_kind():
    assert device_kind(Path("test_x_multi_gpu.py"), set()) == "multi_gpu"
    assert device_kind(Path("test_x_gpu.py"), set()) == "gpu"
    assert device_kind(Path("test_x.py"), {"tests.support.kernel_backend"}) == "kernels"
    assert device_kind(Path("test_x.py"), {"torch"}) is None
