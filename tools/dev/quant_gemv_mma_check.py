"""One GPU run for the tensor-core quantized GEMV (engine/kernels/linear/quant_gemv_mma.py): checks against the
reference dequantizer, then its speed against the Triton GEMV / skinny kernels it replaces.

    PYTHONUNBUFFERED=1 python3 -m tools.dev.quant_gemv_mma_check [--rows 1,2,8] [--budget-s 150]

Timing as tools/dev/gemv_sweep.py does it: a CUDA graph of 20 calls cycling through enough copies of the
layer to stream every call from HBM, median of 7 replays, as a fraction of a device-to-device copy
measured in the same run. The per-model lines sum one layer of each kind (qkv, o, gate_up, down).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.kernels.linear import gemv as G
from engine.kernels.linear import quant_gemm as Q
from engine.kernels.linear import quant_gemv_mma as MMA
from engine.quant import formats
from tests.support import quant_kernel_checks as QC
from tools.bench.timing import copy_bandwidth_Bps, graph_seconds
from tools.dev.gemv_sweep import all_shapes, layer_bytes, random_layer

OUT = Path(os.environ.get("OUT", "/tmp"))
T0 = time.time()
TOL = 2 ** -8


def mma_call(fmt: str, layer: dict, x: torch.Tensor, n: int, warps: int = MMA.WARPS, batch: int = MMA.BATCH,
             contig: bool | None = None):
    return lambda: MMA.quant_gemv_mma(x, fmt, layer["w"], layer["s"], layer.get("rs"), n, warps=warps, batch=batch,
                                      contig=contig)


def variant_label(w: int, u: int, contig: bool) -> str:
    return f"mma_w{w}u{u}{'c' if contig else ''}"


def triton_call(fmt: str, layer: dict, x: torch.Tensor, n: int):
    if G.use_gemv(fmt, x.shape[0]):
        return lambda: G.gemv(x, fmt, layer["w"], layer["s"], layer.get("rs"), n)
    return lambda: Q.skinny(x, fmt, layer["w"], layer["s"], layer.get("rs"), n)


def check(fmt: str, M: int, N: int, K: int, dtype=torch.bfloat16, block=(128, 128), seed=0, **variant) -> dict:
    """variant: the kernel's warps / batch / contig, else the defaults."""
    wt = QC.make_weights(fmt, N, K, "cuda", seed, block)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed + 1)).to("cuda", dtype)
    y = MMA.quant_gemv_mma(x, fmt, wt["weight"], wt["scale"], wt["row_scale"], N, wt["block"], **variant)
    ref = x.float() @ wt["ref"].T
    err = (y.float() - ref).abs()
    r = {"rel_err": float(err.max() / ref.abs().max()), "nan": int(torch.isnan(y).sum())}
    if not r["rel_err"] < TOL:     # where it is wrong: which rows of a 16-row block, which activation rows
        bad = err > TOL * ref.abs().max()
        r["bad_rows_mod16"] = sorted({int(i) % 16 for i in bad.any(0).nonzero().flatten().tolist()})[:16]
        r["bad_m"] = sorted({int(i) for i in bad.any(1).nonzero().flatten().tolist()})
    return r


def check_full_range_scales(M: int = 2, N: int = 256, K: int = 1024) -> dict:
    """Random codes and every E4M3 scale magnitude (subnormals too): the scaled fp16 products are exact."""
    g = torch.Generator().manual_seed(5)
    p = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    s = torch.randint(0, 0x7F, (N, K // 16), generator=g, dtype=torch.uint8).view(formats.FP8)   # no NaN
    rs = torch.rand(N, generator=g) + 0.5
    xd = torch.randn(M, K, generator=g).to("cuda", torch.bfloat16)
    y = MMA.quant_gemv_mma(xd, "nvfp4", p.cuda(), s.cuda(), rs.cuda(), N)
    ref = xd.double().cpu() @ (formats.dequantize_nvfp4(p, s, 1.0).double() * rs.double()[:, None]).T
    return {"rel_err": float((y.double().cpu() - ref).abs().max() / ref.abs().max())}


def check_graph(fmt: str = "nvfp4", M: int = 1, N: int = 4096, K: int = 4096) -> dict:
    wt = QC.make_weights(fmt, N, K, "cuda", 3)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    eager = MMA.quant_gemv_mma(x, fmt, wt["weight"], wt["scale"], wt["row_scale"], N)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = MMA.quant_gemv_mma(x, fmt, wt["weight"], wt["scale"], wt["row_scale"], N)
    x.copy_(torch.randn_like(x))
    graph.replay()
    again = MMA.quant_gemv_mma(x, fmt, wt["weight"], wt["scale"], wt["row_scale"], N)
    torch.cuda.synchronize()
    return {"replay_equals_eager": bool(torch.equal(y, again)), "changed": not torch.equal(eager, again)}


def checks(result: dict) -> bool:
    ok = True
    cases = [(f, m, n, k) for f in ("nvfp4", "fp8") for m in (1, 2, 3, 8)
             for n, k in ((6144, 4096), (4096, 12288), (2048, 6144))]
    cases += [("nvfp4", 2, 5120, 25600), ("fp8", 2, 5120, 25600), ("nvfp4", 1, 48, 128), ("fp8", 1, 32, 64)]
    for fmt, m, n, k in cases:
        if not MMA.supports(fmt, m, n, k):
            continue
        r = check(fmt, m, n, k, seed=m + n)
        good = r["nan"] == 0 and r["rel_err"] < TOL
        ok &= good
        result["checks"].append({"fmt": fmt, "M": m, "N": n, "K": k, "ok": good, **r})
        print(f"check {fmt:5s} M={m} {n}x{k}: {'OK ' if good else 'BAD'} {r}", flush=True)
    # every swept variant on the shapes whose chunk counts are and are not whole batches of 4
    for (w, u, c) in MMA.VARIANTS:
        for fmt, m, n, k in (("fp8", 2, 4096, 12288), ("nvfp4", 3, 2048, 6144), ("fp8", 1, 128, 384),
                             ("nvfp4", 1, 128, 640)):
            r = check(fmt, m, n, k, seed=m + n + u, warps=w, batch=u, contig=c)
            good = r["nan"] == 0 and r["rel_err"] < TOL
            ok &= good
            print(f"check {variant_label(w, u, c)} {fmt:5s} M={m} {n}x{k}: {'OK ' if good else 'BAD'} {r}", flush=True)
    for fmt in ("nvfp4", "fp8"):
        r = check(fmt, 4, 4096, 4096, dtype=torch.float16, seed=9)
        good = r["nan"] == 0 and r["rel_err"] < TOL
        ok &= good
        print(f"check {fmt} fp16 activations: {'OK ' if good else 'BAD'} {r}", flush=True)
    r = check("fp8", 3, 256, 1024, block=(64, 64), seed=4)
    good = r["rel_err"] < TOL
    ok &= good
    print(f"check fp8 64x64 scale blocks: {'OK ' if good else 'BAD'} {r}", flush=True)
    r = check_full_range_scales()
    good = r["rel_err"] < TOL
    ok &= good
    print(f"check nvfp4 every E4M3 scale: {'OK ' if good else 'BAD'} {r}", flush=True)
    for fmt in ("nvfp4", "fp8"):
        r = check_graph(fmt)
        good = r["replay_equals_eager"] and r["changed"]
        ok &= good
        print(f"check {fmt} CUDA graph replay: {'OK ' if good else 'BAD'} {r}", flush=True)
    return ok


def sweep(result: dict, rows: list[int], budget_s: float, models: tuple[str, ...] = ()) -> None:
    """models: the model groups to keep ("8b", "8b tp2", "32b", "32b tp2"); all shapes when empty."""
    bw = result["copy_Bps"]
    for m in rows:
        for label, n, k in all_shapes():
            if "lm_head" in label or (models and not any(
                    label.split()[0] == p.split()[0] and ("tp2" in label) == ("tp2" in p) for p in models)):
                continue
            for fmt in ("fp8", "nvfp4"):
                if time.time() - T0 > budget_s:
                    return
                one = random_layer(fmt, n, k)
                nbytes = layer_bytes(one)
                copies = [one] + [random_layer(fmt, n, k) for _ in range(max(1, -(-200_000_000 // nbytes)) - 1)]
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                routes = [("triton", triton_call)] + [
                    (variant_label(w, u, c), lambda *a, w=w, u=u, c=c: mma_call(*a, warps=w, batch=u, contig=c))
                    for w, u, c in MMA.VARIANTS]
                for route, make in routes:
                    if route != "triton" and not MMA.supports(fmt, m, n, k):
                        continue
                    fns = [make(fmt, copies[i % len(copies)], x, n) for i in range(max(20, len(copies)))]
                    s = graph_seconds(fns)
                    result["points"].append({"shape": label, "N": n, "K": k, "fmt": fmt, "M": m, "route": route,
                                             "us": s * 1e6, "of_copy": nbytes / s / bw})
                del copies, one
        torch.cuda.empty_cache()


def report(result: dict) -> None:
    pts = result["points"]
    print("\n== per layer: fraction of copy bandwidth (us) ==")
    by: dict = {}
    for p in pts:
        by.setdefault((p["M"], p["shape"], p["fmt"]), {})[p["route"]] = p
    for (m, label, fmt), r in by.items():
        print(f"M={m} {label:14s} {fmt:5s} " + "  ".join(f"{k} {v['of_copy']:.3f} ({v['us']:.1f})" for k, v in r.items()))
    print("\n== per model (one layer of each kind): fraction of copy bandwidth ==")
    groups = {"8b": lambda l: l.startswith("8b ") and "tp2" not in l, "8b tp2": lambda l: l.startswith("8b ") and "tp2" in l,
              "32b": lambda l: l.startswith("32b ") and "tp2" not in l, "32b tp2": lambda l: l.startswith("32b ") and "tp2" in l}
    for fmt in ("fp8", "nvfp4"):
        for m in sorted({p["M"] for p in pts}):
            for gname, pick in groups.items():
                line = []
                for route in ("triton",) + tuple(variant_label(*v) for v in MMA.VARIANTS):
                    sel = [p for p in pts if p["fmt"] == fmt and p["M"] == m and p["route"] == route and pick(p["shape"])]
                    if len(sel) == 4:
                        frac = sum(p["of_copy"] * p["us"] for p in sel) / sum(p["us"] for p in sel)
                        line.append(f"{route} {frac:.3f} ({sum(p['us'] for p in sel):.1f} us)")
                        result.setdefault("per_model", {})[f"{fmt} M={m} {gname} {route}"] = frac
                if line:
                    print(f"{fmt:5s} M={m} {gname:8s} " + " | ".join(line))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,8")
    ap.add_argument("--budget-s", type=float, default=150)
    ap.add_argument("--models", default="", help="comma-separated model groups, e.g. 8b,32b tp2 (default: all)")
    args = ap.parse_args()
    result = {"device": torch.cuda.get_device_name(), "checks": [], "points": []}
    result["copy_Bps"] = copy_bandwidth_Bps()
    print(f"copy bandwidth {result['copy_Bps'] / 1e12:.3f} TB/s", flush=True)
    ok = checks(result)
    print(f"checks {'all OK' if ok else 'FAILED'} ({time.time() - T0:.0f} s)", flush=True)
    if ok:
        sweep(result, [int(r) for r in args.rows.split(",")], args.budget_s,
              tuple(p for p in args.models.split(",") if p))
        report(result)
    (OUT / "quant_gemv_mma.json").write_text(json.dumps(result, indent=1))
    print(f"total {time.time() - T0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
