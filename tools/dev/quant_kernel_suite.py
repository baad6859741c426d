"""One GPU run for the quantized matmuls: correctness, then timings against the bytes roofline.

    PYTHONUNBUFFERED=1 python3 tools/dev/quant_kernel_suite.py [--skip-tests] [--tests-timeout 150]

1. pytest tests/engine/kernels/linear/test_quant_kernels.py tests/engine/quant/test_quant_gpu.py (log in $OUT/pytest.log);
2. copy bandwidth (device-to-device) and a bf16 matmul rate, measured here;
3. decode: every linear layer of qwen3-8b (36 layers, distinct weights) replayed as one CUDA graph,
   rows M = 1 and 8, in bf16 (cuBLAS), FP8 and NVFP4 (the skinny kernel), with a sweep of launch
   shapes; the figure is ms per pass and the fraction of the copy bandwidth its bytes reach;
4. prefill M = 4096 at each qwen3-8b layer shape: bf16 cuBLAS, FP8 block-scaled torch GEMM with the
   activation quantization, FP8 rowwise torch._scaled_mm (a peer), FP8 and NVFP4 dequantized to
   bf16 then cuBLAS; TFLOP/s.
Prints a table last; JSON to $OUT/quant_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.kernels.linear import quant_gemm as Q   # noqa: E402
from engine.quant import formats              # noqa: E402
from tools.bench.timing import time_fn         # noqa: E402

DEV = torch.device("cuda")
OUT = Path(os.environ.get("OUT", "/tmp"))
RESULT: dict = {"decode": [], "sweep": [], "prefill": []}


def layer_shapes(h, q, kv, f) -> dict[str, tuple[int, int]]:
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * f, h), "down": (h, f)}


SHAPES = {"qwen3-8b": (36, layer_shapes(4096, 4096, 1024, 12288)),
          "qwen3-32b": (64, layer_shapes(5120, 8192, 1024, 25600))}


def events_ms(fn, reps=20) -> float:
    """Median milliseconds of `reps` calls (CUDA events), after one untimed call."""
    times = time_fn(fn, "cuda", warmup=1, repeats=reps)
    return sorted(times)[len(times) // 2] * 1e3


def copy_bandwidth() -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = events_ms(lambda: dst.copy_(src), 10)
    del src, dst
    return 2 * (2 << 30) / (ms / 1e3)


def make_layer(fmt: str, n: int, k: int):
    """Random weights of one layer in a format, made on the device; returns (callable(x), bytes)."""
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * k ** -0.5
    if fmt == "bf16":
        return (lambda x: F.linear(x, w)), w.numel() * 2
    if fmt == "fp8":
        q, s = formats.quantize_fp8_block(w)
        del w
        return (lambda x, cfg=None: Q.skinny(x, "fp8", q, s, None, n, (128, 128), cfg),
                q.numel() + s.numel() * 4, ("fp8", q, s))
    p, s, s2 = formats.quantize_nvfp4(w)
    del w
    rs = torch.full((n,), float(s2), device=DEV)
    return (lambda x, cfg=None: Q.skinny(x, "nvfp4", p, s, rs, n, config=cfg),
            p.numel() + s.numel() + rs.numel() * 4, ("nvfp4", p, s, rs))


def graph_ms(fn) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return events_ms(g.replay, 10)


def decode(shape: str, bw: float, sweep: bool) -> None:
    layers, shapes = SHAPES[shape]
    for fmt in ("bf16", "fp8", "nvfp4"):
        model = [[make_layer(fmt, n, k) for (n, k) in shapes.values()] for _ in range(layers)]
        nbytes = sum(l[1] for layer in model for l in layer)
        configs = [None]
        if sweep and fmt == "fp8":
            configs += [Q.GemmConfig(bn, 128, w, st, 0, pps) for bn, w, st, pps in
                        ((128, 4, 4, 4), (32, 4, 4, 4), (64, 4, 3, 8), (64, 8, 4, 4))]
        elif sweep and fmt == "nvfp4":
            configs += [Q.GemmConfig(bn, bk, w, st, 0, pps) for bn, bk, w, st, pps in
                        ((128, 256, 4, 4, 4), (64, 512, 4, 3, 4), (64, 128, 4, 4, 4), (64, 256, 8, 4, 8))]
        for M in (1, 8):
            xs = {k: torch.randn(M, k, device=DEV, dtype=torch.bfloat16) for _, k in shapes.values()}
            for cfg in configs:
                def run(cfg=cfg):
                    for layer in model:
                        for (fn, *_), (n, k) in zip(layer, shapes.values()):
                            fn(xs[k]) if fmt == "bf16" else fn(xs[k], cfg)
                try:
                    ms = graph_ms(run)
                except Exception as e:  # noqa: BLE001 - a launch shape that does not compile is a result
                    RESULT["sweep"].append({"shape": shape, "fmt": fmt, "M": M, "config": repr(cfg), "error": str(e)[:200]})
                    continue
                row = {"shape": shape, "fmt": fmt, "M": M, "config": repr(cfg) if cfg else "default",
                       "ms": ms, "bytes": nbytes, "roofline_fraction": nbytes / bw / (ms / 1e3)}
                (RESULT["decode"] if cfg is None else RESULT["sweep"]).append(row)
                print(f"decode {shape} {fmt:6s} M={M} {row['config'][:60]:60s} {ms:7.3f} ms "
                      f"{row['roofline_fraction']:.2f} of copy bw", flush=True)
        del model
        torch.cuda.empty_cache()


def prefill(mm_rate: float) -> None:
    _, shapes = SHAPES["qwen3-8b"]
    M = 4096
    for name, (n, k) in shapes.items():
        x = torch.randn(M, k, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * k ** -0.5
        flops = 2 * M * n * k
        rows = {"bf16": lambda: F.linear(x, w)}
        q, s = formats.quantize_fp8_block(w)
        rows["fp8_blockwise_scaled_mm"] = lambda: Q._scaled_mm_blockwise(x, q, s)
        rows["fp8_activation_quant_only"] = lambda: Q.quantize_activations(x)
        rows["fp8_dequant_bf16_cublas"] = lambda: F.linear(x, Q.dequantize("fp8", q, s, None, n, k, torch.bfloat16))
        try:
            row_scale_a = (x.abs().amax(1, keepdim=True).float() / 448).clamp(min=1e-12)
            xa = (x / row_scale_a).to(torch.float8_e4m3fn)
            wq = (w.float() / (w.abs().amax(1, keepdim=True).float() / 448)).to(torch.float8_e4m3fn)
            sw = (w.abs().amax(1, keepdim=True).float() / 448).reshape(1, n)
            rows["fp8_scaled_mm_rowwise_peer"] = lambda: torch._scaled_mm(xa, wq.t(), scale_a=row_scale_a, scale_b=sw,
                                                                           out_dtype=torch.bfloat16)
        except Exception as e:  # noqa: BLE001
            RESULT["prefill"].append({"layer": name, "kind": "fp8_scaled_mm_rowwise_peer", "error": str(e)[:200]})
        p, s4, s2 = formats.quantize_nvfp4(w)
        rs = torch.full((n,), float(s2), device=DEV)
        rows["nvfp4_dequant_bf16_cublas"] = lambda: F.linear(x, Q.dequantize("nvfp4", p, s4, rs, n, k, torch.bfloat16))
        rows["nvfp4_dequant_only"] = lambda: Q.dequantize("nvfp4", p, s4, rs, n, k, torch.bfloat16)
        for kind, fn in rows.items():
            try:
                ms = events_ms(fn, 10)
            except Exception as e:  # noqa: BLE001
                RESULT["prefill"].append({"layer": name, "kind": kind, "error": str(e)[:300]})
                print(f"prefill {name} {kind}: ERROR {str(e)[:300]}", flush=True)
                continue
            RESULT["prefill"].append({"layer": name, "kind": kind, "ms": ms, "tflops": flops / ms / 1e9,
                                      "of_bf16_matmul_peak": flops / (ms / 1e3) / mm_rate})
            print(f"prefill {name:8s} {kind:28s} {ms:7.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--tests-timeout", type=int, default=150)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-32b", action="store_true")
    ap.add_argument("--tests", nargs="*", default=["tests/engine/kernels/linear/test_quant_kernels.py", "tests/engine/quant/test_quant_gpu.py"])
    args = ap.parse_args()
    if not args.skip_tests:
        t0 = time.time()
        with open(OUT / "pytest.log", "w") as log:
            try:
                rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                     *args.tests], cwd=ROOT, stdout=log,
                                    stderr=subprocess.STDOUT, timeout=args.tests_timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        tail = (OUT / "pytest.log").read_text().strip().splitlines()[-3:]
        RESULT["pytest"] = {"rc": rc, "tail": tail, "seconds": round(time.time() - t0, 1)}
        print("pytest:", rc, *tail, sep="\n  ", flush=True)
    bw = copy_bandwidth()
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    mm = 2 * 8192 ** 3 / (events_ms(lambda: a @ a, 10) / 1e3)
    del a
    RESULT.update(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_bandwidth_Bps=bw, bf16_matmul_flops=mm)
    print(f"copy {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    for step in (lambda: decode("qwen3-8b", bw, not args.no_sweep), lambda: prefill(mm),
                 lambda: None if args.no_32b else decode("qwen3-32b", bw, False)):
        try:
            step()
        except Exception as e:  # noqa: BLE001
            import traceback
            RESULT.setdefault("errors", []).append(traceback.format_exc()[-1500:])
            print("ERROR", e, flush=True)
        (OUT / "quant_kernels.json").write_text(json.dumps(RESULT, indent=1))
    print("\n== decode linears per token (CUDA graph of every layer) ==")
    for r in RESULT["decode"]:
        print(f"{r['shape']:10s} {r['fmt']:6s} M={r['M']}  {r['ms']:7.3f} ms  {r['bytes'] / 1e9:6.2f} GB  "
              f"{r['roofline_fraction']:.2f} of copy bw")
    best = {}
    for r in RESULT["sweep"]:
        if "ms" in r and ((r["fmt"], r["M"]) not in best or r["ms"] < best[(r["fmt"], r["M"])]["ms"]):
            best[(r["fmt"], r["M"])] = r
    for (fmt, M), r in best.items():
        print(f"best swept {fmt} M={M}: {r['config']} {r['ms']:.3f} ms ({r['roofline_fraction']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
