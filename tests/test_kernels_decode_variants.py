"""The decode/verify switches of the attention kernel (`AttnConfig.prefetch`, split counts and key
tiles off the plan) against the torch twin, under Triton's interpreter on the CPU.

Opt-in as tests/test_kernels_interpret.py (NINFER_TRITON_INTERPRET_TESTS=1; it sets TRITON_INTERPRET=1
for the process). The same switches at real shapes, and the prefetching loop inside a replayed CUDA
graph, are in tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys

import pytest
import torch

ENABLED = os.environ.get("NINFER_TRITON_INTERPRET_TESTS") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _triton_version() -> tuple[int, ...]:
    from importlib.metadata import version
    return tuple(int(p) for p in version("triton").split(".")[:2] if p.isdigit())


pytestmark = [
    pytest.mark.skipif(not (ENABLED and HAVE_TRITON),
                       reason="Triton interpreter tests are opt-in: need triton importable and "
                              "NINFER_TRITON_INTERPRET_TESTS=1"),
    pytest.mark.skipif(ENABLED and HAVE_TRITON and _triton_version() < (3, 9),
                       reason="needs the interpreter of Triton >= 3.9"),
]
if ENABLED and HAVE_TRITON:
    os.environ["TRITON_INTERPRET"] = "1"

BF16, I8 = torch.bfloat16, torch.int8
TOL = 1e-2


@pytest.fixture(scope="module", autouse=True)
def interpreted_kernels():
    from tools import kernel_checks as testing
    name = "engine.kernels.attention"
    if name in sys.modules:
        importlib.reload(sys.modules[name])
    else:
        importlib.import_module(name)
    testing.patch_interpreter()
    return testing


def _config(query_len: int, group: int, **kw):
    from engine.kernels.attention import AttnConfig
    block_m = max(16, 1 << (query_len * group - 1).bit_length())
    base = {"block_m": block_m, "block_n": 16, "num_warps": 4, "num_stages": 1, "num_splits": 1, "min_tiles": 1}
    return AttnConfig(**{**base, **kw})


# (query_lens, seq_lens): batch 1 and 3, unequal lengths, none a multiple of the 16-key tile but one;
# 8 heads over 2 KV heads (group 4), head_dim 32, pages of 8 (a tile spans two pages)
SHAPES = {
    "decode_b1": ([1], [83]),
    "decode_b3": ([1] * 3, [1, 40, 117]),
    "verify_q4_b1": ([4], [70]),
    "verify_q4_b3": ([4] * 3, [4, 33, 96]),
}
VARIANTS = {
    "prefetch1": {"prefetch": 1},
    "prefetch2": {"prefetch": 2},
    "prefetch1_splits4": {"prefetch": 1, "num_splits": 4},
    "prefetch2_splits4_bn32": {"prefetch": 2, "num_splits": 4, "block_n": 32},
    "prefetch1_splits8": {"prefetch": 1, "num_splits": 8},
}


# every variant over batch 3 (decode and verify) in both page dtypes; batch 1 for a few
CASES = [(shape, variant) for variant in VARIANTS for shape in ("decode_b3", "verify_q4_b3")] + \
    [("decode_b1", "prefetch1_splits8"), ("verify_q4_b1", "prefetch2")]


@pytest.mark.parametrize("kv_dtype", [BF16, I8], ids=["bf16", "int8"])
@pytest.mark.parametrize("shape,variant", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_decode_variants_match_twin(interpreted_kernels, shape, variant, kv_dtype):
    query_lens, seq_lens = SHAPES[shape]
    q, kv, ctx = interpreted_kernels.attention_case(query_lens, seq_lens, 8, 2, 32, 8, kv_dtype, BF16, "cpu",
                                                    seed=sum(map(ord, shape + variant)))
    cfg = _config(query_lens[0], 4, **VARIANTS[variant])
    r = interpreted_kernels.check_attention(q, kv, ctx, config=cfg)
    assert r["unwritten"] == 0 and r["rel_err"] < TOL, (cfg, r)


def test_prefetch_with_non_uniform_batch(interpreted_kernels):
    """Mixed query lengths take the bisection map (tiles_per_seq 0), where programs past a sequence's
    tiles return early."""
    q, kv, ctx = interpreted_kernels.attention_case([1, 3, 2], [50, 21, 90], 8, 2, 32, 8, I8, BF16, "cpu", seed=5)
    cfg = dataclasses.replace(_config(3, 4), prefetch=1, num_splits=4)
    r = interpreted_kernels.check_attention(q, kv, ctx, config=cfg)
    assert r["unwritten"] == 0 and r["rel_err"] < TOL, r


def test_prefetch_matches_the_plain_loop(interpreted_kernels):
    """The pipelined loop does the same arithmetic as the plain one, tile by tile."""
    from engine.kernels import attention as A
    q, kv, ctx = interpreted_kernels.attention_case([1, 1], [75, 200], 8, 2, 32, 8, I8, BF16, "cpu", seed=9)
    plain = _config(1, 4, num_splits=2)
    a = A.paged_attention(q, kv, ctx, 0.2, config=plain)
    for depth in (1, 2):
        b = A.paged_attention(q, kv, ctx, 0.2, config=dataclasses.replace(plain, prefetch=depth))
        assert torch.equal(a, b), depth
