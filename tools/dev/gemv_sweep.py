"""One GPU run for the decode GEMV (engine/kernels/linear/gemv.py): correctness against the reference
dequantizer, then a timing table at the qwen3-8b/32b layer shapes and their TP=2 shards.

    PYTHONUNBUFFERED=1 python3 -m tools.dev.gemv_sweep [--budget-s 140] [--rows 1,4,8,2]

Each point is a CUDA graph of 20 calls that cycle through enough copies of the layer's weight to
exceed the 60 MB L2 several times over (so every call streams its weight from HBM), timed by CUDA
events (median of 7 replays). The figure is GB/s of weight bytes (values and scales) and its fraction
of a device-to-device copy measured in the same run. Compared per shape: our GEMV launch shapes,
the tensor-core `skinny` kernel of quant_gemm.py (before) and cuBLAS (bf16). JSON to $OUT/gemv_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.kernels.linear import gemv as G          # noqa: E402
from engine.kernels.linear import quant_gemm as Q    # noqa: E402
from engine.kernels.linear.skinny_gemm import skinny_dense  # noqa: E402
from tests.support import quant_kernel_checks as QC    # noqa: E402
from tools.bench.timing import copy_bandwidth_Bps, graph_seconds, time_fn  # noqa: E402

DRY = os.environ.get("GEMV_SWEEP_CPU") == "1"        # a dry run of the script's logic on a CPU (interpreter)
DEV = torch.device("cpu" if DRY else "cuda")
OUT = Path(os.environ.get("OUT", "/tmp"))
T0 = time.time()


def layer_shapes(h, q, kv, f) -> dict[str, tuple[int, int]]:
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * f, h), "down": (h, f)}


def all_shapes() -> list[tuple[str, int, int]]:
    out = []
    for model, (h, q, kv, f) in (("8b", (4096, 4096, 1024, 12288)), ("32b", (5120, 8192, 1024, 25600))):
        for name, (n, k) in layer_shapes(h, q, kv, f).items():
            out.append((f"{model} {name}", n, k))
        for name, (n, k) in layer_shapes(h, q, kv, f).items():
            col = name in ("qkv", "gate_up")
            out.append((f"{model} {name} tp2", n // 2 if col else n, k if col else k // 2))
    out += [("8b lm_head", 151936, 4096), ("8b lm_head tp2", 75968, 4096)]      # bf16 only
    return out


VARIANTS = {
    "fp8": {"g8x512": G.GemvConfig(8, 512, 4), "g16x512": G.GemvConfig(16, 512, 4), "g4x512": G.GemvConfig(4, 512, 4),
            "g8x1024": G.GemvConfig(8, 1024, 4), "g16x256": G.GemvConfig(16, 256, 4),
            "g8x512w8": G.GemvConfig(8, 512, 8), "g8x512s2": G.GemvConfig(8, 512, 4, 1, 2),
            "g8x512x1d": G.GemvConfig(8, 512, 4, x2d=False), "g8x2048": G.GemvConfig(8, 2048, 4),
            "g16x1024": G.GemvConfig(16, 1024, 4), "g8x1024w8": G.GemvConfig(8, 1024, 8),
            "g4x1024": G.GemvConfig(4, 1024, 4), "g4x2048": G.GemvConfig(4, 2048, 4), "g2x2048": G.GemvConfig(2, 2048, 4),
            "g16x1024w8": G.GemvConfig(16, 1024, 8)},
    "nvfp4": {"g8x1024": G.GemvConfig(8, 1024, 4), "g16x1024": G.GemvConfig(16, 1024, 4),
              "g4x1024": G.GemvConfig(4, 1024, 4), "g8x512": G.GemvConfig(8, 512, 4), "g8x2048": G.GemvConfig(8, 2048, 4),
              "g16x512": G.GemvConfig(16, 512, 4), "g8x1024noasm": G.GemvConfig(8, 1024, 4, asm=False),
              "g8x1024s2": G.GemvConfig(8, 1024, 4, 1, 2)},
    "bf16": {"g8x256": G.GemvConfig(8, 256, 4), "g16x256": G.GemvConfig(16, 256, 4), "g4x512": G.GemvConfig(4, 512, 4),
             "g8x512": G.GemvConfig(8, 512, 4), "g8x256x1d": G.GemvConfig(8, 256, 4, x2d=False),
             # fewer, larger steps per program: the small layers (8b o, qkv) look bound by each program's chain
             # of dependent tile loads (8 at 4x512 over K = 4096), not by bandwidth
             "g4x1024": G.GemvConfig(4, 1024, 4), "g4x2048": G.GemvConfig(4, 2048, 4),
             "g2x1024": G.GemvConfig(2, 1024, 4), "g2x2048": G.GemvConfig(2, 2048, 4),
             "g4x1024w8": G.GemvConfig(4, 1024, 8), "g4x512s2": G.GemvConfig(4, 512, 4, split=2),
             # read as 32-bit words of two values (GemvConfig.pairs): ~30-45 % fewer instructions a value
             "g2x1024p": G.GemvConfig(2, 1024, 4, pairs=True), "g4x512p": G.GemvConfig(4, 512, 4, pairs=True),
             "g4x1024p": G.GemvConfig(4, 1024, 4, pairs=True), "g2x2048p": G.GemvConfig(2, 2048, 4, pairs=True),
             # the one-row default: word pairs with the first tile read before the PDL wait (GemvConfig.preload)
             "g2x1024pl": G.GemvConfig(2, 1024, 4, pairs=True, preload=True)},
}
# at M > 1 only these (compile time)
MULTI_ROW = {"fp8": ("g8x512", "g16x256", "g8x512x1d", "g4x1024"), "nvfp4": ("g8x1024", "g16x512"),
             "bf16": ("skinny_dense", "g8x256", "g2x1024", "g4x1024", "g4x512", "g2x2048", "g2x1024p", "g4x1024p",
                      "g4x512p", "g2x2048p")}


def random_layer(fmt: str, n: int, k: int) -> dict:
    """Random bits in the layer's layout (speed does not depend on the values; no NaN codes)."""
    if fmt == "bf16":
        return {"w": torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02}
    if fmt == "fp8":
        w = (torch.randint(0, 256, (n, k), device=DEV, dtype=torch.uint8) & 0xBF).view(torch.float8_e4m3fn)
        return {"w": w, "s": torch.rand(-(-n // 128), -(-k // 128), device=DEV) * 1e-3}
    p = torch.randint(0, 256, (n, k // 2), device=DEV, dtype=torch.uint8)
    s = (torch.randint(0, 256, (n, k // 16), device=DEV, dtype=torch.uint8) & 0x3F).view(torch.float8_e4m3fn)
    return {"w": p, "s": s, "rs": torch.full((n,), 1e-3, device=DEV)}


def layer_bytes(layer: dict) -> int:
    return sum(t.numel() * t.element_size() for t in layer.values())


def call(fmt: str, variant: str, layer: dict, x: torch.Tensor, n: int):
    if variant == "cublas":
        return lambda: F.linear(x, layer["w"])
    if variant == "skinny_dense":                  # the bf16 tensor-core skinny GEMM the engine takes at 2..16 rows
        return lambda: skinny_dense(x, layer["w"])
    if variant == "skinny_asm":
        return lambda: Q.skinny(x, "nvfp4", layer["w"], layer["s"], layer["rs"], n,
                                config=Q.GemmConfig(64, 256, 4, 4, asm=True))
    if variant == "skinny":
        if fmt == "fp8":
            return lambda: Q.skinny(x, "fp8", layer["w"], layer["s"], None, n)
        return lambda: Q.skinny(x, "nvfp4", layer["w"], layer["s"], layer["rs"], n)
    cfg = VARIANTS[fmt][variant]
    return lambda: G.gemv(x, fmt, layer["w"], layer.get("s"), layer.get("rs"), n, (128, 128), cfg)




def correctness(results: list) -> None:
    cases = [("fp8", 1, 6144, 4096, "g8x512"), ("fp8", 4, 4096, 12288, "g16x256"), ("fp8", 8, 5120, 2560, "g4x512"),
             ("fp8", 1, 4096, 4096, "g8x512s2"), ("nvfp4", 1, 6144, 4096, "g8x1024"),
             ("nvfp4", 4, 4096, 12288, "g16x512"), ("nvfp4", 8, 5120, 2560, "g4x1024"),
             ("nvfp4", 1, 4096, 4096, "g8x1024noasm"), ("nvfp4", 3, 4096, 4096, "g8x1024s2"),
             ("bf16", 1, 6144, 4096, "g8x256"), ("bf16", 4, 4096, 12288, "g16x256"), ("bf16", 7, 3000, 1000, "g8x512"),
             ("bf16", 1, 4096, 4096, "g4x1024"), ("bf16", 1, 4096, 4096, "g4x512s2"), ("bf16", 1, 6144, 4096, "g4x2048"),
             ("bf16", 1, 4096, 12288, "g2x1024"), ("bf16", 2, 6144, 4096, "g2x1024"), ("bf16", 4, 4096, 12288, "g4x1024"),
             ("bf16", 3, 3000, 1000, "g2x2048"), ("bf16", 1, 6144, 4096, "g2x1024p"), ("bf16", 2, 4096, 12288, "g4x1024p"),
             ("bf16", 4, 3000, 1000, "g4x512p"), ("bf16", 1, 4096, 4096, "g2x1024pl"), ("bf16", 1, 3000, 1000, "g2x1024pl"),
             ("fp8", 1, 4096, 12288, "g2x2048"), ("fp8", 1, 6144, 4096, "g4x1024")]
    if DEV.type == "cpu":
        cases = [(f, m, 64 if n != 3000 else 60, 512 if k != 1000 else 96, v) for f, m, n, k, v in cases]
    for fmt, m, n, k, v in cases:
        try:
            r = QC.check_gemv(fmt, m, n, k, DEV.type, seed=m + n, config=VARIANTS[fmt][v])
        except Exception as e:  # noqa: BLE001 - a variant that fails to build is a result
            r = {"error": str(e)[-400:]}
        r.update(fmt=fmt, M=m, N=n, K=k, variant=v, ok=r.get("unwritten") == 0 and r.get("rel_err", 1) < 2 ** -8)
        results.append(r)
        print(f"check {fmt:5s} M={m} {n}x{k} {v:14s} {'OK ' if r['ok'] else 'BAD'} {r.get('rel_err', r.get('error'))}",
              flush=True)
    for fmt in ("fp8", "nvfp4"):
        n, k = (3072, 4096) if DEV.type == "cuda" else (48, 256)
        r = QC.check_dequantize(fmt, n, k, DEV.type, seed=7)
        ok = r["unwritten"] == 0 and r["exact_in_bf16"]
        results.append({"fmt": fmt, "dequantize": True, "ok": ok, **r})
        print(f"check dequantize {fmt}: {'OK' if ok else 'BAD'} {r}", flush=True)
    # the forced split's counters must stay armed across launches (graph replays reuse them)
    for fmt in ("fp8", "nvfp4"):
        v = "g8x512s2" if fmt == "fp8" else "g8x1024s2"
        n, k = (2048, 4096) if DEV.type == "cuda" else (64, 1024)
        r = QC.check_gemv(fmt, 4, n, k, DEV.type, seed=11, config=VARIANTS[fmt][v])
        r2 = QC.check_gemv(fmt, 4, n, k, DEV.type, seed=11, config=VARIANTS[fmt][v])
        ok = r2["rel_err"] == r["rel_err"] and r["rel_err"] < 2 ** -8
        results.append({"fmt": fmt, "variant": v, "repeat_split": True, "ok": ok, **r2})
        print(f"check {fmt} split repeated: {'OK' if ok else 'BAD'} {r['rel_err']} {r2['rel_err']}", flush=True)


PREFILL_CONFIGS = {"128x128w8s3": (128, 128, 8, 3), "128x256w8s3": (128, 256, 8, 3), "128x128w4s4": (128, 128, 4, 4),
                   "64x256w4s4": (64, 256, 4, 4)}


def prefill(result: dict, bw: float, layers: list[str] | None = None, configs: list[str] | None = None) -> None:
    """Prefill at 4k tokens, qwen3-8b layer shapes: bf16 cuBLAS, FP8 block-scaled GEMM with the torch or
    the fused activation quantization, FP8 and NVFP4 dequantized to bf16 then cuBLAS, and what NVFP4
    converted to FP8 blocks at load time would cost in accuracy (its speed is the FP8 GEMM's)."""
    from engine.kernels.linear.act_quant import quantize_activations_fused
    from engine.kernels.linear.fp8_block_gemm import Fp8GemmConfig, fp8_block_gemm
    from engine.quant import formats
    M = 4096 if not DRY else 64
    rows = result.setdefault("prefill", [])
    shapes = layer_shapes(4096, 4096, 1024, 12288) if not DRY else {"qkv": (256, 512), "o": (128, 256)}
    if layers:
        shapes = {k: v for k, v in shapes.items() if k in layers}
    for name, (n, k) in shapes.items():
        x = torch.randn(M, k, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * k ** -0.5
        q, s = formats.quantize_fp8_block(w)
        p, s4, s2 = formats.quantize_nvfp4(w)
        rs = torch.full((n,), float(s2), device=DEV)
        a_t, sa_t = Q.quantize_activations(x)
        a_f, sa_f = quantize_activations_fused(x)
        same = bool(torch.equal(a_t.view(torch.uint8), a_f.view(torch.uint8)) and torch.equal(sa_t, sa_f))
        nv = formats.dequantize_nvfp4(p, s4, 1.0) * rs[:, None]
        q8, s8 = formats.quantize_fp8_block(nv)
        conv_err = float((formats.dequantize_fp8_block(q8, s8) - nv).norm() / nv.norm())
        quant_err = float((nv - w.float()).norm() / w.float().norm())
        del nv
        fns = {"bf16_cublas": lambda: F.linear(x, w),
               "fp8_blockwise_torch_actquant": lambda: Q._scaled_mm_blockwise(x, q, s, fused=False),
               "fp8_blockwise_fused_actquant": lambda: Q._scaled_mm_blockwise(x, q, s, fused=True),
               "actquant_torch_only": lambda: Q.quantize_activations(x),
               "actquant_fused_only": lambda: quantize_activations_fused(x),
               "fp8_dequant_cublas": lambda: F.linear(x, Q.dequantize("fp8", q, s, None, n, k, torch.bfloat16)),
               "nvfp4_dequant_cublas": lambda: F.linear(x, Q.dequantize("nvfp4", p, s4, rs, n, k, torch.bfloat16)),
               "nvfp4_dequant_only": lambda: Q.dequantize("nvfp4", p, s4, rs, n, k, torch.bfloat16)}
        def triton_fp8(cfg):
            a, sa = quantize_activations_fused(x, row_multiple=1)
            return fp8_block_gemm(a, sa, q, s, torch.bfloat16, config=cfg)
        chosen = {c: Fp8GemmConfig(*PREFILL_CONFIGS[c]) for c in (configs or PREFILL_CONFIGS)}
        for cname, cfg in chosen.items():
            fns[f"fp8_triton_{cname}"] = lambda cfg=cfg: triton_fp8(cfg)
        if name == next(iter(shapes)):
            a, sa = quantize_activations_fused(x, row_multiple=1)
            ref = formats.dequantize_fp8_block(a, sa, (1, 128)) @ formats.dequantize_fp8_block(q, s).T
            for cname, cfg in list(chosen.items())[:1]:
                y = fp8_block_gemm(a, sa, q, s, torch.bfloat16, rows=M - 96 if not DRY else M - 5, config=cfg)
                err = float((y.float() - ref[:y.shape[0]]).abs().max() / ref.abs().max())
                rows.append({"layer": name, "kind": f"check fp8_triton_{cname}", "rel_err": err, "ok": err < 2 ** -8})
                print(f"check fp8 triton gemm {cname}: rel err {err:.5f} ({'OK' if err < 2 ** -8 else 'BAD'})", flush=True)
            del ref
        flops = 2 * M * n * k
        for kind, fn in fns.items():
            try:
                t = time_fn(fn, DEV.type, warmup=2 if not DRY else 0, repeats=10 if not DRY else 1)
                ms = sorted(t)[len(t) // 2] * 1e3
            except Exception as e:  # noqa: BLE001
                rows.append({"layer": name, "kind": kind, "error": str(e)[-300:]})
                print(f"prefill {name} {kind}: ERROR {str(e)[-200:]}", flush=True)
                continue
            rows.append({"layer": name, "kind": kind, "ms": ms, "tflops": flops / ms / 1e9})
            print(f"prefill {name:8s} {kind:30s} {ms:7.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
        rows.append({"layer": name, "fused_actquant_equals_torch": same, "nvfp4_to_fp8_rel_err": conv_err,
                     "nvfp4_rel_err_vs_bf16": quant_err})
        print(f"prefill {name}: fused act-quant == torch: {same}; NVFP4->FP8 blocks rel err {conv_err:.4f} "
              f"(NVFP4 itself vs bf16 {quant_err:.4f})", flush=True)
        del x, w, q, s, p, s4


def report(result: dict) -> None:
    """Per format and row count: each variant's time summed over the layers of one model (one layer of
    each kind), as a fraction of copy bandwidth -- the figure a launch-shape default is chosen by."""
    bw = result["copy_Bps"]
    groups = {"8b": lambda l: l.startswith("8b ") and "tp2" not in l and "lm_head" not in l,
              "8b tp2": lambda l: l.startswith("8b ") and l.endswith("tp2") and "lm_head" not in l,
              "32b": lambda l: l.startswith("32b ") and "tp2" not in l,
              "32b tp2": lambda l: l.startswith("32b ") and l.endswith("tp2")}
    pts = [p for p in result["points"] if "us" in p]
    print("\n== per model (sum over qkv, o, gate_up, down): fraction of copy bandwidth by variant ==")
    for fmt in ("bf16", "fp8", "nvfp4"):
        for m in sorted({p["M"] for p in pts}):
            for g, pick in groups.items():
                sel = [p for p in pts if p["fmt"] == fmt and p["M"] == m and pick(p["shape"])]
                by_v: dict = {}
                for p in sel:
                    by_v.setdefault(p["variant"], []).append(p)
                full = {v: ps for v, ps in by_v.items() if len(ps) == 4}
                if not full:
                    continue
                frac = {v: sum(p["GBps"] * p["us"] for p in ps) * 1e3 / (sum(p["us"] for p in ps) * 1e-6) / bw
                        for v, ps in full.items()}
                best = max(frac, key=frac.get)
                print(f"{fmt:5s} M={m} {g:8s} best {best:13s} {frac[best]:.3f} | "
                      + " ".join(f"{v}={f:.3f}" for v, f in sorted(frac.items(), key=lambda kv: -kv[1])))


def fp8_prefill_winner(result: dict) -> None:
    """The FP8 prefill route with the least time summed over the measured layers (engine/kernels/linear/quant_gemm.py
    FP8_PREFILL: triton, cublas or dequantize)."""
    total: dict = {}
    for r in result.get("prefill", []):
        if "ms" in r:
            total.setdefault(r["kind"], []).append(r["ms"])
    routes = {"cublas": "fp8_blockwise_fused_actquant", "dequantize": "fp8_dequant_cublas"}
    bad = {r["kind"].removeprefix("check ") for r in result.get("prefill", []) if r.get("ok") is False}
    routes.update({k.removeprefix("fp8_"): k for k in total if k.startswith("fp8_triton_") and k not in bad})
    n = max((len(v) for v in total.values()), default=0)
    sums = {route: sum(total[k]) for route, k in routes.items() if k in total and len(total[k]) == n}
    if not sums:
        return
    best = min(sums, key=sums.get)
    result["fp8_prefill_ms"] = sums
    bf16 = sum(total.get("bf16_cublas", [])) or None
    print("fp8 prefill routes (ms summed over layers): " + ", ".join(f"{k} {v:.3f}" for k, v in sums.items())
          + (f"; bf16 {bf16:.3f}" if bf16 else ""))
    print(f"FP8_PREFILL_WINNER={'triton' if best.startswith('triton') else best} {best}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=140)
    ap.add_argument("--rows", default="1,0,8,4,2", help="rows per point; 0 = the prefill comparison at that turn")
    ap.add_argument("--report", default=None, help="print the per-model table of an earlier gemv_sweep.json and stop")
    ap.add_argument("--no-checks", action="store_true")
    ap.add_argument("--formats", default="bf16,fp8,nvfp4", help="comma-separated weight formats to time")
    ap.add_argument("--variants", default=None, help="comma-separated subset of the variants to time (the baselines "
                    "cublas / skinny always run)")
    ap.add_argument("--prefill-layers", default=None, help="comma-separated subset of qkv,o,gate_up,down")
    ap.add_argument("--prefill-configs", default=None, help="comma-separated subset of " + ",".join(PREFILL_CONFIGS))
    args = ap.parse_args()
    if args.report:
        report(json.loads(Path(args.report).read_text()))
        return 0
    if DRY:
        from tests.support import kernel_checks
        kernel_checks.patch_interpreter()           # what the interpreter tests patch (masks, fp8 casts)
    result = {"device": torch.cuda.get_device_name() if not DRY else "cpu", "torch": torch.__version__, "checks": [], "points": []}
    bw = copy_bandwidth_Bps() if not DRY else 1e12
    result["copy_Bps"] = bw
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s ({time.time() - T0:.0f} s)", flush=True)
    if not args.no_checks:
        correctness(result["checks"])
    print(f"checks done ({time.time() - T0:.0f} s)", flush=True)
    shapes = all_shapes() if not DRY else [("tiny", 64, 512)]
    for m in [int(r) for r in args.rows.split(",")]:
        if m == 0:
            if time.time() - T0 < args.budget_s - 20:
                try:
                    prefill(result, bw, args.prefill_layers and args.prefill_layers.split(","),
                            args.prefill_configs and args.prefill_configs.split(","))
                    fp8_prefill_winner(result)
                except Exception as e:  # noqa: BLE001
                    print("prefill ERROR", e, flush=True)
            continue
        for label, n, k in shapes:
            for fmt in ("bf16",) if "lm_head" in label else ("bf16", "fp8", "nvfp4"):
                if fmt not in args.formats.split(","):
                    continue
                if time.time() - T0 > args.budget_s:
                    break
                one = random_layer(fmt, n, k)
                nbytes = layer_bytes(one)
                copies = [one] + [random_layer(fmt, n, k) for _ in range(max(1, -(-200_000_000 // nbytes)) - 1)]
                x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
                names = ["cublas"] if fmt == "bf16" else ["skinny"]
                names += list(VARIANTS[fmt]) if m == 1 else list(MULTI_ROW[fmt])
                if fmt == "nvfp4" and m in (1, 8):
                    names.append("skinny_asm")
                if m == 2 and fmt == "nvfp4":
                    names = names[:2]
                if args.variants:
                    keep = set(args.variants.split(",")) | {"cublas", "skinny", "skinny_dense"}
                    names = [v for v in names if v in keep]
                for v in names:
                    fns = [call(fmt, v, copies[i % len(copies)], x, n) for i in range(max(20, len(copies)))]
                    try:
                        s = graph_seconds(fns, dry=DRY)
                    except Exception as e:  # noqa: BLE001
                        result["points"].append({"shape": label, "fmt": fmt, "M": m, "variant": v, "error": str(e)[-300:]})
                        print(f"{label} {fmt} M={m} {v}: ERROR {str(e)[-200:]}", flush=True)
                        continue
                    result["points"].append({"shape": label, "N": n, "K": k, "fmt": fmt, "M": m, "variant": v,
                                             "us": s * 1e6, "GBps": nbytes / s / 1e9, "of_copy": nbytes / s / bw})
                del copies, one
            (OUT / "gemv_sweep.json").write_text(json.dumps(result, indent=1))
        torch.cuda.empty_cache()
    (OUT / "gemv_sweep.json").write_text(json.dumps(result, indent=1))
    print(f"\n== GB/s and fraction of copy ({bw / 1e12:.2f} TB/s); best GEMV variant vs before ==")
    by = {}
    for p in result["points"]:
        if "us" in p:
            by.setdefault((p["M"], p["shape"], p["fmt"]), []).append(p)
    for (m, label, fmt), pts in by.items():
        base = next((p for p in pts if p["variant"] in ("cublas", "skinny")), None)
        ours = [p for p in pts if p["variant"] not in ("cublas", "skinny", "skinny_asm")]
        best = max(ours, key=lambda p: p["GBps"]) if ours else None
        line = f"M={m} {label:16s} {fmt:5s} "
        if base:
            line += f"{base['variant']:6s} {base['GBps']:6.0f} GB/s {base['of_copy']:.2f} | "
        if best:
            line += f"{best['variant']:13s} {best['GBps']:6.0f} GB/s {best['of_copy']:.2f} {best['us']:7.1f} us"
            line += "  " + " ".join(f"{p['variant']}={p['of_copy']:.2f}" for p in pts if p is not base)
        print(line)
    if not DRY:
        report(result)
    print(f"total {time.time() - T0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
