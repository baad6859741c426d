"""The in-register int8 -> bf16 conversion of the attention kernel (`int8_upcast`).

Its PTX (`attention_tiles.S8_TO_BF16_PTX`) cannot run in Triton's interpreter, so here it is emulated,
instruction by instruction, for every byte value in every byte position. The plan tests need
Triton importable but no device. On a CUDA device the converted path is held to the float32 route
it replaces and to the torch twin, in the plan's shape and in the other shapes
tools/dev/tune_decode_attention.py sweeps.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import struct

import pytest
import torch

from tests.support.kernel_backend import CUDA

# find_spec, not import: importing triton here, at collection, would fix its language module in
# compiled mode before tests/engine/kernels/test_interpret.py can switch the process to the interpreter
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton importable")

I8, BF16 = torch.int8, torch.bfloat16


def _bf16_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _bf16_bits(x: float) -> int:
    return int(torch.tensor([x], dtype=torch.float64).to(BF16).view(torch.int16)[0]) & 0xFFFF


def _run_ptx(ptx: str, word: int) -> tuple[int, int]:
    """Emulate the few PTX instructions the conversion uses; $2 in, ($0, $1) out."""
    regs = {"$2": word}

    def val(a: str) -> int:
        return regs[a] if a in regs else int(a, 16)

    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if line in ("", "{", "}") or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *args = (a.strip() for a in rest.split(","))
        if op == "mov.b32":
            regs[dst] = val(args[0])
        elif op == "and.b32":
            regs[dst] = val(args[0]) & val(args[1])
        elif op == "prmt.b32":                      # default mode: selector nibble = source byte 0..7
            a, b, sel = (val(x) for x in args)
            src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
            assert all((sel >> 4 * i) & 0x8 == 0 for i in range(4)), "sign-replicate mode not emulated"
            regs[dst] = sum(src[(sel >> 4 * i) & 0x7] << 8 * i for i in range(4))
        elif op == "fma.rn.bf16x2":                 # per 16-bit half, a * b + c rounded to bf16
            a, b, c = (val(x) for x in args)
            regs[dst] = sum(_bf16_bits(_bf16_value(a >> 16 * h) * _bf16_value(b >> 16 * h) + _bf16_value(c >> 16 * h))
                            << 16 * h for h in range(2))
        else:
            raise AssertionError(f"instruction {op} is not emulated")
    return regs["$0"], regs["$1"]


def test_s8_to_bf16_ptx_is_exact_for_every_byte():
    from engine.kernels.attention.tiles import S8_TO_BF16_PTX
    ptx = S8_TO_BF16_PTX.value
    for pos in range(4):
        for v in range(-128, 128):
            others = [0x81, 0x7F, 0x00, 0xFF]                  # -127, 127, 0, -1 around it
            byts = [others[i] if i != pos else v & 0xFF for i in range(4)]
            word = sum(b << 8 * i for i, b in enumerate(byts))
            lo, hi = _run_ptx(ptx, word)
            got = [_bf16_value(lo), _bf16_value(lo >> 16), _bf16_value(hi), _bf16_value(hi >> 16)]
            want = [float(b - 256 if b > 127 else b) for b in byts]
            assert got == want, (pos, v, got, want)


def _decode_inputs(q_dtype, kv_dtype, query_len=1, seq_len=500):
    from engine.worker.forward_context import build_forward_context
    from tests.support.kernel_checks import random_kv
    gen = torch.Generator().manual_seed(3)
    kv = random_kv(40, 16, 8, 128, kv_dtype, "cpu", gen)
    _, ctx = build_forward_context([query_len], [seq_len], [list(range(32))], 16, torch.device("cpu"))
    q = torch.randn(query_len, 32, 128, generator=gen).to(q_dtype)
    return q, kv, ctx


def test_plan_converts_int8_in_registers_for_decode_and_verify_only():
    from engine.kernels.attention import paged as A
    compiled = type(A._attn_kernel).__name__ != "InterpretedFunction"
    for query_len in (1, 4):
        q, kv, ctx = _decode_inputs(BF16, I8, query_len)
        cfg = A.plan(q, kv, ctx)
        assert cfg.int8_upcast and cfg.block_m == 16, cfg
        assert {k: getattr(cfg, k) for k in A.DECODE_INT8 if k != "num_warps"} == \
            {k: v for k, v in A.DECODE_INT8.items() if k != "num_warps"}
        assert A.upcast_int8(cfg, kv, q) == compiled               # the interpreter takes the float32 route
    # bf16 pages: the decode defaults; 500 keys over 8 one-tile splits also load each tile's K and V together
    q, kv, ctx = _decode_inputs(BF16, BF16)
    cfg = A.plan(q, kv, ctx)
    assert not cfg.int8_upcast and {k: getattr(cfg, k) for k in A.DECODE if k != "num_stages"} == \
        {k: v for k, v in A.DECODE.items() if k != "num_stages"}, cfg
    assert (cfg.num_splits, cfg.prefetch, cfg.num_stages) == (8, 2, 1), cfg
    # a long context at batch 1: several tiles per split, 64 splits, so the 16-bit long-context shape
    # (BF16_LONG: prefetch 1, one stage, 128 registers; tests/engine/kernels/attention/test_plan_rules.py)
    from engine.worker.forward_context import build_forward_context
    _, ctx = build_forward_context([1], [32768], [list(range(2048))], 16, torch.device("cpu"))
    cfg = A.plan(q, kv, ctx)                                   # the plan reads shapes and lengths only
    assert (cfg.prefetch, cfg.num_stages, cfg.max_regs) == (1, 1, 128) and cfg.num_splits * 64 < 32768, cfg
    # fp16 q over int8 pages: the PTX makes bf16, so the old route and the old defaults
    q, kv, ctx = _decode_inputs(torch.float16, I8)
    cfg = A.plan(q, kv, ctx)
    assert not A.upcast_int8(cfg, kv, q) and cfg.num_stages == A.DECODE["num_stages"], cfg
    # prefill: unchanged
    q, kv, ctx = _decode_inputs(BF16, I8, query_len=200)
    cfg = A.plan(q, kv, ctx)
    assert not cfg.int8_upcast and cfg.block_m == A.PREFILL["block_m"], cfg


def test_plan_takes_128_key_tiles_for_int8_at_long_contexts(monkeypatch):
    """int8 pages past one-tile splits: 128-key tiles, prefetch 1, splits halved until at most 2 programs per SM
    (the plan reads shapes and lengths only; the CPU plans as for 132 SMs). bf16 pages keep DECODE there."""
    from engine.worker.forward_context import build_forward_context
    from engine.kernels.attention import paged as A
    gen = torch.Generator().manual_seed(5)
    for batch, keys in ((1, 32768), (1, 8192), (8, 8192), (8, 32768)):
        need = keys // 16
        _, ctx = build_forward_context([1] * batch, [keys] * batch, [list(range(need))] * batch, 16,
                                       torch.device("cpu"))
        q = torch.randn(batch, 32, 128, generator=gen).to(BF16)
        _, kv, _ = _decode_inputs(BF16, I8)
        cfg = A.plan(q, kv, ctx)
        programs = batch * 8 * cfg.num_splits
        assert (cfg.block_n, cfg.prefetch, cfg.num_stages, cfg.int8_upcast) == (128, 1, 1, True), cfg
        assert programs <= 2 * 132 < 2 * programs, cfg
        monkeypatch.setattr(A, "INT8_LONG", False)
        old = A.plan(q, kv, ctx)
        monkeypatch.setattr(A, "INT8_LONG", True)
        assert (old.block_n, old.prefetch) == (64, 0) and old.num_splits >= cfg.num_splits, old
        _, bf16_kv, _ = _decode_inputs(BF16, BF16)
        assert A.plan(q, bf16_kv, ctx).block_n == A.DECODE["block_n"]
    # a verify of 3 drafts (4 tokens x group 4: still 16 rows) takes it too; 8 tokens (32 rows, not measured)
    # keep DECODE_INT8; 64 sequences at 8k fill the GPU without splitting
    for q_len, batch, keys, block_n, splits in ((4, 1, 32768, 128, 32), (8, 1, 32768, 64, None), (1, 64, 8192, 128, 1)):
        _, ctx = build_forward_context([q_len] * batch, [keys] * batch, [list(range(keys // 16))] * batch, 16,
                                       torch.device("cpu"))
        q = torch.randn(q_len * batch, 32, 128, generator=gen).to(BF16)
        cfg = A.plan(q, kv, ctx)
        assert cfg.block_n == block_n and (splits is None or cfg.num_splits == splits), (q_len, batch, cfg)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for the Triton kernels")
@pytest.mark.parametrize("query_len", [1, 4])
def test_int8_upcast_matches_the_float32_route(query_len):
    from engine.kernels.attention import paged as A
    from tests.support import kernel_checks as testing
    q, kv, ctx = testing.attention_case([query_len] * 4, [query_len, 100, 2000, 33000], 32, 8, 128, 16, I8, BF16,
                                        "cuda", 61 + query_len)
    plan = A.plan(q, kv, ctx)
    assert plan.int8_upcast and A.upcast_int8(plan, kv, q)
    scale = 128 ** -0.5
    old = A.paged_attention(q, kv, ctx, scale, config=dataclasses.replace(plan, **A.DECODE, int8_upcast=False))
    shapes = [dataclasses.replace(plan, block_n=bn, num_stages=s, num_warps=w)
              for bn in (64, 128) for s in (1, 2) for w in (4, 8)]
    for cfg in [plan, *shapes]:
        r = testing.check_attention(q, kv, ctx, scale, config=cfg)
        assert r["unwritten"] == 0 and r["rel_err"] < 1e-2, (cfg, r)
        new = A.paged_attention(q, kv, ctx, scale, config=cfg)
        # the same products of the same bf16 values; only the order of fp32 sums may differ
        assert testing.rel_err(new, old) < 2e-3, cfg
