"""Compile the integer weight-only kernels (engine/kernels/linear/int_gemm.py) for NVIDIA targets on a machine
without a GPU, and print each variant's register, stack and spill use:

    python -m tools.dev.int_kernels_compile [--targets 80,89,90] [--all]

Triton compiles ahead of time for a named target (triton.compile of an ASTSource with a GPUTarget) and ships
ptxas and cuobjdump, so a kernel that does not compile for sm_80 (A100), sm_89 (L4/L40) or sm_90 (H100/H200)
fails here, not on the first GPU run. Must run without TRITON_INTERPRET (the interpreter replaces the kernels).
Only the GPU says how fast a variant runs.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

# the launch shapes int_gemm.int_matmul uses: (kernel, BLOCK_M, BLOCK_N, BLOCK_K)
LAUNCHES = (("gemv", 1, 64, 64), ("gemv", 4, 64, 64), ("gemm", 16, 64, 64), ("gemm", 64, 64, 64))


def compile_variant(kernel: str, block: tuple[int, int, int], bits: int, act_order: bool, cap: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.kernels.linear import int_gemm
    fn = int_gemm._int_gemv_kernel if kernel == "gemv" else int_gemm._int_gemm_kernel
    sig = {n: "i32" for n in fn.arg_names}
    sig.update({"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*fp32", "g_ptr": "*i32", "o_ptr": "*bf16"})
    consts = {"BITS": bits, "ACT_ORDER": act_order, "BLOCK_M": block[0], "BLOCK_N": block[1], "BLOCK_K": block[2]}
    sig.update({c: "constexpr" for c in consts})
    # pointers and row strides are 16-aligned at the engine's shapes, as Triton's run-time specialization marks them
    aligned = ("x_ptr", "w_ptr", "s_ptr", "z_ptr", "g_ptr", "o_ptr", "K", "stride_xm", "stride_om")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", cap, 32), options={"num_warps": 4})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"(REG|STACK|LOCAL|SHARED):(\d+)", usage))
    return {k: int(v) for k, v in found.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="80,89,90")
    ap.add_argument("--all", action="store_true", help="every launch shape (default: one decode and one prefill)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 replaces the kernels with the interpreter: unset it", file=sys.stderr)
        return 2
    launches = LAUNCHES if args.all else (LAUNCHES[1], LAUNCHES[3])
    print("target kernel  BLOCK_MxNxK  bits act_order  REG STACK LOCAL")
    for cap in (int(t) for t in args.targets.split(",")):
        for kernel, *block in launches:
            for bits, act in ((4, False), (8, False), (4, True)):
                r = compile_variant(kernel, tuple(block), bits, act, cap)
                print(f"sm_{cap}  {kernel}  {'x'.join(map(str, block)):>11}  {bits:>4} {str(act):>9}  "
                      f"{r.get('REG', 0):>3} {r.get('STACK', 0):>5} {r.get('LOCAL', 0):>5}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
