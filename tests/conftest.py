"""Shared fixtures of the engine tests: the trained test model (skipped where absent), LLM instances
scoped to a module (loading costs about a second each), scheduler request factories, a fake clock,
a tiny random Hugging Face checkpoint, and the workload prompts of the acceptance tests."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
import torch

from engine.sched.scheduler import ModelOutput

# The test models are tiny: one intra-op thread is as fast as two on an idle 2-core CI machine, and
# tens of times faster when another process holds a core (OpenMP threads spin at every barrier).
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)

# The trained test model lives beside the checkout: ../shared/models/tiny-qwen3-mtp (docs/development.md).
SHARED_MODEL = Path(__file__).resolve().parents[2] / "shared/models/tiny-qwen3-mtp"
SKIP_REASON = (f"the trained test model is not at {SHARED_MODEL} (a checkout outside the ninfer workplace); "
               "tests that need real text behaviour run only beside ../shared/models/tiny-qwen3-mtp")

# Which tests are GPU tests is decided here, by one rule, so that `pytest -m gpu` and `pytest -m multi_gpu`
# select exactly them (tests/test_gpu_rule.py checks that no other test module touches a CUDA device):
# - a module named test_*_multi_gpu.py needs two CUDA devices: marked `multi_gpu` and `gpu`, skipped with fewer;
# - a module named test_*_gpu.py needs one: marked `gpu`, skipped without one;
# - a module that imports tests.support.kernel_backend runs Triton kernels on a CUDA device when there is one,
#   else in Triton's interpreter (opt-in, see that module), else it is skipped with the reason: marked `gpu`.
KERNEL_BACKEND_MODULE = "tests.support.kernel_backend"


def device_kind(path: Path, module_imports: set[str]) -> str | None:
    """'multi_gpu', 'gpu', 'kernels' or None for a test module (its path and the modules it imports)."""
    if path.name.endswith("_multi_gpu.py"):
        return "multi_gpu"
    if path.name.endswith("_gpu.py"):
        return "gpu"
    if KERNEL_BACKEND_MODULE in module_imports:
        return "kernels"
    return None


def _imports_of(module) -> set[str]:
    import ast
    names: set[str] = set()
    for node in ast.walk(ast.parse(Path(module.__file__).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def pytest_collection_modifyitems(config, items):
    kinds: dict[str, str | None] = {}
    cuda_devices = torch.cuda.device_count()
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        key = module.__name__
        if key not in kinds:
            kinds[key] = device_kind(Path(module.__file__), _imports_of(module))
        kind = kinds[key]
        if kind is None:
            continue
        item.add_marker(pytest.mark.gpu)
        if kind == "multi_gpu":
            item.add_marker(pytest.mark.multi_gpu)
            if cuda_devices < 2:
                item.add_marker(pytest.mark.skip(reason=f"needs two CUDA devices (torch sees {cuda_devices})"))
        elif kind == "gpu" and cuda_devices < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


# Small enough for CI, large enough for every test's batch.
KV_CAPACITY = 8192


def shared_model_available() -> bool:
    return (SHARED_MODEL / "config.json").is_file() and (SHARED_MODEL / "tokenizer.json").is_file()


def require_shared_model() -> str:
    if not shared_model_available():
        pytest.skip(SKIP_REASON)
    return str(SHARED_MODEL)


@pytest.fixture(scope="session")
def shared_model() -> str:
    """Path of the trained tiny Qwen3 + MTP model; skips the test where it is absent."""
    return require_shared_model()


def make_llm(model: str | None, **kwargs):
    """An LLM in float32 on the CPU with a small KV pool (any EngineConfig field may be overridden)."""
    from engine import LLM
    kwargs.setdefault("kv_capacity", KV_CAPACITY)
    kwargs.setdefault("dtype", "float32")
    return LLM(model, **kwargs)


@pytest.fixture(scope="module")
def llm_k0(shared_model):
    """The shared model without speculation (module-scoped: tests must not rely on an empty prefix cache)."""
    return make_llm(shared_model)


@pytest.fixture(scope="module")
def llm_k3(shared_model):
    """The shared model with k = 3 MTP draft tokens."""
    return make_llm(shared_model, draft_tokens=3)


def assert_kv_idle(core) -> None:
    """Every KV block is back in the free pool and every reference taken was dropped exactly once."""
    kv = core.kv
    assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.num_free_blocks} KV blocks still held"
    assert kv.refs_taken == kv.refs_dropped, f"refs taken {kv.refs_taken} != dropped {kv.refs_dropped}"
    assert not core.scheduler.requests, f"requests still tracked: {list(core.scheduler.requests)}"


def run_to_idle(core, max_steps: int = 10_000) -> list:
    """Step an EngineCore until it has no work; returns every output."""
    outputs = []
    for _ in range(max_steps):
        if not core.has_work:
            return outputs
        outputs.extend(core.step())
    raise AssertionError(f"the engine still had work after {max_steps} steps")


class FakeClock:
    """A monotonic clock the test moves by hand (EngineCore and Scheduler accept `clock=`)."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> float:
        self.t += dt
        return self.t


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


# -- scheduler factories (pure Python: no model) -----------------------------------------------------

_ids = itertools.count()


def make_request(prompt: int | list[int] = 8, max_tokens: int = 4, request_id: str | None = None,
                 arrival: float = 0.0, draft_tokens: int = 0, **sampling):
    """A scheduler Request; `prompt` is a token list or a length (tokens 1..n, distinct per request)."""
    from engine.sched.request import PhaseTimes, Request, SpecStats
    from engine.sampling_params import SamplingParams
    n = next(_ids)
    ids = list(prompt) if isinstance(prompt, list) else [(n * 7919 + i) % 30000 + 1 for i in range(prompt)]
    sampling.setdefault("temperature", 0.0)
    params = SamplingParams(max_tokens=max_tokens, **sampling)
    return Request(request_id=request_id or f"req-{n}", prompt_token_ids=ids, sampling=params, seed=n,
                   times=PhaseTimes(arrival=arrival), draft_tokens=draft_tokens,
                   spec=SpecStats(draft_tokens=draft_tokens, accepted_per_position=[0] * draft_tokens))


class KVReq:
    """The minimal KVRequest: an id, a token list and the blocks it holds."""

    def __init__(self, rid: str, tokens: list[int]):
        self.request_id, self.tokens, self.block_ids = rid, list(tokens), []

    @property
    def all_token_ids(self) -> list[int]:
        return self.tokens


def model_step(sched, out) -> list:
    """Play the model: the prefill's sampled token and one token per decode round (k = 0)."""
    result = ModelOutput()
    for piece in out.prefills:
        if piece.sample:
            result.sampled[piece.request_id] = [7]
    for w in out.decode:
        result.sampled[w.request_id] = [7]
    return sched.update(out, result)


def make_scheduler(num_blocks: int = 64, block_size: int = 16, clock=None, prefix_reuse: bool = True, **cfg):
    """A real Scheduler over a real KVCacheManager; SchedulerConfig fields may be overridden."""
    from engine.cache.block_manager import KVCacheManager
    from engine.sched.scheduler import Scheduler, SchedulerConfig
    fields = dict(max_batch=8, max_pending=16, pending_timeout_s=60.0, prefill_chunk=64, draft_tokens=0,
                  max_model_len=4096)
    fields.update(cfg)
    kv = KVCacheManager(num_blocks, block_size, prefix_reuse)
    return Scheduler(SchedulerConfig(**fields), kv, clock or FakeClock(0.0))


@pytest.fixture
def request_factory():
    return make_request


@pytest.fixture
def scheduler_factory():
    return make_scheduler


# -- a tiny random Hugging Face checkpoint -------------------------------------------------------------

RANDOM_HF_CONFIG = dict(
    vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, rope_theta=10_000.0, rms_norm_eps=1e-6, max_position_embeddings=512,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
)


def build_random_hf_model(path: Path, seed: int = 0, **overrides):
    """Random-init a transformers Qwen3ForCausalLM (every weight, norms included, is random so that a
    misplaced tensor shows), save it with safetensors plus a tokenizer.json and generation_config.json.
    Returns the float32 transformers model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from engine.loading.embedded_model import build_default_tokenizer
    cfg = Qwen3Config(**{**RANDOM_HF_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    build_default_tokenizer().inner.save(str(path / "tokenizer.json"))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}))
    return model


@pytest.fixture(scope="session")
def random_hf_model(tmp_path_factory):
    """(directory, transformers model) of a random tiny Qwen3 without MTP weights."""
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("random-qwen3")
    model = build_random_hf_model(path)
    return path, model


# -- workloads in the style of the model card's training_eval.json samples ---------------------------

WORKLOADS: dict[str, list[str]] = {
    "json": [
        '[{"order_id": "ORD-381901", "item": "printer", "quantity": 8, "unit_price": 1569.29, "currency": "EUR", '
        '"status": "delivered", "shipping": {"city": "Denver", "express": false}}, {"order_id": "ORD-381902", "item": "',
        '[{"id": 133630, "name": "Omar Sato", "age": 67, "city": "Denver", "email": "user133630@example.com", '
        '"active": true, "tags": ["staff", "beta"]}, {"id": 133631, "name": "',
        '[{"event": "login", "ts": 1711952600, "user_id": 71986, "latency_ms": 833, "ok": true, '
        '"path": "/api/v1/users/456"}, {"event": "',
        '[\n  {\n    "id": 387071,\n    "name": "Mateo Müller",\n    "age": 29,\n    "city": "Nairobi",\n'
        '    "email": "user387071@example.com",\n    "active": true,\n    "tags": [\n      "staff",\n      "beta"\n'
        '    ]\n  },\n  {\n    "id": 387072,\n',
    ],
    "enumeration": [
        "Line 1: the quick brown fox jumps over the lazy dog.\nLine 2: the quick brown fox jumps over the lazy dog.\n"
        "Line 3:",
        "- harbor 1\n- harbor 2\n- harbor 3\n",
        "1. item 1\n2. item 2\n3.",
        "Line 21: the quick brown fox jumps over the lazy dog.\nLine 22:",
    ],
    "code": [
        'def _parse_args(argv=None):\n    """Parse the command line arguments."""\n'
        "    parser = argparse.ArgumentParser(description=__doc__)\n    parser.add_argument(",
        'class Queue:\n    """A simple FIFO queue."""\n\n    def __init__(self, maxsize=0):\n'
        "        self.maxsize = maxsize\n        self.queue = []\n\n    def put(self, item):\n",
        "def _splitext(path, sep, altsep, extsep):\n    \"\"\"Split the extension from a pathname.\"\"\"\n"
        "    sep_index = path.rfind(sep)\n    if altsep:\n",
        '    def __repr__(self):\n        return "%s(%r)" % (self.__class__.__name__, self._data)\n\n'
        "    def __len__(self):\n",
    ],
    "prose": [
        "The :mod:`os` module provides a portable way of using operating system dependent functionality. "
        "If you just want to read or write a file see",
        "A fortune for today: you will be successful in your work, and",
        "This chapter describes the built-in types of the interpreter. The principal built-in types are "
        "numerics, sequences, mappings,",
        "He who laughs last",
    ],
}

# Prompts of assorted lengths for batch tests (a mixed batch: short, long, across block boundaries).
MIXED_PROMPTS = [
    WORKLOADS["json"][0],
    "He who laughs last",
    WORKLOADS["code"][1],
    WORKLOADS["enumeration"][0],
    "The",
    WORKLOADS["prose"][2],
]


def runner_of(core):
    """The model runner of rank 0 (the one whose results are the step's results)."""
    executor = getattr(core, "executor", None)
    return executor.driver if executor is not None else core.runner


@pytest.fixture(scope="module")
def client(stack):
    """A gateway client of the module's `stack` fixture (a served engine + gateway), once serving."""
    from gateway.client import GatewayClient
    with GatewayClient(stack.address) as c:
        c.wait_until_serving(timeout_s=60)
        yield c
