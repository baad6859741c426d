"""The instruction mix of the quantized skinny kernel for sm_90, compiled here without a GPU:

    TRITON_DEFAULT_FP_FUSION=1 python -m tools.dev.quant_kernels_sass [--block-n 64] [--block-k-fp8 128] [--block-k-nvfp4 256]

Triton compiles ahead of time for a named target and ships ptxas and cuobjdump, so the SASS of a
launch shape can be read on a CPU machine. Integer arguments and pointers are marked divisible by 16,
as Triton's run-time specialization marks them for the engine's shapes. The counts say where issue
slots go per loop (conversions, address arithmetic, loads); only the GPU says how fast it runs.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.kernels.linear import quant_gemm as Q

DIVISIBLE = ("x_ptr", "w_ptr", "s_ptr", "rs_ptr", "o_ptr", "N", "K", "stride_xm", "stride_wn", "stride_sn",
             "stride_om", "stride_osplit", "k_per_split")


def sass(fmt: str, block_m: int, block_n: int, block_k: int, warps: int = 4, stages: int = 4, asm: bool = False) -> tuple[dict, str]:
    nv = fmt == "nvfp4"
    sig = {"x_ptr": "*bf16", "w_ptr": "*u8" if nv else "*fp8e4nv", "s_ptr": "*fp8e4nv" if nv else "*fp32",
           "rs_ptr": "*fp32", "o_ptr": "*bf16", **{a: "i32" for a in (
               "M", "N", "K", "stride_xm", "stride_wn", "stride_sn", "stride_om", "stride_osplit", "k_per_split",
               "scale_br", "scale_bc")}, **{c: "constexpr" for c in ("FMT", "BLOCK_M", "BLOCK_N", "BLOCK_K", "ASM")}}
    names = Q._skinny_kernel.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in DIVISIBLE}
    consts = {"FMT": Q.NVFP4_CODE if nv else Q.FP8_CODE, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "ASM": asm}
    k = triton.compile(ASTSource(Q._skinny_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    ops = collections.Counter(m.group(2) for m in (
        re.match(r"\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)", line) for line in text.splitlines()) if m)
    return dict(ops), text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--block-k-fp8", type=int, default=128)
    ap.add_argument("--block-k-nvfp4", type=int, default=256)
    args = ap.parse_args()
    for fmt, bk in (("fp8", args.block_k_fp8), ("nvfp4", args.block_k_nvfp4)):
        ops, _ = sass(fmt, 16, args.block_n, bk)
        weight_bytes = args.block_n * (bk if fmt == "fp8" else bk // 2)
        loads = {k: v for k, v in ops.items() if k.startswith(("LDG", "LDS", "STS", "LDL", "STL"))}
        print(f"{fmt}: tile {args.block_n}x{bk} ({weight_bytes} weight bytes per loop, 128 threads), "
              f"{sum(ops.values())} instructions in the kernel; memory {loads}")
        print("   top: " + ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:12]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
