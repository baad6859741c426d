"""One GPU run for the bf16 tensor-core skinny GEMM (engine/kernels/linear/skinny_gemm.py) at decode rows: correctness
of every launch config against F.linear in fp32, then a timing table against cuBLAS and the M = 1 GEMV at
the qwen3-8b layer shapes and their TP=2 shards.

    PYTHONUNBUFFERED=1 python3 -m tools.dev.skinny_bf16_sweep [--budget-s 105] [--rows 1,2,4,8] [--configs a,b] [--write]
    SKINNY_SWEEP_CPU=1 python3 -m tools.dev.skinny_bf16_sweep         # the script's logic under the interpreter
    python3 -m tools.dev.skinny_bf16_sweep --from-json RUN/skinny_bf16_sweep.json --write [PATH]   # no device

Each point is a CUDA graph of 20 calls (or more) that cycle through enough copies of the weight to exceed
the 60 MB L2 several times over, so every call streams its weight from HBM (tools/dev/gemv_sweep.py's method),
timed by CUDA events, median of 7 replays. The figure is the weight's bytes per second as a fraction of a
device-to-device copy measured in the same run. Per M: shape | cuBLAS | best skinny config | GEMV (M = 1),
and the sums over one layer (qkv + o + gate_up + down, TP1 and TP2) and lm_head. JSON to
$OUT/skinny_bf16_sweep.json.

--write [PATH] puts the run's winners into the engine's data file (default
engine/kernels/linear/tuned/h200.json, section "skinny_dense", the others kept; `tuned_values` says how they are
picked), which `default_dense_config` reads at import; --from-json takes an earlier run's JSON instead of measuring.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

DRY = os.environ.get("SKINNY_SWEEP_CPU") == "1"       # a dry run of the logic on a CPU (Triton's interpreter)
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

from engine.kernels.linear import gemv as G
from engine.kernels import pdl
from engine.kernels.linear import skinny_gemm as Q
from engine.kernels.linear.splitk import num_sms
from engine.kernels.tuned import tuned_path, write_tuned
from tools.bench.timing import copy_bandwidth_Bps, graph_seconds

DEV = torch.device("cpu" if DRY else "cuda")
OUT = Path(os.environ.get("OUT", "/tmp"))
T0 = time.time()
TOL = 2 ** -8
L2_BYTES = 200_000_000            # weight copies per point: several times the H200's 60 MB L2
# outputs from this many features take the "wide" config: between the widest layer timed (gate_up, 24576) and
# lm_head (151936); the sweep times nothing in between
WIDE_N = 65536

# qwen3-8b: hidden 4096, 32 q heads and 8 kv heads of 128, intermediate 12288, vocabulary 151936
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288),
          ("lm_head", 151936, 4096), ("qkv tp2", 3072, 4096), ("o tp2", 4096, 2048), ("gate_up tp2", 12288, 4096),
          ("down tp2", 4096, 6144)]
LAYER = ("qkv", "o", "gate_up", "down")
DRY_SHAPES = [("qkv", 192, 256), ("o", 128, 128), ("gate_up", 256, 128), ("down", 128, 384), ("lm_head", 320, 128),
              ("qkv tp2", 96, 256), ("o tp2", 128, 64), ("gate_up tp2", 128, 128), ("down tp2", 128, 192)]

# c: cp.async weight tiles, t: TMA; BLOCK_N x BLOCK_K, stages; p: programs per SM the split aims at (rounded
# down: all resident at once; "up": rounded up, a partial second wave). Shared memory (sm_90 compile):
# 64x128 s4 80 KB and 64x64 s8 80 KB (two programs per SM), 128x128 s3 108 KB (two), 64x256 s3 120 KB (one)
CONFIGS = {
    "c64x128s4": Q.DenseConfig(64, 128, 4, 4),
    "c64x128s4up": Q.DenseConfig(64, 128, 4, 4, split_up=True),
    "c64x64s8": Q.DenseConfig(64, 64, 4, 8),
    "c128x128s3": Q.DenseConfig(128, 128, 4, 3),
    "c64x256s3p1": Q.DenseConfig(64, 256, 4, 3, programs_per_sm=1),
    "c64x128s4p4": Q.DenseConfig(64, 128, 4, 4, programs_per_sm=4),
    "t64x128s4": Q.DenseConfig(64, 128, 4, 4, tma=True),
    "t128x128s3": Q.DenseConfig(128, 128, 4, 3, tma=True),
    "t64x256s3p1": Q.DenseConfig(64, 256, 4, 3, programs_per_sm=1, tma=True),
}






def variants(M: int, configs: dict) -> dict:
    # name -> fn(x [M, K], w [N, K]) -> [M, N]
    out = {"cublas": F.linear}
    if M == 1:
        out["gemv"] = lambda x, w: G.gemv(x, "bf16", w)
    for name, cfg in configs.items():
        out[name] = lambda x, w, cfg=cfg: Q.skinny_dense(x, w, cfg)
    return out


def check(name: str, fn, x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> dict:
    """rel err of fn against ref (fp32), and bit-equality of a second call (split counters re-armed)."""
    try:
        y = fn(x, w)
        y2 = fn(x, w)
        err = float((y.float() - ref).abs().max() / ref.abs().max())
        same = bool(torch.equal(y, y2))
        return {"rel_err": err, "repeat_equal": same, "ok": err < TOL and (same or name == "cublas")}
    except Exception as e:  # noqa: BLE001 - a config that fails to build is a result
        return {"error": str(e)[-400:], "ok": False}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=105.0)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--write", nargs="?", type=Path, const=tuned_path(Q.__file__), default=None,
                    help="write the winners into the engine's data file (default: %(const)s)")
    ap.add_argument("--from-json", type=Path, default=None, help="an earlier run's skinny_bf16_sweep.json: no device")
    args = ap.parse_args()
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
        report(result, result["configs"])
        if args.write is not None:
            write(result, args.write, str(args.from_json))
        return 0
    rows = [int(r) for r in args.rows.split(",")]
    configs = {k: CONFIGS[k] for k in args.configs.split(",")}
    if DRY:
        from tests.support import kernel_checks
        kernel_checks.patch_interpreter()
        configs = {k: dataclasses.replace(c, block_k=min(c.block_k, 64), tma=False) for k, c in configs.items()}
    sms = num_sms(DEV)
    result = {"rows": rows, "configs": {k: dataclasses.asdict(c) for k, c in configs.items()}, "checks": [],
              "points": [], "pdl": pdl.enabled(DEV), "sms": sms,
              "device": "cpu" if DRY else torch.cuda.get_device_name()}
    bw = 1e12 if DRY else copy_bandwidth_Bps()
    result["copy_Bps"] = bw
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s, pdl={result['pdl']} ({time.time() - T0:.0f} s)", flush=True)
    bad: set[str] = set()
    out_of_time = False
    for label, n, k in (DRY_SHAPES if DRY else SHAPES):
        if out_of_time:
            break
        gen = torch.Generator(device=DEV).manual_seed(n + k)
        w0 = torch.randn(n, k, device=DEV, dtype=torch.bfloat16, generator=gen) * k ** -0.5
        nbytes = w0.numel() * w0.element_size()
        n_copies = 2 if DRY else max(1, -(-L2_BYTES // nbytes))
        copies = [w0] + [torch.empty_like(w0).normal_(0, k ** -0.5) for _ in range(n_copies - 1)]
        wf = w0.float()
        for M in rows:
            x = torch.randn(M, k, device=DEV, dtype=torch.bfloat16, generator=gen)
            ref = F.linear(x.float(), wf)
            for v, fn in variants(M, configs).items():
                if time.time() - T0 > args.budget_s:
                    out_of_time = True
                    print(f"budget spent at {label} M={M} {v}: stopping", flush=True)
                    break
                c = check(v, fn, x, w0, ref)
                split = Q.dense_split(configs[v], M, n, k, sms)[0] if v in configs else None
                result["checks"].append({"shape": label, "M": M, "variant": v, "split": split, **c})
                if not c["ok"]:
                    bad.add(f"{label} M={M} {v}")
                    print(f"BAD {label} M={M} {v}: {c}", flush=True)
                    continue
                calls = max(20, n_copies)
                fns = [lambda w=copies[i % n_copies], fn=fn, x=x: fn(x, w) for i in range(calls)]
                s = graph_seconds(fns, dry=DRY)
                result["points"].append({"shape": label, "N": n, "K": k, "M": M, "variant": v, "split": split,
                                         "us": s * 1e6, "GBps": nbytes / s / 1e9, "of_copy": nbytes / s / bw})
            if out_of_time:
                break
            best = max((p for p in result["points"] if p["shape"] == label and p["M"] == M), key=lambda p: p["of_copy"],
                       default=None)
            if best:
                print(f"{label:12s} M={M} best {best['variant']:12s} {best['of_copy']:.3f} ({time.time() - T0:.0f} s)",
                      flush=True)
        del copies, w0, wf
        if not DRY:
            torch.cuda.empty_cache()
    result["bad"] = sorted(bad)
    report(result, configs)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "skinny_bf16_sweep.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {OUT / 'skinny_bf16_sweep.json'} ({time.time() - T0:.0f} s); {len(bad)} bad checks", flush=True)
    if args.write is not None:
        if bad or DRY:
            print(f"not writing {args.write}: {'bad checks' if bad else 'a dry run times nothing'}", flush=True)
        else:
            write(result, args.write, str(OUT / "skinny_bf16_sweep.json"))
    return 1 if bad else 0


def single_config_fractions(result: dict, shapes: set[str]) -> dict[str, float]:
    """Per config timed on every (shape, M > 1) of `shapes`: the weight bytes over the summed time of those points,
    as a fraction of copy bandwidth (one config for every shape and row count)."""
    at = {(p["shape"], p["M"], p["variant"]): p for p in result["points"]}
    out = {}
    for c in result["configs"]:
        ps = [at.get((s, M, c)) for s in shapes for M in result["rows"] if M > 1]
        if ps and all(ps):
            out[c] = sum(p["N"] * p["K"] * 2 for p in ps) / (sum(p["us"] for p in ps) * 1e-6) / result["copy_Bps"]
    return out


def tuned_values(result: dict) -> dict:
    """The data file's section from a run: "narrow", the config with the largest fraction of copy over every layer
    shape (not lm_head) at M > 1; "wide", the same over lm_head; "wide_n" the tool's WIDE_N."""
    layers = {p["shape"] for p in result["points"]} - {"lm_head"}
    picks = {}
    for key, shapes in (("narrow", layers), ("wide", {"lm_head"})):
        fractions = single_config_fractions(result, shapes)
        if not fractions:
            raise ValueError(f"the run timed no config on every {key} shape at M > 1: nothing to write")
        picks[key] = result["configs"][max(fractions, key=fractions.get)]
    return {"wide_n": WIDE_N, **picks}


def write(result: dict, path: Path, source: str) -> None:
    values = tuned_values(result)
    write_tuned(path, "skinny_dense", values, source=source, device_name=result["device"])
    print(f"wrote {path}: {values}", flush=True)


def report(result: dict, configs: dict) -> None:
    bw = result["copy_Bps"]
    pts = result["points"]
    at = {(p["shape"], p["M"], p["variant"]): p for p in pts}
    shapes = {p["shape"]: p["N"] * p["K"] * 2 for p in pts}
    groups = {"layer": LAYER, "layer tp2": tuple(f"{s} tp2" for s in LAYER), "lm_head": ("lm_head",)}

    def frac(names, M, pick) -> tuple[float, float] | None:
        # summed over shapes: total bytes / total seconds / copy bandwidth; pick(shape) -> point or None
        ps = [pick(s) for s in names]
        if not ps or any(p is None for p in ps):
            return None
        secs = sum(p["us"] for p in ps) * 1e-6
        return sum(shapes[s] for s in names) / secs / bw, secs * 1e6

    for M in result["rows"]:
        def best(s, M=M):
            cand = [p for p in pts if p["shape"] == s and p["M"] == M and p["variant"] in configs]
            return max(cand, key=lambda p: p["of_copy"], default=None)

        print(f"\n== M = {M}: fraction of copy ({bw / 1e12:.2f} TB/s) ==")
        print(f"{'shape':14s} {'cuBLAS':>7s} {'skinny best':>12s} {'(config, split)':22s} {'GEMV':>6s}  "
              "us cuBLAS/skinny")
        for s in shapes:
            cb, b, gv = at.get((s, M, "cublas")), best(s), at.get((s, M, "gemv"))
            if cb is None and b is None:
                continue
            print(f"{s:14s} {cb['of_copy'] if cb else float('nan'):7.3f} {b['of_copy'] if b else float('nan'):12.3f} "
                  f"{(b['variant'] + ' s' + str(b['split'])) if b else '-':22s} "
                  f"{gv['of_copy'] if gv else float('nan'):6.3f}  "
                  f"{cb['us'] if cb else float('nan'):7.1f} / {b['us'] if b else float('nan'):7.1f}")
        for g, names in groups.items():
            line = [f"sum {g:10s}"]
            for v in ("cublas", "gemv"):
                r = frac(names, M, lambda s, v=v, M=M: at.get((s, M, v)))
                if r:
                    line.append(f"{v} {r[0]:.3f} ({r[1]:.1f} us)")
            r = frac(names, M, best)
            if r:
                line.append(f"skinny best-per-shape {r[0]:.3f} ({r[1]:.1f} us)")
            one = {c: frac(names, M, lambda s, c=c, M=M: at.get((s, M, c))) for c in configs}
            one = {c: r for c, r in one.items() if r}
            if one:
                c = max(one, key=lambda c: one[c][0])
                line.append(f"best single config {c} {one[c][0]:.3f}")
            print("  ".join(line))
    # one config for every shape and row count: the fraction summed over all layer shapes and rows
    tot = single_config_fractions(result, set(shapes) - {"lm_head"})
    if tot:
        print("\nconfigs over every layer shape (not lm_head) at M > 1: "
              + ", ".join(f"{c} {f:.3f}" for c, f in sorted(tot.items(), key=lambda t: -t[1])))
    result["summary"] = {"single_config_M_gt_1": tot}


if __name__ == "__main__":
    raise SystemExit(main())
