"""Sweep the launch shapes of the paged-attention kernel for decode and verify, bf16 and int8 pages.

    PYTHONUNBUFFERED=1 python tools/dev/tune_decode_attention.py [--contexts 8192,32768] [--out FILE.json]

On one CUDA device, qwen3-8b shapes (32 q heads, 8 KV heads, head_dim 128, pages of 16): batch 1
and 8, query_len 1 (decode) and 4 (verify of 3 drafts), the given contexts. The pages hold random
K/V written through the project's own write path (`write_kv`; int8 pages quantized by it, with
per-token-per-head scales), the same values for both dtypes; block tables are shuffled.

Every timing is CUDA-graph captured: CALLS launches in one graph, replayed REPLAYS times, median
per launch (tools/gpu_kernels_check.bench_graph), so launch overhead does not count. The launches
of a graph rotate over several copies of the KV pages (as the layers of a step do), enough that
the pages cannot stay in L2.

Phases, each bounded by --budget-s (what is cut is listed at the end):
  1. per case: the default plan (`plan`), for int8 also the plan of before the in-register int8
     conversion (DECODE, int8_upcast off: "old default"), the output of each against the float32
     torch twin;
  2. the grid: block_n x num_warps x num_stages (int8: with int8_upcast, plus a few shapes without
     it), block_m, num_splits and min_tiles from the plan. A shape that fails (compile error, out
     of shared memory) is recorded and skipped; every output is checked against the default's
     (max abs) and against the twin (relative error); a wrong one never counts as best;
  3. num_splits x2 and /2 around the three fastest shapes of each case.
Prints the copy bandwidth, one line per timing, then the summary table (last). --out writes all of
it as JSON (after each phase, so a crash keeps what was measured).

--variants (under 150 s on one H200): the switches of the decode kernel instead of the grid, over
--cases (default batch 1 at 32768, 512, 2048 and batch 8 at 8192; --variant-qlens, default 1; bf16 and int8):
  A. named variants of each case's plan: `prefetch` 1 and 2 (software-pipelined whole-tile loop,
     num_stages 1), prefetch 1 capped at 128 registers, prefetch 1 with 128-key tiles, and for int8
     pages the 128-key shapes around INT8_LONG's and the 64-key plan with prefetch;
  B. num_splits /2, x2, x4 (min_tiles 1, so short contexts get one-tile splits) around the two
     fastest rows of A.
Ends with a variant-by-case table (us) and the table "case | default us | best us | best config".
--variants --dry-run prints the configs it would time (plans from shapes only; no device, no run);
add --regs to compile each for sm_90 on the CPU and print registers, spills and programs per SM.
--variants --write [PATH] puts the long-context shapes the run picked (`long_shapes`) into the engine's data file
(default engine/kernels/attention/tuned/h200.json, sections "decode_bf16_long" and "decode_int8_long", others kept),
which engine/kernels/attention/paged.py reads at import; --from-json RUN.json --write does it from an earlier run.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine import envs
from engine.worker.forward_context import build_forward_context
from engine.kernels.attention import paged as A
from engine.kernels.tuned import tuned_path, write_tuned
from tests.support.kernel_checks import rel_err
from engine.worker.paged_kv import LayerKV
from engine.layers.attention import paged_attention_reference
from tools.dev import gpu_kernel_suite as G

DEV = torch.device("cuda")
H, KVH, D = G.H, G.KVH, G.D                 # qwen3-8b
PAGE = 16
Q_STD = 4.0                                 # q ~ N(0, 4^2): peaked softmax, so wrong key ranges show
WRITE_CHUNK = 65536                         # tokens per write_kv call while filling the pages
MAX_LAYERS = 16
TOL = 1e-2                                  # relative error against the twin, as the GPU tests
CALLS, REPLAYS = 20, 20


class Fatal(RuntimeError):
    """The CUDA context is broken (e.g. an illegal address): nothing after this can be trusted."""


@dataclasses.dataclass
class Case:
    dtype: str
    batch: int
    q_len: int
    ctx_len: int
    kvs: list
    ctx: object
    q: torch.Tensor
    out: torch.Tensor
    scale: float
    nbytes: int
    plan: A.AttnConfig
    ref: torch.Tensor | None = None
    default_out: torch.Tensor | None = None
    rows: list = dataclasses.field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.dtype} b{self.batch} q{self.q_len} ctx{self.ctx_len}"

    @property
    def key(self) -> tuple:
        return self.batch, self.q_len, self.ctx_len


def label(cfg: A.AttnConfig) -> str:
    return (f"bm{cfg.block_m} bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} "
            f"sp{cfg.num_splits} "
            f"mt{cfg.min_tiles}{' up' if cfg.int8_upcast else ''}{f' pf{cfg.prefetch}' if cfg.prefetch else ''}"
            f"{f' r{cfg.max_regs}' if cfg.max_regs else ''}")


# -- pages -------------------------------------------------------------------------------------------

def empty_kv(blocks: int, dtype: torch.dtype) -> LayerKV:
    shape = (blocks, PAGE, KVH, D)
    if dtype == torch.int8:
        return LayerKV(torch.zeros(shape, dtype=dtype, device=DEV), torch.zeros(shape, dtype=dtype, device=DEV),
                       torch.zeros(shape[:3], dtype=torch.float32, device=DEV),
                       torch.zeros(shape[:3], dtype=torch.float32, device=DEV))
    return LayerKV(torch.zeros(shape, dtype=dtype, device=DEV), torch.zeros(shape, dtype=dtype, device=DEV))


def build_pages(batch: int, ctx_len: int, seed: int, l2_bytes: int) -> tuple[dict, list[list[int]]]:
    """{"bf16": [LayerKV...], "int8": [LayerKV...]} holding the same random K/V (the int8 pages
    quantized by write_kv), each dtype as many copies as keep the pages out of L2, and the tables."""
    gen = torch.Generator().manual_seed(seed)
    need = -(-ctx_len // PAGE)
    blocks = batch * need + 1
    perm = torch.randperm(blocks, generator=gen).tolist()
    tables = [perm[i * need:(i + 1) * need] for i in range(batch)]
    # a prefill-shaped context over every position: its slot_mapping is where each token lives
    _, full = build_forward_context([ctx_len] * batch, [ctx_len] * batch, tables, PAGE, DEV)
    pools = {"bf16": empty_kv(blocks, torch.bfloat16), "int8": empty_kv(blocks, torch.int8)}
    g = torch.Generator(device=DEV).manual_seed(seed)
    total = batch * ctx_len
    for at in range(0, total, WRITE_CHUNK):
        n = min(WRITE_CHUNK, total - at)
        kv_new = torch.randn(2, n, KVH, D, generator=g, device=DEV).to(torch.bfloat16)
        for kv in pools.values():
            A.write_kv(kv, kv_new[0], kv_new[1], full.slot_mapping[at:at + n])
    out = {}
    for name, kv in pools.items():
        per_layer = A.attention_bytes(kv, [ctx_len] * batch, [0] * batch, H, 2)
        layers = max(2, min(MAX_LAYERS, math.ceil(3 * l2_bytes / per_layer)))
        out[name] = [kv] + [LayerKV(*(t.clone() if t is not None else None
                                      for t in (kv.k, kv.v, kv.k_scale, kv.v_scale))) for _ in range(layers - 1)]
    torch.cuda.synchronize()
    return out, tables


def make_case(dtype: str, kvs: list, tables, batch: int, q_len: int, ctx_len: int, seed: int) -> Case:
    _, ctx = build_forward_context([q_len] * batch, [ctx_len] * batch, tables, PAGE, DEV)
    g = torch.Generator(device=DEV).manual_seed(seed)
    T = batch * q_len
    q = (torch.randn(T, H, D, generator=g, device=DEV) * Q_STD).to(torch.bfloat16)
    nbytes = A.attention_bytes(kvs[0], [ctx_len] * batch, [q_len] * batch, H, 2)
    return Case(dtype, batch, q_len, ctx_len, kvs, ctx, q, torch.empty_like(q), D ** -0.5, nbytes,
                A.plan(q, kvs[0], ctx))


# -- one measurement ---------------------------------------------------------------------------------

def cuda_ok() -> bool:
    try:
        torch.cuda.synchronize()
    except RuntimeError:                            # torch.AcceleratorError is one
        return False
    return True


def measure(case: Case, cfg: A.AttnConfig, tag: str, log: bool = True) -> dict:
    """Time `cfg` on `case` (graph of CALLS launches, median of REPLAYS) and check its output."""
    row = {"tag": tag, "config": dataclasses.asdict(cfg), "label": label(cfg)}
    try:
        out = A.paged_attention(case.q, case.kvs[0], case.ctx, case.scale, config=cfg)    # compiles
        torch.cuda.synchronize()
        if case.default_out is not None:
            row["max_abs_vs_default"] = float((out.float() - case.default_out.float()).abs().max())
        if case.ref is not None:
            row["rel_err"] = rel_err(out, case.ref)
        row["nan"] = bool(torch.isnan(out).any())

        def launches():
            for i in range(CALLS):
                A.paged_attention(case.q, case.kvs[i % len(case.kvs)], case.ctx, case.scale, out=case.out,
                                  config=cfg)
        t = G.bench_graph(launches, calls=CALLS, replays=REPLAYS)
        row.update(ms=t["ms"], p20=t["p20"], p80=t["p80"], GBps=case.nbytes / t["ms"] / 1e6)
        row["ok"] = (not row["nan"]) and row.get("rel_err", 0.0) <= TOL
    except Exception as exc:
        row.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
        if not cuda_ok():
            traceback.print_exc()
            case.rows.append(row)
            raise Fatal(f"CUDA context broken at {case.name} {label(cfg)}: {row['error']}") from exc
    finally:
        if cuda_ok():                               # a broken context is reported above
            torch.cuda.empty_cache()
    case.rows.append(row)
    if log:
        if "ms" in row:
            err = f"rel {row['rel_err']:.1e}" if "rel_err" in row else ""
            dev = f" dmax {row['max_abs_vs_default']:.1e}" if "max_abs_vs_default" in row else ""
            bad = "" if row["ok"] else "  WRONG"
            print(f"  {case.name:24s} {tag:8s} {row['label']:38s} {row['ms'] * 1e3:9.2f} us "
                  f"{row['GBps']:7.0f} GB/s  {err}{dev}{bad}", flush=True)
        else:
            print(f"  {case.name:24s} {tag:8s} {row['label']:38s} skipped: {row['error'][:90]}", flush=True)
    return row


def best(case: Case) -> dict | None:
    rows = [r for r in case.rows if r.get("ok") and "ms" in r]
    return min(rows, key=lambda r: r["ms"]) if rows else None


def old_default(plan: A.AttnConfig) -> A.AttnConfig:
    """What plan() returned for a decode shape before DECODE_INT8: DECODE, no in-register conversion."""
    return dataclasses.replace(plan, **{k: v for k, v in A.DECODE.items() if k != "num_warps"}, int8_upcast=False)


# -- the run -----------------------------------------------------------------------------------------

def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy, read + write (as gpu_kernels_check)."""
    src = torch.randn(2**29, dtype=torch.bfloat16, device=DEV)
    dst = torch.empty_like(src)
    ms = G.bench(lambda: dst.copy_(src), flush=False)["ms"]
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)     # the buffers go with this frame


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="8192,32768", help="context lengths (keys per sequence)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--qlens", default="1,4", help="new tokens per sequence: 1 decode, k+1 verify")
    ap.add_argument("--dtypes", default="bf16,int8")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="1,2,3,4")
    ap.add_argument("--no-grid", action="store_true", help="phase 1 only (defaults and old default)")
    ap.add_argument("--budget-s", type=float, default=140.0,
                    help="wall-clock budget: the grid stops at 75%%, the split sweep at 100%%")
    ap.add_argument("--out", type=Path, default=None, help="write every result as JSON here")
    ap.add_argument("--variants", action="store_true",
                    help="time the decode switches (prefetch, register cap, splits) over --cases, not the grid")
    ap.add_argument("--cases", default="1x32768,1x512,1x2048,8x8192",
                    help="--variants: BATCHxCONTEXT list (run in this order: a budget cut loses the last)")
    ap.add_argument("--variant-qlens", default="1", help="--variants: new tokens per sequence (4: verify of 3)")
    ap.add_argument("--dry-run", action="store_true", help="--variants: print the configs, run nothing (CPU)")
    ap.add_argument("--regs", action="store_true", help="--dry-run: also compile each for sm_90, print registers")
    ap.add_argument("--write", nargs="?", type=Path, const=tuned_path(A.__file__), default=None,
                    help="--variants: write the long-context shapes into the engine's data file (default: %(const)s)")
    ap.add_argument("--from-json", type=Path, default=None, help="--write from an earlier --variants run's --out JSON")
    args = ap.parse_args()
    if args.from_json is not None:
        if args.write is None:
            ap.error("--from-json only goes with --write")
        write_long_shapes(json.loads(args.from_json.read_text()), args.write, str(args.from_json))
        return 0
    if args.variants and args.dry_run:
        return dry_run(args)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    started = time.perf_counter()

    def elapsed() -> float:
        return time.perf_counter() - started

    props = torch.cuda.get_device_properties(0)
    info = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "decode_default": A.DECODE, "decode_int8_default": A.DECODE_INT8, "calls": CALLS, "replays": REPLAYS}
    info["commit"] = envs.COMMIT.read()        # set by whoever copied the tree (its .git may be stale)
    if not info["commit"]:
        try:
            info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                            text=True, check=False).stdout.strip()
        except OSError:
            pass
    print(info, flush=True)
    l2_bytes = int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)
    copy_Bps = copy_bandwidth()
    print(f"copy bandwidth {copy_Bps / 1e12:.3f} TB/s (read + write), L2 {l2_bytes / 2**20:.0f} MiB", flush=True)

    dtypes = [d for d in args.dtypes.split(",") if d in ("bf16", "int8")]
    cases: list[Case] = []
    if args.variants:
        shapes, qlens = variant_cases(args.cases), ints(args.variant_qlens)
    else:
        shapes, qlens = [(b, c) for c, b in itertools.product(ints(args.contexts), ints(args.batches))], ints(args.qlens)
    for seed, (batch, ctx_len) in enumerate(shapes, 1):
        pools, tables = build_pages(batch, ctx_len, seed, l2_bytes)
        for q_len, dtype in itertools.product(qlens, dtypes):
            cases.append(make_case(dtype, pools[dtype], tables, batch, q_len, ctx_len, seed * 100 + q_len))
        del pools
    print(f"{len(cases)} cases, pages built in {elapsed():.0f} s "
          f"({torch.cuda.memory_allocated() / 2**30:.1f} GiB on the device)", flush=True)

    state = {"info": info, "copy_Bps": copy_Bps, "cut": [], "fatal": None}

    def records() -> None:
        state["seconds"] = elapsed()
        state["cases"] = [{"name": c.name, "dtype": c.dtype, "batch": c.batch, "q_len": c.q_len,
                           "ctx_len": c.ctx_len, "bytes": c.nbytes, "floor_ms": c.nbytes / copy_Bps * 1e3,
                           "layers": len(c.kvs), "plan": dataclasses.asdict(c.plan), "rows": c.rows}
                          for c in cases]

    def save() -> None:
        if args.out is None:
            return
        args.out.parent.mkdir(parents=True, exist_ok=True)
        records()
        args.out.write_text(json.dumps(state, indent=1))

    try:
        (run_variants if args.variants else run_phases)(args, cases, elapsed, state, save)
    except Fatal as exc:
        state["fatal"] = str(exc)
        print(f"FATAL: {exc}", flush=True)
    finally:
        save()
    summary(cases, copy_Bps, state, elapsed())
    if args.variants:
        variant_summary(cases)
    if args.out is not None:
        print(f"results: {args.out}")
    if args.write is not None:
        if not args.variants or state["fatal"]:
            print(f"not writing {args.write}: {'a fatal error' if state['fatal'] else 'only --variants picks them'}")
        else:
            records()
            write_long_shapes(state, args.write, str(args.out or "this run (no --out)"))
    return 1 if state["fatal"] else 0


def long_tags() -> dict[str, tuple[str, ...]]:
    """The rows a long-context shape is picked from: the plan and its prefetch variants (bf16 pages: the 64-key
    tiles BF16_LONG_SHAPE applies to), and for int8 pages the 128-key rows (INT8_LONG's tiles)."""
    return {"bf16": ("default", "pf1", "pf2", "pf1-r128"),
            "int8": ("default", "pf1", "pf1-bn128", *(tag for tag, *_ in INT8_LONG_SHAPES))}


def long_shapes(state: dict) -> dict[str, dict]:
    """The data file's sections from a --variants run: at batch 1, one new token and the longest context timed, the
    fastest correct row of `long_tags`. bf16 pages: its prefetch, stages and register cap; int8 pages (128-key rows
    only): its prefetch and warps, and the programs per SM that keep its split count (its programs over the SMs,
    rounded up: `plan` halves the splits while they exceed that)."""
    out, tags = {}, long_tags()
    for dtype, section in (("bf16", "decode_bf16_long"), ("int8", "decode_int8_long")):
        cases = [c for c in state["cases"] if c["dtype"] == dtype and c["batch"] == 1 and c["q_len"] == 1]
        if not cases:
            continue
        case = max(cases, key=lambda c: c["ctx_len"])
        rows = [r for r in case["rows"] if r.get("ok") and "ms" in r and r["tag"] in tags[dtype]
                and (dtype == "bf16" or r["config"]["block_n"] == 128)]
        if not rows:
            continue
        cfg = min(rows, key=lambda r: r["ms"])["config"]
        if dtype == "bf16":
            out[section] = {key: cfg[key] for key in ("prefetch", "num_stages", "max_regs")}
        else:
            programs = KVH * case["batch"] * cfg["num_splits"]         # one 16-row tile per sequence and KV head
            out[section] = {"prefetch": cfg["prefetch"], "num_warps": cfg["num_warps"],
                            "programs_per_sm": -(-programs // state["info"]["sms"])}
        out[section]["case"] = case["name"]
    return out


def write_long_shapes(state: dict, path: Path, source: str) -> None:
    shapes = long_shapes(state)
    for section, values in shapes.items():
        write_tuned(path, section, values, source=source, device_name=state["info"]["device"])
    print(f"wrote {path}: {shapes or 'nothing (no batch-1 long-context rows)'}", flush=True)


def run_phases(args, cases: list[Case], elapsed, state: dict, save) -> None:
    # 1. defaults (and the old int8 default), checked against the float32 twin
    print("phase 1: default plans", flush=True)
    for case in cases:
        case.ref = paged_attention_reference(case.q.float(), case.kvs[0], case.ctx, case.scale)
        row = measure(case, case.plan, "default")
        if "ms" in row:
            case.default_out = A.paged_attention(case.q, case.kvs[0], case.ctx, case.scale, config=case.plan).clone()
        if case.dtype == "int8":
            measure(case, old_default(case.plan), "old-def")
    print(f"phase 1 done at {elapsed():.0f} s", flush=True)
    save()
    if args.no_grid:
        return

    # 2. the grid, most promising shapes first so a cut loses the least
    shapes = []
    for bn, w, s in itertools.product(ints(args.block_n), ints(args.warps), ints(args.stages)):
        shapes.append((bn, w, s, True))
        if bn in (64, 128) and w == 4 and s in (2, 3):
            shapes.append((bn, w, s, False))           # the int8 path without the conversion, for comparison
    shapes.sort(key=lambda x: (x[1] != 4, x[0] == 32, x[2] > 2, x[2], -x[0], not x[3]))
    print(f"phase 2: {len(shapes)} shapes over {len(cases)} cases", flush=True)
    for i, (bn, w, s, up) in enumerate(shapes):
        if elapsed() > 0.75 * args.budget_s:
            state["cut"].append(f"grid: {len(shapes) - i} of {len(shapes)} shapes not run (budget)")
            break
        for case in cases:
            if not up and case.dtype != "int8":
                continue                               # bf16 pages: int8_upcast means nothing
            cfg = dataclasses.replace(case.plan, block_n=bn, num_warps=w, num_stages=s,
                                      int8_upcast=up and case.dtype == "int8")
            if any(r["config"] == dataclasses.asdict(cfg) for r in case.rows):
                continue
            measure(case, cfg, "grid")
        print(f"  [{i + 1}/{len(shapes)} shapes, {elapsed():.0f} s]", flush=True)

    save()

    # 3. splits around the three fastest shapes of each case
    print("phase 3: num_splits x2, /2 around the three fastest shapes", flush=True)
    for case in cases:
        if elapsed() > args.budget_s:
            state["cut"].append(f"splits: {case.name} and later cases not run (budget)")
            break
        top = sorted((r for r in case.rows if r.get("ok") and "ms" in r), key=lambda r: r["ms"])[:3]
        for r in top:
            cfg = A.AttnConfig(**r["config"])
            for splits in (cfg.num_splits * 2, cfg.num_splits // 2):
                if 1 <= splits <= 256 and splits != cfg.num_splits:
                    alt = dataclasses.replace(cfg, num_splits=splits)
                    if not any(x["config"] == dataclasses.asdict(alt) for x in case.rows):
                        measure(case, alt, "splits")


# -- --variants: the decode switches ---------------------------------------------------------------

VARIANT_TAGS = ["default", "pf1", "pf2", "pf1-r128", "pf1-bn128", "i8-np-w4", "i8-np-w8", "i8-pf1-w8",
                "i8-bn64-pf1-r128", "i8-bn64-pf1", "splits"]
# int8 128-key tiles around INT8_LONG's (prefetch 1, 4 warps: 249 registers, 2 programs per SM), each with the
# splits halved until its programs fit one wave (sm_90 registers): (tag, prefetch, warps, programs per SM)
INT8_LONG_SHAPES = [("i8-np-w4", 0, 4, 3), ("i8-np-w8", 0, 8, 2), ("i8-pf1-w8", 1, 8, 1)]


def variant_cases(text: str) -> list[tuple[int, int]]:
    """"1x512,8x8192" -> [(batch, context), ...]."""
    out = []
    for item in text.split(","):
        if item.strip():
            b, c = item.lower().split("x")
            out.append((int(b), int(c)))
    return out


def short_plan(case: Case) -> A.AttnConfig:
    """The plan without the int8 long-context tiles: the 64-key plan, with its own splits."""
    was = A.INT8_LONG
    A.INT8_LONG = False
    try:
        return A.plan(case.q, case.kvs[0], case.ctx)
    finally:
        A.INT8_LONG = was


def named_variants(case: Case) -> list[tuple[str, A.AttnConfig]]:
    """The switches on top of a case's plan (the plan itself is timed as "default"): its prefetch variants, and
    for int8 pages the 128-key shapes around INT8_LONG's and the 64-key plan with prefetch."""
    r = dataclasses.replace
    plan = case.plan
    short = short_plan(case)
    pf1 = r(plan, prefetch=1, num_stages=1)
    out = [("pf1", pf1), ("pf2", r(plan, prefetch=2, num_stages=1)), ("pf1-r128", r(pf1, max_regs=128)),
            ("pf1-bn128", r(pf1, block_n=128, min_tiles=max(1, plan.min_tiles // 2)))]
    if case.dtype == "int8" and plan.block_n == 128 and plan.prefetch == 1 and plan.num_splits > 1:
        ctas = A._num_tiles(case.q.shape[0], case.ctx, plan.block_m // (H // KVH))[1] * KVH
        for tag, prefetch, warps, per_sm in INT8_LONG_SHAPES:
            splits = short.num_splits
            while splits > 1 and ctas * splits > per_sm * A.sm_count(case.q.device):
                splits //= 2
            out.append((tag, r(plan, prefetch=prefetch, num_warps=warps, num_splits=splits)))
        # the 64-key plan with the next tile's K loaded ahead: bf16's long shape (BF16_LONG, capped at 128 registers:
        # four programs an SM) and the uncapped loop the short-context one-tile splits take (158 registers, three)
        short_pf1 = r(short, prefetch=1, num_stages=1)
        out += [("i8-bn64-pf1-r128", r(short_pf1, max_regs=128)), ("i8-bn64-pf1", short_pf1)]
    return out


def split_variants(cfg: A.AttnConfig) -> list[A.AttnConfig]:
    """num_splits /2, x2, x4 with one-tile splits allowed (min_tiles 1)."""
    out = []
    for splits in (cfg.num_splits // 2, cfg.num_splits * 2, cfg.num_splits * 4):
        if 1 <= splits <= A.MAX_DECODE_SPLITS:
            out.append(dataclasses.replace(cfg, num_splits=splits, min_tiles=1))
    return out


def run_variants(args, cases: list[Case], elapsed, state: dict, save) -> None:
    # A. the plan and its named variants, every output against the twin
    print("phase A: default plan and named variants", flush=True)
    for case in cases:
        if elapsed() > 0.8 * args.budget_s:
            state["cut"].append(f"variants: {case.name} and later cases not run (budget)")
            break
        case.ref = paged_attention_reference(case.q.float(), case.kvs[0], case.ctx, case.scale)
        row = measure(case, case.plan, "default")
        if "ms" in row:
            case.default_out = A.paged_attention(case.q, case.kvs[0], case.ctx, case.scale, config=case.plan).clone()
        for tag, cfg in named_variants(case):
            measure(case, cfg, tag)
        save()
    print(f"phase A done at {elapsed():.0f} s", flush=True)
    # B. split counts around the two fastest rows of each case
    print("phase B: num_splits /2, x2, x4 (min_tiles 1) around the two fastest rows", flush=True)
    for case in cases:
        if elapsed() > args.budget_s:
            state["cut"].append(f"splits: {case.name} and later cases not run (budget)")
            break
        top = sorted((r for r in case.rows if r.get("ok") and "ms" in r), key=lambda r: r["ms"])[:2]
        for r in top:
            for alt in split_variants(A.AttnConfig(**r["config"])):
                if not any(x["config"] == dataclasses.asdict(alt) for x in case.rows):
                    measure(case, alt, "splits")
    save()


def variant_summary(cases: list[Case]) -> None:
    """us per call: one row per case, one column per variant ("splits": the best of phase B); then the
    final table."""
    print("\nvariants, us per call (CUDA graph; '!' = output off the twin, '-' = not run):")
    print(f"{'case':24s} " + " ".join(f"{t:>9s}" for t in VARIANT_TAGS))
    for c in cases:
        cells = []
        for tag in VARIANT_TAGS:
            rows = [r for r in c.rows if r["tag"] == tag and "ms" in r]
            r = min(rows, key=lambda x: x["ms"]) if rows else None
            cells.append(f"{r['ms'] * 1e3:8.2f}{'' if r['ok'] else '!'}" if r else "        -")
        print(f"{c.name:24s} " + " ".join(f"{x:>9s}" for x in cells))
    print("\ncase | default us | best us | best GB/s | best/default | best config")
    for c in cases:
        d = next((r for r in c.rows if r["tag"] == "default" and "ms" in r), None)
        b = best(c)
        print(f"{c.name} | {_us(d).strip()} | {_us(b).strip()} | {_gbps(b).strip()} | "
              f"{(b['ms'] / d['ms']) if b and d else float('nan'):.2f} | {(b['tag'] + ': ' + b['label']) if b else '-'}")


def sm90_resources(cfg: A.AttnConfig, dtype: str, group: int = H // KVH) -> str:
    """Compile the decode kernel of `cfg` for sm_90 on this machine (no device) and read its registers,
    stack (> 0: spills) and shared memory from the cubin. Specialized as a launch of these shapes
    would be (16-aligned pointers, strides divisible by 16, scale head stride 1)."""
    import triton.backends.nvidia as nv
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = A._attn_kernel
    quant = dtype == "int8"
    sig = {}
    for n in fn.arg_names:
        if n in ("q_ptr", "o_ptr"):
            sig[n] = "*bf16"
        elif n in ("k_ptr", "v_ptr"):
            sig[n] = "*i8" if quant else "*bf16"
        elif n in ("ks_ptr", "vs_ptr", "pacc_ptr", "pm_ptr", "pl_ptr"):
            sig[n] = "*fp32"
        elif n.endswith("_ptr"):
            sig[n] = "*i32"
        elif n == "qk_scale":
            sig[n] = "fp32"
        elif n.isupper():
            sig[n] = "constexpr"
        else:
            sig[n] = "i32"
    consts = {"GROUP": group, "BLOCK_Q": cfg.block_m // group, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
              "HEAD_DIM": D, "PAGE": PAGE, "QUANT": quant, "SPLIT": cfg.num_splits > 1,
              "UPCAST": quant and cfg.int8_upcast, "PREFETCH": int(cfg.prefetch), "stride_sh": 1}
    sig["stride_sh"] = "constexpr"
    div16 = [n for n in fn.arg_names if n.endswith("_ptr")] + ["stride_qt", "stride_qh", "stride_ot", "stride_oh",
                                                                "stride_pb", "stride_pt", "stride_ph", "stride_sb",
                                                                "stride_tab", "num_heads"]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"maxnreg": cfg.max_regs} if cfg.max_regs else {}))
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=opts)
    cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"attn_{os.getpid()}.cubin"
    cubin.write_bytes(k.asm["cubin"])
    try:
        usage = subprocess.run([str(Path(nv.__file__).parent / "bin" / "cuobjdump"), "--dump-resource-usage",
                                str(cubin)], capture_output=True, text=True, check=False).stdout
    finally:
        cubin.unlink(missing_ok=True)
    import re
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    if not regs:
        return "resources unknown"
    n = int(regs.group(1))
    per_sm = min(65536 // (-(-n // 8) * 8 * 32 * cfg.num_warps), 228 * 1024 // (k.metadata.shared + 1024))
    flag = "  SPILLS" if stack and int(stack.group(1)) else ""
    return f"{n:3d} regs, stack {stack.group(1) if stack else '?'} B, smem {k.metadata.shared // 1024} KB, {per_sm}/SM{flag}"


def dry_run(args) -> int:
    """The configs --variants would time, from plans made on CPU tensors of the same shapes; with
    --regs also each one's registers for sm_90 (compiled here, about a second each)."""
    from engine.worker.forward_context import build_forward_context
    cpu = torch.device("cpu")
    n = 0
    seen: dict = {}                                  # one compile per kernel specialization
    for batch, ctx_len in variant_cases(args.cases):
        need = -(-ctx_len // PAGE)
        tables = [list(range(i * need, (i + 1) * need)) for i in range(batch)]
        _, ctx = build_forward_context([1] * batch, [ctx_len] * batch, tables, PAGE, cpu)
        q = torch.empty(batch, H, D, dtype=torch.bfloat16)
        for dtype in [d for d in args.dtypes.split(",") if d in ("bf16", "int8")]:
            kv = (LayerKV(torch.empty(1, PAGE, KVH, D, dtype=torch.int8), torch.empty(1, PAGE, KVH, D, dtype=torch.int8),
                          torch.empty(1, PAGE, KVH), torch.empty(1, PAGE, KVH)) if dtype == "int8"
                  else LayerKV(torch.empty(1, PAGE, KVH, D, dtype=torch.bfloat16),
                               torch.empty(1, PAGE, KVH, D, dtype=torch.bfloat16)))
            plan = A.plan(q, kv, ctx)
            print(f"{dtype} b{batch} q1 ctx{ctx_len}")
            case_like = types.SimpleNamespace(q=q, kvs=[kv], ctx=ctx, plan=plan, dtype=dtype)
            for tag, cfg in [("default", plan), *named_variants(case_like)]:
                res = ""
                if args.regs:
                    key = dataclasses.replace(cfg, num_splits=min(cfg.num_splits, 2), min_tiles=1)
                    if (key, dtype) not in seen:
                        seen[(key, dtype)] = sm90_resources(cfg, dtype)
                    res = "  " + seen[(key, dtype)]
                print(f"  A {tag:10s} {label(cfg):44s}{res}", flush=True)
                n += 1
            print(f"  B around the two fastest, e.g. the plan: {', '.join(label(c) for c in split_variants(plan))}")
    print(f"{n} phase-A timings (+ up to 6 per case in phase B)")
    return 0


def _us(r: dict | None) -> str:
    return f"{r['ms'] * 1e3:8.2f}" if r and "ms" in r else "       -"


def _gbps(r: dict | None) -> str:
    return f"{r['GBps']:5.0f}" if r and "ms" in r else "    -"


def _ratio(slow: dict | None, fast: dict | None) -> str:
    return f"{slow['ms'] / fast['ms']:.2f}x" if slow and fast and "ms" in slow and "ms" in fast else "-"


def summary(cases: list[Case], copy_Bps: float, state: dict, seconds: float) -> None:
    us, gb = _us, _gbps
    print(f"\n=== decode attention sweep: {state['info']['device']}, torch {state['info']['torch']}, "
          f"triton {state['info']['triton']}, {seconds:.0f} s; copy {copy_Bps / 1e12:.2f} TB/s ===")
    print("times are us per call (CUDA graph, pages rotated out of L2); floor = bytes / copy bandwidth; "
          "GB/s = bytes / time; 'up' = int8_upcast")
    print(f"{'case':24s} {'MB':>6s} {'floor':>7s} | {'default':>8s} {'GB/s':>5s} {'old-def':>8s} | "
          f"{'best':>8s} {'GB/s':>5s} {'of fl':>5s}  best config")
    by_key = {}
    for c in cases:
        d = next((r for r in c.rows if r["tag"] == "default"), None)
        o = next((r for r in c.rows if r["tag"] == "old-def"), None)
        b = best(c)
        by_key.setdefault(c.key, {})[c.dtype] = (d, b)
        floor_us = c.nbytes / copy_Bps * 1e6
        bad = "" if d and d.get("ok") else "  (default FAILED or WRONG)"
        print(f"{c.name:24s} {c.nbytes / 1e6:6.1f} {floor_us:7.2f} | {us(d)} {gb(d)} {us(o) if o else '       -'} | "
              f"{us(b)} {gb(b)} {(floor_us / 1e3 / b['ms']) if b else 0:5.2f}  {b['label'] if b else '-'}{bad}")
    pairs = [(k, v) for k, v in by_key.items() if "bf16" in v and "int8" in v]
    if pairs:
        print("int8 pages against bf16 pages (bf16 time / int8 time; goal >= 1.10 at 32k):")
        for (batch, q_len, ctx_len), v in pairs:
            (bd, bb), (idf, ib) = v["bf16"], v["int8"]
            print(f"  b{batch} q{q_len} ctx{ctx_len}: defaults {_ratio(bd, idf)}, best of each {_ratio(bb, ib)}")
    wrong = [(c.name, r["label"]) for c in cases for r in c.rows if "ms" in r and not r.get("ok")]
    failed = sum(1 for c in cases for r in c.rows if "error" in r)
    print(f"{sum(len(c.rows) for c in cases)} timings, {failed} shapes skipped (compile/resources), "
          f"{len(wrong)} wrong outputs{': ' + str(wrong[:6]) if wrong else ''}")
    for line in state["cut"]:
        print(f"cut: {line}")
    if state["fatal"]:
        print(f"FATAL: {state['fatal']}")


if __name__ == "__main__":
    sys.exit(main())
