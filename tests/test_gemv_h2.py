"""The fp16x2 variants of the decode GEMV (GemvConfig.nvfp4_h2, GemvConfig.fp8_h2; engine/kernels/gemv_kernel.py).

Their PTX cannot run in Triton's interpreter, so it is emulated here instruction by instruction: the
byte-permute E2M1 decode for all 16 codes in each of the 16 nibble positions of a group, the e4m3 pair
conversion for all 256 bytes in each of the 16 byte positions of a unit, and the fp16x2 partial sums
against float64 sums. The kernels themselves (their Triton-op twins under the interpreter, the PTX on
a GPU) are held to the reference dequantizer in tests/test_quant_kernels.py.
"""

from __future__ import annotations

import importlib.util
import random

import numpy as np
import pytest
import torch

# find_spec, not import: importing triton here, at collection, would fix its language module in compiled
# mode before tests/test_kernels_interpret.py can switch the process to the interpreter
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton importable")

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7]


def _e4m3(byte: int) -> float:
    return float(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float())


def _f16(bits: int) -> float:
    return float(np.array([bits & 0xFFFF], dtype=np.uint16).view(np.float16)[0])


def _f16_bits(x: float) -> int:
    return int(np.array([x], dtype=np.float16).view(np.uint16)[0])


def _f32(bits: int) -> float:
    return float(np.array([bits & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0])


def _f32_bits(x: float) -> int:
    return int(np.array([x], dtype=np.float32).view(np.uint32)[0])


def _h2(bits: int) -> tuple[float, float]:
    return _f16(bits), _f16(bits >> 16)


def _pack_h2(lo: float, hi: float) -> int:
    return _f16_bits(lo) | _f16_bits(hi) << 16


def _run_ptx(ptx: str, inputs: dict[str, int]) -> int:
    """Emulate the instructions the GEMV's PTX uses on 32/16-bit registers held as bit patterns; returns $0.
    fp16 arithmetic rounds once per instruction (the products of two fp16 values are exact in float64)."""
    regs = dict(inputs)

    def val(a: str) -> int:
        return regs[a] if a in regs else int(a, 0)

    for stmt in ptx.replace("\n", " ").split(";"):
        stmt = stmt.strip().lstrip("{").strip().rstrip("}").strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):                  # unpack a 32-bit register into two halves
            lo, hi = (r.strip() for r in rest[1:rest.index("}")].split(","))
            v = val(rest[rest.index("}") + 1:].strip(" ,"))
            regs[lo], regs[hi] = v & 0xFFFF, v >> 16 & 0xFFFF
            continue
        dst, *args = (a.strip() for a in rest.split(","))
        if op == "mov.b32":
            regs[dst] = val(args[0]) & 0xFFFFFFFF
        elif op == "and.b32":
            regs[dst] = val(args[0]) & val(args[1])
        elif op == "or.b32":
            regs[dst] = val(args[0]) | val(args[1])
        elif op == "shl.b32":
            regs[dst] = val(args[0]) << val(args[1]) & 0xFFFFFFFF
        elif op == "shr.u32":
            regs[dst] = val(args[0]) >> val(args[1])
        elif op == "prmt.b32":                      # default mode: selector nibble = source byte 0..7
            a, b, sel = (val(x) for x in args)
            src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
            assert all((sel >> 4 * i) & 0x8 == 0 for i in range(4)), "sign-replicate mode not emulated"
            regs[dst] = sum(src[(sel >> 4 * i) & 0x7] << 8 * i for i in range(4))
        elif op == "mul.rn.f16x2":
            a, b = (_h2(val(x)) for x in args)
            regs[dst] = _pack_h2(a[0] * b[0], a[1] * b[1])
        elif op == "fma.rn.f16x2":
            a, b, c = (_h2(val(x)) for x in args)
            regs[dst] = _pack_h2(a[0] * b[0] + c[0], a[1] * b[1] + c[1])
        elif op == "cvt.f32.f16":
            regs[dst] = _f32_bits(_f16(val(args[0])))
        elif op == "add.f32":
            regs[dst] = _f32_bits(np.float32(_f32(val(args[0]))) + np.float32(_f32(val(args[1]))))
        elif op == "cvt.rn.f16x2.f32":             # first source to the high half
            regs[dst] = _pack_h2(_f32(val(args[1])), _f32(val(args[0])))
        elif op == "cvt.rn.f16x2.e4m3x2":          # byte 0 to the low half (cuda_fp8.hpp's order)
            v = val(args[0])
            regs[dst] = _pack_h2(_e4m3(v & 0xFF), _e4m3(v >> 8 & 0xFF))
        else:
            raise AssertionError(f"instruction {op} is not emulated")
    return regs["$0"]


def _x_pack(hi: float, lo: float, shift: int) -> int:
    # the kernel's _x_pair / _x_pair_nat: scale in fp32, then cvt.rn.f16x2.f32 (hi to the high half)
    from engine.kernels.gemv_kernel import F16X2_PACK_ASM
    return _run_ptx(F16X2_PACK_ASM.value, {"$1": _f32_bits(hi * 2.0 ** -shift), "$2": _f32_bits(lo * 2.0 ** -shift)})


def _nvfp4_group(codes: list[int], x: list[float], shift: int) -> float:
    """The group PTX on 16 codes (column order) and 16 activations; returns the fp32 sum (x 2^shift)."""
    from engine.kernels.gemv_kernel import E2M1_F16_HI, E2M1_GROUP_H2_ASM
    words = [sum(codes[8 * w + i] << 4 * i for i in range(8)) for w in range(2)]
    xs = [float(torch.tensor(v).to(torch.bfloat16)) for v in x]
    ops = {"$1": words[0], "$2": words[1], "$11": E2M1_F16_HI[0]}
    for w in range(2):
        c = 8 * w
        # decode order of a word: columns 1|5, 3|7, 0|4, 2|6 (low|high half), as the kernel's _x_pair calls
        for j, (a, b) in enumerate(((1, 5), (3, 7), (0, 4), (2, 6))):
            ops[f"${3 + 4 * w + j}"] = _x_pack(xs[c + b], xs[c + a], shift)
    return _f32(_run_ptx(E2M1_GROUP_H2_ASM.value, ops)) * 2.0 ** shift


def test_nvfp4_group_ptx_decodes_every_code_in_every_position():
    """One-hot activations pick out one decoded value: exact, for all 16 codes in all 16 columns, with
    random codes in the other columns."""
    rng = random.Random(0)
    for pos in range(16):
        for code in range(16):
            codes = [rng.randrange(16) for _ in range(16)]
            codes[pos] = code
            for xv in (1.0, -3.0, 0.375):
                x = [0.0] * 16
                x[pos] = xv
                assert _nvfp4_group(codes, x, 6) == _e2m1(code) * xv, (pos, code, xv)


def _f64_dot(vals: list[float], x: list[float]) -> float:
    return float(sum(np.float64(v) * np.float64(a) for v, a in zip(vals, x)))


def test_nvfp4_group_ptx_sums_within_fp16_rounding():
    """Random codes and activations: the fp16x2 sum of a group within 8 fp16 roundings per half of the
    sum of absolute products (the bound the kernel's accuracy rests on), for several activation scales."""
    rng = random.Random(1)
    for trial in range(300):
        codes = [rng.randrange(16) for _ in range(16)]
        scale = 10.0 ** rng.uniform(-3, 3)
        x = [float(torch.tensor(rng.gauss(0, scale)).to(torch.bfloat16)) for _ in range(16)]
        got = _nvfp4_group(codes, x, 6)
        vals = [_e2m1(c) for c in codes]
        want = _f64_dot(vals, x)
        bound = 10 * 2.0 ** -11 * sum(abs(v * a) for v, a in zip(vals, x)) + 16 * 2.0 ** -24 * 2.0 ** 6 * 6
        assert abs(got - want) <= bound, (trial, got, want, bound)


def _fp8_unit(byts: list[int], x: list[float], shift: int, chain: int) -> float:
    from engine.kernels.gemv_kernel import F8_UNIT_ASM
    ops = {f"${1 + w}": sum(byts[4 * w + i] << 8 * i for i in range(4)) for w in range(4)}
    for j in range(8):
        ops[f"${5 + j}"] = _x_pack(x[2 * j + 1], x[2 * j], shift)
    return _f32(_run_ptx(F8_UNIT_ASM[chain].value, ops)) * 2.0 ** shift


@pytest.mark.parametrize("chain", [1, 2, 4])
def test_fp8_unit_ptx_converts_every_byte_in_every_position(chain):
    rng = random.Random(chain)
    finite = [b for b in range(256) if b & 0x7F != 0x7F]                 # 0x7F / 0xFF are NaN in e4m3fn
    for pos in range(16):
        for byte in finite:
            byts = [rng.choice(finite) for _ in range(16)]
            byts[pos] = byte
            x = [0.0] * 16
            x[pos] = 0.75
            assert _fp8_unit(byts, x, 8, chain) == _e4m3(byte) * 0.75, (pos, byte)


@pytest.mark.parametrize("chain", [1, 2, 4])
def test_fp8_unit_ptx_sums_within_fp16_rounding(chain):
    rng = random.Random(10 + chain)
    finite = [b for b in range(256) if b & 0x7F != 0x7F]
    for trial in range(200):
        byts = [rng.choice(finite) for _ in range(16)]
        scale = 10.0 ** rng.uniform(-2, 2)
        x = [float(torch.tensor(rng.gauss(0, scale)).to(torch.bfloat16)) for _ in range(16)]
        got = _fp8_unit(byts, x, 8, chain)
        vals = [_e4m3(b) for b in byts]
        want = _f64_dot(vals, x)
        bound = (2 * chain + 2) * 2.0 ** -11 * sum(abs(v * a) for v, a in zip(vals, x)) + 16 * 448 * 2.0 ** -24 * 2.0 ** 8
        assert abs(got - want) <= bound, (trial, got, want, bound)


def test_e2m1_table_is_the_fp16_high_bytes():
    from engine.kernels.gemv_kernel import E2M1_F16_HI
    table = E2M1_F16_HI[0] | E2M1_F16_HI[1] << 32
    for code, mag in enumerate(E2M1):
        assert _f16_bits(mag) == ((table >> 8 * code) & 0xFF) << 8, code


def test_h2_variants_fall_back_where_they_do_not_apply():
    """The variants take one bf16 row with 4-byte-aligned words; anything else runs the default kernel."""
    from engine.kernels.gemv import _h2_takes
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    w = torch.zeros(8, 128, dtype=torch.uint8)
    assert _h2_takes(x, w, 256, 256)
    assert not _h2_takes(torch.zeros(2, 256, dtype=torch.bfloat16), w, 256, 256)
    assert not _h2_takes(x.half(), w, 256, 256)
    assert not _h2_takes(x[:, 1:129], w, 128, 128)                    # odd bf16 offset: not 4-byte aligned
    assert not _h2_takes(x, torch.zeros(8, 130, dtype=torch.uint8)[:, :128], 256, 256)


def _emulate_nvfp4_h2(wt: dict, x: torch.Tensor, shift: int) -> torch.Tensor:
    """The kernel's arithmetic in torch: fp16 activations x 2^-shift, one fp16 rounding per product-add in
    the PTX's lane order (8 columns per half of a group), fp32 from the group on. x: [1, K] -> [N]."""
    from engine.quant import formats as F
    vals = F.e2m1_values()[F.unpack_e2m1(wt["weight"]).long()]                   # [N, K]
    n, k = vals.shape
    v = vals.view(n, k // 16, 16).double()
    xs = (x.float() * 2.0 ** -shift).half()[0].view(k // 16, 16).double()
    g = torch.zeros(n, k // 16)
    for order in ((1, 3, 0, 2, 9, 11, 8, 10), (5, 7, 4, 6, 13, 15, 12, 14)):
        h = torch.zeros(n, k // 16, dtype=torch.float64)
        for c in order:
            h = (h + v[:, :, c] * xs[None, :, c]).half().double()
        g += h.float()
    return (g * wt["scale"].float()).sum(1) * wt["row_scale"] * 2.0 ** shift


def _emulate_fp8_h2(wt: dict, x: torch.Tensor, shift: int, chain: int) -> torch.Tensor:
    """As above for FP8: halves take the even / odd columns of a word, flushed to fp32 every `chain` words."""
    q = wt["weight"].float()
    n, k = q.shape
    v = q.view(n, k // 16, 16).double()
    xs = (x.float() * 2.0 ** -shift).half()[0].view(k // 16, 16).double()
    g = torch.zeros(n, k // 16)
    for half in (0, 1):
        h = torch.zeros(n, k // 16, dtype=torch.float64)
        for w in range(4):
            if w % chain == 0:
                h = torch.zeros_like(h)
            for c in (4 * w + half, 4 * w + 2 + half):
                h = (h + v[:, :, c] * xs[None, :, c]).half().double()
            if (w + 1) % chain == 0:
                g += h.float()
    s = wt["scale"].repeat_interleave(128, 1)[:, :k:16].repeat_interleave(128, 0)[:n]
    return (g * s).sum(1) * 2.0 ** shift


@pytest.mark.parametrize("outliers", [False, True])
def test_fp16_partials_stay_far_below_the_kernel_tolerance(outliers):
    """At a real layer's K, with activations ~N(0, 1) or with eight of them at +-2000 (the partials' fp16
    range), the variants' arithmetic before the bf16 output rounding is within 2^-10 of the largest output
    (the tests' bound is 2^-8, and bf16 rounding alone reaches ~2^-9)."""
    from tools import quant_kernel_checks as QC
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 4096, generator=gen)
    if outliers:
        x[0, torch.randperm(4096, generator=gen)[:8]] = 2000.0 * torch.sign(torch.randn(8, generator=gen))
    x = x.to(torch.bfloat16)
    for fmt in ("nvfp4", "fp8"):
        wt = QC.make_weights(fmt, 256, 4096, "cpu", seed=6)
        ref = (x.double() @ wt["ref"].double().T)[0]
        ys = [_emulate_nvfp4_h2(wt, x, 6)] if fmt == "nvfp4" else [_emulate_fp8_h2(wt, x, 8, c) for c in (1, 2, 4)]
        for y in ys:
            assert bool(torch.isfinite(y).all())
            assert float((y.double() - ref).abs().max() / ref.abs().max()) < 2 ** -10, fmt
