"""One GPU run (< 150 s, one H200): the TMA prefill attention kernel against the paged kernel and torch.

    PYTHONUNBUFFERED=1 python tools/dev/prefill_attention_check.py [--quick] [--no-sweep]
    python tools/dev/prefill_attention_check.py --compile-only      # on a CPU: sm_90 PTX/ptxas report

qwen3-8b shapes (32 q heads, 8 KV heads, head_dim 128, pages of 16), one layer:
1. correctness of `prefill_attention` (engine/kernels/attention/prefill_tma.py) against torch SDPA in
   float32 on the same contiguous K/V: chunk 4096 at context 0, chunk 1024 after 3000 keys, a packed
   batch of three sequences (lengths not multiples of the tile), head_dim 256 with group 6; and of
   gather + kernel against the engine's `paged_attention` on the same pages;
2. timings (median of single calls after an L2 flush, tools/gpu_kernels_check.bench) per case
   chunk 4096 at context 0 / 8k / 28k, chunks 1024 and 2048 after 28k:
     paged      engine.kernels.attention.paged.paged_attention (the engine's prefill path today)
     gather     gather_kv alone (pages -> contiguous K/V)
     gath+tma   gather_kv + prefill_attention
     tma        prefill_attention on K/V already contiguous
     sdpa-*     torch SDPA on contiguous K/V (flash, cuDNN, efficient; each where it runs)
   with TFLOP/s = 4 * heads * head_dim per visible (query, key) pair / time;
3. a sweep of launch shapes (BLOCK_M/BLOCK_N/stages/warps/maxnreg/TMA store) at
   chunk 4096 after 28k and at context 0, then the whole prompt P=32768 in chunks of 4096 (sum over
   the 8 chunks) for paged and gather+tma, and the matmul ceiling.
Prints a compact table last; $OUT/prefill_attention.json gets everything when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

H, KVH, D, PAGE = 32, 8, 128, 16            # qwen3-8b
ROWS: list[dict] = []
SHRINK = 1                                  # --smoke: every length / 64


def sz(n: int) -> int:
    return max(1, n // SHRINK)


def sweep_configs():
    from engine.kernels.attention.prefill_tma import PrefillConfig as C
    return {
        "bm128 bn128 w8 s2": C(),
        "bm128 bn128 w8 s3": C(num_stages=3),
        "bm128 bn64 w8 s3": C(block_n=64, num_stages=3),
        "bm128 bn64 w8 s2 reg128 (2/SM, default)": C(block_n=64, num_stages=2, maxnreg=128),
        "bm64 bn64 w4 s2 (2/SM)": C(block_m=64, block_n=64, num_warps=4, num_stages=2),
        "bm64 bn64 w4 s3": C(block_m=64, block_n=64, num_warps=4, num_stages=3),
        "bm64 bn128 w4 s2": C(block_m=64, block_n=128, num_warps=4, num_stages=2),
        "bm128 bn128 w8 s2 no-tma-store": C(tma_store=False),
    }


# -- CPU: compile for sm_90 -----------------------------------------------------------------------

def compile_only() -> None:
    """PTX and cubin figures for sm_90 of every sweep shape (no GPU needed): TMA copies and wgmma in
    the PTX, setmaxnreg (present only if warp specialization took), shared memory, registers."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.kernels.attention.prefill_tma import PrefillConfig
    from engine.kernels.attention.prefill_tma import _prefill_attn_kernel as K
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    consts = ("GROUP", "HEAD_DIM", "BLOCK_M", "BLOCK_N", "NUM_STAGES", "TMA_STORE")
    shapes = dict(sweep_configs())
    shapes["head_dim 256 default"] = PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
    print(f"triton {triton.__version__}, target sm_90")
    for name, cfg in shapes.items():
        d = 256 if "256" in name else D
        sig = {n: ("constexpr" if n in consts else "i32") for n in K.arg_names}
        sig.update(desc_q=f"tensordesc<bf16[{cfg.block_m}, {d}]>", desc_o=f"tensordesc<bf16[{cfg.block_m}, {d}]>",
                   desc_k=f"tensordesc<bf16[{cfg.block_n}, {d}]>", desc_v=f"tensordesc<bf16[{cfg.block_n}, {d}]>",
                   o_ptr="*bf16", cu_q_ptr="*i32", cu_k_ptr="*i32", qk_scale="fp32")
        cx = dict(GROUP=4, HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
                  TMA_STORE=cfg.tma_store)                                                      # group 4 (qwen3-8b)
        opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if cfg.maxnreg:
            opts["maxnreg"] = cfg.maxnreg
        try:
            k = triton.compile(ASTSource(K, sig, constexprs=cx), target=GPUTarget("cuda", 90, 32), options=opts)
        except Exception as exc:
            print(f"  {name:34s} FAILED {repr(exc)[:200]}")
            continue
        ptx = k.asm["ptx"]
        # registers / spills of the cubin Triton built (its own ptxas), read back with cuobjdump
        with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
            f.write(k.asm["cubin"])
        r = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True)
        os.unlink(f.name)
        info = " ".join(w for line in r.stdout.splitlines() if "REG:" in line for w in line.split()
                        if w.split(":")[0] in ("REG", "STACK", "LOCAL"))
        print(f"  {name:34s} TMA {ptx.count('cp.async.bulk.tensor'):2d}  wgmma {ptx.count('wgmma.mma_async'):2d}  "
              f"setmaxnreg {ptx.count('setmaxnreg')}  shared {k.metadata.shared / 1024:.0f} KB  | {info}")


# -- GPU --------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer cases: a check that the script runs")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="every length / 64: a check that the script runs")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)   # cpu: a dry run under the interpreter
    args = ap.parse_args()
    global SHRINK
    if args.smoke:
        SHRINK = 64
    if args.compile_only:
        compile_only()
        return

    import torch
    import torch.nn.functional as F
    import triton

    from engine.worker.forward_context import build_forward_context
    from engine.kernels.attention import paged as A
    from engine.kernels.attention import prefill_tma as P
    from engine.worker.paged_kv import gather_kv
    from tools.dev import gpu_kernel_suite as G
    G.SHRINK = SHRINK

    dev = torch.device(args.device)
    G.DEV = dev
    started = time.perf_counter()
    from tools.bench.runinfo import device_info, git_commit
    info = {"device": device_info(dev.type), "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), **git_commit()}
    print(info, flush=True)
    scale = D ** -0.5

    def cu(lens):
        c = torch.zeros(len(lens) + 1, dtype=torch.int32)
        c[1:] = torch.cumsum(torch.tensor(lens), 0)
        return c.to(dev)

    def sdpa_ref(q, k, v, qlens, klens, sc, dtype=torch.float32, backend=None):
        """Per sequence torch SDPA (causal, bottom right); float32 by default (the reference)."""
        from torch.nn.attention import sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right
        outs, aq, ak = [], 0, 0
        g = q.shape[1] // k.shape[1]
        for a, b in zip(qlens, klens):
            qq = q[aq:aq + a].to(dtype).transpose(0, 1).unsqueeze(0)
            kk = k[ak:ak + b].to(dtype).repeat_interleave(g, 1).transpose(0, 1).unsqueeze(0)
            vv = v[ak:ak + b].to(dtype).repeat_interleave(g, 1).transpose(0, 1).unsqueeze(0)
            kw = dict(is_causal=True) if a == b else dict(attn_mask=causal_lower_right(a, b))
            if backend is None:
                o = F.scaled_dot_product_attention(qq, kk, vv, scale=sc, **kw)
            else:
                with sdpa_kernel([backend]):
                    o = F.scaled_dot_product_attention(qq, kk, vv, scale=sc, **kw)
            outs.append(o[0].transpose(0, 1))
            aq, ak = aq + a, ak + b
        return torch.cat(outs)

    def rel(out, ref):
        return float((out.float() - ref.float()).norm() / ref.float().norm())

    # 1. correctness ---------------------------------------------------------------------------
    print("correctness (relative L2 error against float32 SDPA; bf16 SDPA for scale):", flush=True)
    checks = [("chunk4096 ctx0", [4096], [4096], H, KVH, D), ("chunk1024 after 3000", [1024], [4024], H, KVH, D),
              ("packed 3 seqs", [300, 1000, 77], [1000, 1000, 2077], H, KVH, D),
              ("hd256 g6 chunk700 after 500", [700], [1200], 24, 4, 256)]
    correct = {}
    for name, ql, kl, h, kvh, d in checks:
        ql, kl = [sz(n) for n in ql], [sz(m - n) + sz(n) for n, m in zip(ql, kl)]
        try:
            g = torch.Generator(device=dev).manual_seed(len(name))
            q = torch.randn(sum(ql), h, d, device=dev, generator=g).bfloat16()
            k = torch.randn(sum(kl), kvh, d, device=dev, generator=g).bfloat16()
            v = torch.randn(sum(kl), kvh, d, device=dev, generator=g).bfloat16()
            out = P.prefill_attention(q, k, v, cu(ql), cu(kl), max(ql), d ** -0.5)
            ref = sdpa_ref(q, k, v, ql, kl, d ** -0.5)
            bf = sdpa_ref(q, k, v, ql, kl, d ** -0.5, dtype=torch.bfloat16)
            correct[name] = {"rel_err": rel(out, ref), "sdpa_bf16_rel_err": rel(bf, ref),
                             "nan": int(torch.isnan(out.float()).sum())}
        except Exception as exc:
            traceback.print_exc()
            correct[name] = {"error": repr(exc)[:300]}
        print(f"  {name:34s} {correct[name]}", flush=True)
    # gather + kernel against the engine's paged kernel, same pages (shuffled tables, two sequences)
    try:
        ql, kl = [sz(1500), sz(333)], [sz(3500) + sz(1500), sz(333)]
        kvs, tables = G.make_pool(1, kl, PAGE, torch.bfloat16, seed=3)
        _, ctx = build_forward_context(ql, kl, tables, PAGE, dev)
        q = torch.randn(sum(ql), H, D, device=dev).bfloat16()
        ours = P.prefill_from_pages(q, kvs[0].k, kvs[0].v, ctx.block_tables, ql, kl, scale)
        paged = A.paged_attention(q, kvs[0], ctx, scale, config=A.plan(q, kvs[0], ctx))   # the paged kernel itself
        kk, vv, _ = gather_kv(kvs[0].k, kvs[0].v, ctx.block_tables, kl)
        ref = sdpa_ref(q, kk, vv, ql, kl, scale)
        correct["pages: gather+tma vs paged"] = {"rel_err": rel(ours, ref), "paged_rel_err": rel(paged, ref)}
    except Exception as exc:
        traceback.print_exc()
        correct["pages: gather+tma vs paged"] = {"error": repr(exc)[:300]}
    print(f"  {'pages: gather+tma vs paged':34s} {correct['pages: gather+tma vs paged']}", flush=True)
    ok = all(c.get("rel_err", 1) < 1e-2 and not c.get("nan") for c in correct.values())
    print(f"  correctness {'OK' if ok else 'FAILED'} (bar: rel_err < 1e-2)", flush=True)

    # 2. timings ------------------------------------------------------------------------------------
    ceil = G.ceilings()
    mm = ceil["matmul_flops"]
    from torch.nn.attention import SDPBackend

    def time_case(label, chunk, context, configs=None, peers=True):
        chunk, context = sz(chunk), sz(context)
        S = context + chunk
        kvs, tables = G.make_pool(1, [S], PAGE, torch.bfloat16, seed=S)
        kv = kvs[0]
        _, ctx = build_forward_context([chunk], [S], tables, PAGE, dev)
        q = torch.randn(chunk, H, D, device=dev).bfloat16()
        flops = A.attention_flops([S], [chunk], H, D)
        kk, vv, cuk = gather_kv(kv.k, kv.v, ctx.block_tables, [S])
        kk, vv = kk.contiguous(), vv.contiguous()
        cuq = cu([chunk])
        row = {"case": label, "chunk": chunk, "context": context, "flops": flops, "ms": {}}

        def add(name, fn, **kw):
            try:
                t = G.bench(fn, **kw)["ms"]
            except Exception as exc:
                print(f"    {label} {name}: not timed ({repr(exc)[:150]})", flush=True)
                return None
            row["ms"][name] = t
            rate = "" if name == "gather" else f"{flops / t / 1e9:6.0f} TFLOP/s"
            print(f"  {label:26s} {name:34s} {t:8.3f} ms  {rate}", flush=True)
            return t

        # the paged kernel itself: without a config, paged_attention routes bf16 prefill to the TMA kernel
        add("paged", lambda: A.paged_attention(q, kv, ctx, scale, config=A.plan(q, kv, ctx)))
        add("gather", lambda: gather_kv(kv.k, kv.v, ctx.block_tables, [S]))
        add("gath+tma", lambda: P.prefill_from_pages(q, kv.k, kv.v, ctx.block_tables, [chunk], [S], scale))
        add("tma", lambda: P.prefill_attention(q, kk, vv, cuq, cuk, chunk, scale))
        for cname, cfg in (configs or {}).items():
            add(f"tma [{cname}]", lambda: P.prefill_attention(q, kk, vv, cuq, cuk, chunk, scale, config=cfg))
        if peers:
            from torch.nn.attention import sdpa_kernel
            from torch.nn.attention.bias import causal_lower_right
            qq = q.transpose(0, 1).unsqueeze(0)
            k4, v4 = kk.transpose(0, 1).unsqueeze(0), vv.transpose(0, 1).unsqueeze(0)        # [1, KVH, S, D]
            for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
                mask = dict(is_causal=True) if chunk == S else dict(attn_mask=causal_lower_right(chunk, S))
                done = False
                for gqa in (True, False):
                    if done:
                        break
                    kx, vx = (k4, v4) if gqa else (k4.repeat_interleave(H // KVH, 1), v4.repeat_interleave(H // KVH, 1))
                    kw = dict(mask, enable_gqa=True) if gqa else mask

                    def f(kx=kx, vx=vx, kw=kw, backend=backend):
                        with sdpa_kernel([backend]):
                            return F.scaled_dot_product_attention(qq, kx, vx, scale=scale, **kw)
                    try:
                        f()
                        torch.cuda.synchronize()
                    except Exception:
                        continue
                    done = add(f"sdpa-{backend.name.lower().replace('_attention', '')}{'' if gqa else '+expKV'}",
                               f) is not None
        ROWS.append(row)
        torch.cuda.empty_cache()

    sweep = None if args.no_sweep else sweep_configs()
    print("timings, one layer (median of single calls after an L2 flush):", flush=True)
    cases = [("chunk4096 ctx0", 4096, 0), ("chunk4096 after 8k", 4096, 8192), ("chunk4096 after 28k", 4096, 28672),
             ("chunk1024 after 28k", 1024, 28672), ("chunk2048 after 28k", 2048, 28672)]
    if args.quick:
        cases = cases[:1] + cases[2:3]
    for label, chunk, context in cases:
        try:
            time_case(label, chunk, context, configs=sweep if context in (0, 28672) and chunk == 4096 else None)
        except Exception as exc:
            traceback.print_exc()
            ROWS.append({"case": label, "error": repr(exc)[:300]})

    # 3. whole prompt P=32768 in chunks of 4096, one layer: paged vs gather+tma (default config)
    prompt = {}
    if not args.quick:
        try:
            n = sz(4096)
            kvs, tables = G.make_pool(1, [8 * n], PAGE, torch.bfloat16, seed=7)
            tot = {"paged": 0.0, "gath+tma": 0.0}
            flops = 0
            for S in range(n, 8 * n + 1, n):
                _, ctx = build_forward_context([n], [S], tables, PAGE, dev)
                q = torch.randn(n, H, D, device=dev).bfloat16()
                tot["paged"] += G.bench(lambda: A.paged_attention(q, kvs[0], ctx, scale, config=A.plan(q, kvs[0], ctx)),
                                        budget_ms=40)["ms"]
                tot["gath+tma"] += G.bench(lambda: P.prefill_from_pages(q, kvs[0].k, kvs[0].v, ctx.block_tables,
                                                                        [n], [S], scale), budget_ms=40)["ms"]
                flops += A.attention_flops([S], [n], H, D)
            prompt = {"flops": flops, "ms": tot}
            for k, v in tot.items():
                print(f"  P=32768 in 8 chunks of 4096, sum {k:10s} {v:8.3f} ms  {flops / v / 1e9:6.0f} TFLOP/s  "
                      f"(x36 layers: {v * 36 / 1e3:.3f} s)", flush=True)
        except Exception as exc:
            traceback.print_exc()
            prompt = {"error": repr(exc)[:300]}

    seconds = time.perf_counter() - started
    if os.environ.get("OUT"):
        out_dir = Path(os.environ["OUT"])
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "prefill_attention.json").write_text(json.dumps(
            {"info": info, "correct": correct, "ceilings": {"matmul_flops": mm, "copy_Bps": ceil["copy_Bps"]},
             "rows": ROWS, "prompt_32k": prompt, "seconds": seconds,
             "sweep": {k: dataclasses.asdict(v) for k, v in (sweep or {}).items()}}, indent=1))

    # compact table ---------------------------------------------------------------------------------
    print(f"\n=== prefill attention on {info['device']['name']} (torch {info['torch']}, triton {info['triton']}), "
          f"{seconds:.0f} s; matmul {mm / 1e12:.0f} TFLOP/s; correctness {'OK' if ok else 'FAILED'} ===")
    print(f"{'case':24s} {'route':36s} {'ms':>8s} {'TF/s':>6s} {'of mm':>6s} {'vs paged':>8s}")
    for r in ROWS:
        if "error" in r:
            print(f"{r['case']:24s} ERROR {r['error'][:100]}")
            continue
        base = r["ms"].get("paged")
        for name, t in sorted(r["ms"].items(), key=lambda kv: kv[1]):
            if name == "gather":            # a copy: its bandwidth (K and V read and written), not FLOPs
                gbytes = 2 * 2 * (r["context"] + r["chunk"]) * KVH * D * 2
                print(f"{r['case']:24s} {name:36s} {t:8.3f} {gbytes / t / 1e9:5.2f}TB/s {'':>6s} "
                      f"{'':>8s} ({t / r['ms'].get('tma', t) * 100:.1f}% of tma)")
                continue
            tf = r["flops"] / t / 1e9
            sp = f"{base / t:7.2f}x" if base else ""
            print(f"{r['case']:24s} {name:36s} {t:8.3f} {tf:6.0f} {tf * 1e12 / mm:6.2f} {sp:>8s}")
    if prompt.get("ms"):
        for k, v in prompt["ms"].items():
            print(f"{'P=32768 (8 x 4096)':24s} {k:36s} {v:8.3f} {prompt['flops'] / v / 1e9:6.0f} "
                  f"{prompt['flops'] / v / 1e-3 / mm:6.2f}")


if __name__ == "__main__":
    main()
