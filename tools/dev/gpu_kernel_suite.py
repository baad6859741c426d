"""One run on the GPU machine: check the Triton kernels, then time them against their limits.

    PYTHONUNBUFFERED=1 python3 tools/dev/gpu_kernel_suite.py [--skip-tests] [--no-sweep] [--smoke]

1. correctness: pytest tests/engine/kernels/attention/test_paged_gpu.py (in a subprocess; log in $OUT/pytest.log);
2. ceilings, measured here: device-to-device copy bandwidth and an 8192^3 bf16 matmul;
3. every kernel at the benchmark shapes (qwen3-8b: 32 q heads, 8 KV heads, head_dim 128, pages of
   16): ours, the torch twin, torch SDPA over contiguous K/V as the peer (the fastest backend that
   runs), and the floor max(bytes / copy bandwidth, FLOPs / matmul rate). Single calls are timed
   with events after an L2 flush (median); decode steps also as a CUDA graph of 36 layers, each on
   its own KV pages, which is how the engine runs them;
4. sweeps of the attention launch shapes and the page size, to confirm or move the defaults.
Prints a compact table last; full figures go to $OUT/kernels.json when OUT is set. --smoke shrinks
every shape (contexts / 256, 2 layers): a quick check that the script itself runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.worker.forward_context import build_forward_context                         # noqa: E402
from engine.kernels.attention import paged as A                                          # noqa: E402
from engine.kernels.elementwise import norm_rope as fused                                                   # noqa: E402
from engine.worker.paged_kv import LayerKV                                                # noqa: E402
from engine.layers.attention import paged_attention_reference, write_kv_reference  # noqa: E402
from tests.support import kernel_checks                                                    # noqa: E402

DEV = torch.device("cuda")
H, KVH, D, LAYERS = 32, 8, 128, 36          # qwen3-8b
HIDDEN, FFN = 4096, 12288
RESULTS: list[dict] = []
PEER_JOBS: list[tuple[dict, int, list[int]]] = []      # timed last: a failing SDPA backend cannot spoil ours
_FLUSH = None
SHRINK = 1                                  # --smoke: contexts, chunks and buffers / 256


def sz(n: int) -> int:
    return max(1, n // SHRINK)


# -- timing ----------------------------------------------------------------------------------------

def bench(fn, budget_ms: float = 150.0, flush: bool = True) -> dict:
    """Median ms of single calls, each after an L2 flush (256 MB written, not timed)."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(sz(64 * 2**20), dtype=torch.int32, device=DEV)
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = (time.perf_counter() - t0) * 1e3
    reps = int(min(60, max(5, budget_ms / max(est, 1e-3))))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        if flush:
            _FLUSH.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(e) for s, e in ev)
    return {"ms": statistics.median(ts), "p20": ts[len(ts) // 5], "p80": ts[(4 * len(ts)) // 5], "n": reps}


def bench_graph(fn, calls: int, replays: int = 20) -> dict:
    """ms per call of `fn` (which makes `calls` calls) captured once in a CUDA graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / calls)
    ts.sort()
    del graph
    return {"ms": statistics.median(ts), "p20": ts[len(ts) // 5], "p80": ts[(4 * len(ts)) // 5], "n": replays}


def record(name: str, ours: dict, floor_ms: float, **extra) -> dict:
    r = {"name": name, "ours_ms": ours["ms"], "ours_p20": ours["p20"], "ours_p80": ours["p80"],
         "floor_ms": floor_ms, "of_floor": floor_ms / ours["ms"] if ours["ms"] else float("nan"), **extra}
    RESULTS.append(r)
    ref = f" ref {r['ref_ms']:.4f}" if r.get("ref_ms") else ""
    peer = f" peer {r['peer_ms']:.4f} ({r.get('peer')})" if r.get("peer_ms") else ""
    print(f"  {name:44s} ours {ours['ms']:.4f} ms  floor {floor_ms:.4f}  ({r['of_floor']:.2f} of floor){ref}{peer}",
          flush=True)
    return r


def guarded(fn):
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:                                    # keep going: one failure, one row
            traceback.print_exc()
            RESULTS.append({"name": f"{fn.__name__} FAILED", "error": repr(exc)[:300]})
        finally:
            torch.cuda.empty_cache()
    return run


# -- ceilings ----------------------------------------------------------------------------------------

def ceilings() -> dict:
    src = torch.randn(sz(2**30), dtype=torch.bfloat16, device=DEV)      # 2 GiB
    dst = torch.empty_like(src)
    copy = bench(lambda: dst.copy_(src), flush=False)
    bw = 2 * src.numel() * 2 / (copy["ms"] * 1e-3)
    del src, dst
    n = 8192 // (16 if SHRINK > 1 else 1)
    a = torch.randn(n, n, dtype=torch.bfloat16, device=DEV)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=DEV)
    mm = bench(lambda: a @ b, flush=False)
    flops = 2 * n**3 / (mm["ms"] * 1e-3)
    print(f"ceilings: copy {bw / 1e12:.3f} TB/s, bf16 matmul {n}^3 {flops / 1e12:.0f} TFLOP/s", flush=True)
    return {"copy_Bps": bw, "matmul_flops": flops, "copy": copy, "matmul": mm}


# -- attention ---------------------------------------------------------------------------------------

def make_pool(layers: int, seq_lens: list[int], page: int, kv_dtype, seed: int) -> tuple[list[LayerKV], list[list[int]]]:
    """`layers` LayerKVs on one pool (as the runner allocates) and shuffled block tables."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // page) for s in seq_lens]
    blocks = sum(need) + 1
    shape = (layers, 2, blocks, page, KVH, D)
    if kv_dtype == torch.int8:
        pages = torch.randint(-127, 128, shape, dtype=torch.int8, device=DEV)
        scales = torch.rand(shape[:-1], device=DEV) * 0.02 + 0.004
        kvs = [LayerKV(pages[i, 0], pages[i, 1], scales[i, 0], scales[i, 1]) for i in range(layers)]
    else:
        pages = torch.randn(shape, dtype=kv_dtype, device=DEV)
        kvs = [LayerKV(pages[i, 0], pages[i, 1]) for i in range(layers)]
    perm = torch.randperm(blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    return kvs, tables


def run_peers() -> None:
    for row, q_len, seq_lens in PEER_JOBS:
        try:
            row["peer_ms"], row["peer"] = peer_sdpa(q_len, seq_lens)
            print(f"  peer {row['name']:44s} {row['peer_ms']} ms ({row['peer']})", flush=True)
        except Exception as exc:
            print(f"  peer {row['name']}: {repr(exc)[:160]}")
        torch.cuda.empty_cache()


def peer_sdpa(q_len: int, seq_lens: list[int]) -> tuple[float | None, str]:
    """torch SDPA over contiguous K/V [B, kv_heads, S, D] (equal lengths), causal aligned to the
    bottom right: the fastest of the flash, memory-efficient and cuDNN backends that runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    B, S = len(seq_lens), seq_lens[0]
    q = torch.randn(B, H, q_len, D, dtype=torch.bfloat16, device=DEV)
    k = torch.randn(B, KVH, S, D, dtype=torch.bfloat16, device=DEV)
    v = torch.randn_like(k)
    best, label = None, ""
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        for gqa in (True, False):
            kk, vv = (k, v) if gqa else (k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1))
            kw = {"enable_gqa": True} if gqa else {}
            if q_len > 1:
                kw.update(is_causal=True) if q_len == S else kw.update(attn_mask=causal_lower_right(q_len, S))
            try:
                with sdpa_kernel([backend]):
                    t = bench(lambda: F.scaled_dot_product_attention(q, kk, vv, **kw))["ms"]
            except Exception:
                continue
            if best is None or t < best:
                best, label = t, f"{backend.name.lower()}{'' if gqa else '+expandedKV'}"
            break
    return best, label


@guarded
def attention_case(name: str, ceil: dict, query_lens: list[int], seq_lens: list[int], kv_dtype=torch.bfloat16,
                   page: int = 16, configs: dict | None = None, step_graph: bool = False, peer: bool = True,
                   reference: bool = True) -> None:
    if SHRINK > 1:
        query_lens = [q if q <= 16 else sz(q) for q in query_lens]
        seq_lens = [q + sz(s - q) for q, s in zip(query_lens, seq_lens)]
    layers = LAYERS if step_graph else 1
    kvs, tables = make_pool(layers, seq_lens, page, kv_dtype, seed=len(name))
    _, ctx = build_forward_context(query_lens, seq_lens, tables, page, DEV)
    T = sum(query_lens)
    q = torch.randn(T, H, D, dtype=torch.bfloat16, device=DEV)
    scale = D ** -0.5
    nbytes = A.attention_bytes(kvs[0], seq_lens, query_lens, H, 2)
    flops = A.attention_flops(seq_lens, query_lens, H, D)
    floor = max(nbytes / ceil["copy_Bps"], flops / ceil["matmul_flops"]) * 1e3
    plan = A.plan(q, kvs[0], ctx)
    ours = bench(lambda: A.paged_attention(q, kvs[0], ctx, scale))
    extra = {"bytes": nbytes, "flops": flops, "plan": dataclasses.asdict(plan),
             "TBps": nbytes / ours["ms"] / 1e9, "TFLOPs": flops / ours["ms"] / 1e9}
    if reference:
        extra["ref_ms"] = bench(lambda: paged_attention_reference(q, kvs[0], ctx, scale), budget_ms=60)["ms"]
    row = record(name, ours, floor, **extra)
    if peer and len(set(seq_lens)) == 1 and len(set(query_lens)) == 1:
        PEER_JOBS.append((row, query_lens[0], seq_lens))
    for label, cfg in (configs or {}).items():
        t = bench(lambda: A.paged_attention(q, kvs[0], ctx, scale, config=cfg))
        record(f"{name} [{label}]", t, floor, plan=dataclasses.asdict(cfg), sweep_of=name)
    if len(seq_lens) == 1 and query_lens[0] * H // KVH > A.DECODE_MAX_ROWS:
        try:                                             # the optional torch route (PREFILL_VIA_SDPA)
            t = bench(lambda: kernel_checks.sdpa_prefill(q, kvs[0], ctx, scale))
            record(f"{name} [gather+sdpa]", t, floor, sweep_of=name)
        except Exception as exc:
            print(f"    gather+sdpa not timed: {repr(exc)[:160]}")
    if step_graph:
        # one decode step's attention: write_kv + attention (+ merge) for 36 layers in one graph
        knew = torch.randn(2, T, KVH, D, dtype=torch.bfloat16, device=DEV)

        def step():
            for kv in kvs:
                A.write_kv(kv, knew[0], knew[1], ctx.slot_mapping)
                A.paged_attention(q, kv, ctx, scale)
        g = bench_graph(step, calls=1)
        record(f"{name} x{LAYERS} layers (graph)", g, floor * LAYERS, bytes=nbytes * LAYERS)


def prefill_total(ceil: dict, prompt: int, chunk: int, page: int = 16) -> None:
    """Attention of a whole prompt prefilled chunk by chunk, one layer: the sum over its chunks,
    through the Triton kernel and through the gather + SDPA route."""
    prompt, chunk = sz(prompt), sz(chunk)
    kvs, tables = make_pool(1, [prompt], page, torch.bfloat16, seed=prompt)
    totals, flops = {"triton": 0.0, "gather+sdpa": 0.0}, 0
    for start in range(0, prompt, chunk):
        n = min(chunk, prompt - start)
        _, ctx = build_forward_context([n], [start + n], tables, page, DEV)
        q = torch.randn(n, H, D, dtype=torch.bfloat16, device=DEV)
        totals["triton"] += bench(lambda: A.paged_attention(q, kvs[0], ctx, D ** -0.5), budget_ms=60)["ms"]
        if totals["gather+sdpa"] is not None:
            ms = attempt(lambda: bench(lambda: kernel_checks.sdpa_prefill(q, kvs[0], ctx, D ** -0.5), budget_ms=60))
            totals["gather+sdpa"] = None if ms is None else totals["gather+sdpa"] + ms
        flops += A.attention_flops([start + n], [n], H, D)
    floor = flops / ceil["matmul_flops"] * 1e3
    for route, total in totals.items():
        if total is not None:
            record(f"prefill P={prompt} chunk {chunk} {route}: sum, 1 layer", {"ms": total, "p20": total, "p80": total},
                   floor, flops=flops, TFLOPs=flops / total / 1e9, model_ms_36_layers=total * LAYERS)


# -- elementwise -------------------------------------------------------------------------------------

def attempt(fn):
    """fn() -> ms, or None when it cannot run here (e.g. a twin that cannot be graph-captured)."""
    try:
        return fn()["ms"]
    except Exception as exc:
        print(f"    (not timed: {repr(exc)[:120]})")
        return None


@guarded
def elementwise(ceil: dict) -> None:
    """Each kernel against its torch twin: T=1 as 50 calls in a CUDA graph (launch-bound, as in a
    decode step), T=4096 as single calls after an L2 flush."""
    from engine.layers.activation import SiluAndMul
    from engine.layers.norm import RMSNorm
    from engine.layers.rotary import RotaryEmbedding
    bw = ceil["copy_Bps"]
    norm = RMSNorm(HIDDEN).to(DEV, torch.bfloat16)
    norm.weight.data.copy_(torch.rand(HIDDEN) + 0.5)
    w = norm.weight
    rot = RotaryEmbedding(D, 40960, 1e6).to(DEV)
    qn = RMSNorm(D).to(DEV, torch.bfloat16)
    kn = RMSNorm(D).to(DEV, torch.bfloat16)
    for T in (1, sz(4096)):
        def time_it(f, eager_only=False):
            if T == 1 and not eager_only:
                return bench_graph(lambda: [f() for _ in range(50)], calls=50)
            return bench(f)

        def row(name, ours, nbytes, ref=None, eager_ref=False):
            o = time_it(ours)
            record(name, o, nbytes / bw * 1e3, bytes=nbytes, TBps=nbytes / o["ms"] / 1e9,
                   ref_ms=attempt(lambda: time_it(ref, eager_ref)) if ref is not None else None)

        x = torch.randn(T, HIDDEN, dtype=torch.bfloat16, device=DEV)
        r = torch.randn_like(x)
        guarded(row)(f"rms_norm+residual T={T}", lambda: fused.rms_norm(x, w, 1e-6, r), 5 * x.numel() * 2,
                     lambda: norm(x, r))
        qkv = torch.randn(T, (H + 2 * KVH) * D, dtype=torch.bfloat16, device=DEV)
        qq, kk, vv = (t.view(T, -1, D) for t in qkv.split([H * D, KVH * D, KVH * D], -1))
        pos = torch.randint(0, 40960, (T,), device=DEV)
        nbytes = 2 * (H + KVH) * D * 2 * T
        guarded(row)(f"qk_norm_rope T={T}", lambda: fused.qk_norm_rope(qq, kk, qn.weight, kn.weight, 1e-6,
                                                                        rot.cos_sin, pos),
                     nbytes, lambda: rot(pos, qn(qq), kn(kk)))
        kvs, _ = make_pool(1, [T + 16], 16, torch.bfloat16, 5)
        kv8, _ = make_pool(1, [T + 16], 16, torch.int8, 6)
        slots = torch.randperm(T + 16, device=DEV)[:T]
        guarded(row)(f"qk_norm_rope+write_kv T={T}", lambda: fused.qk_norm_rope(
            qq, kk, qn.weight, kn.weight, 1e-6, rot.cos_sin, pos, kv=kvs[0], v=vv, slot_mapping=slots),
            nbytes + 3 * KVH * D * 2 * T)
        nbytes = 2 * 2 * KVH * D * 2 * T
        guarded(row)(f"write_kv bf16 T={T}", lambda: A.write_kv(kvs[0], kk, vv, slots), nbytes,
                     lambda: write_kv_reference(kvs[0], kk, vv, slots), eager_ref=True)
        guarded(row)(f"write_kv int8 T={T}", lambda: A.write_kv(kv8[0], kk, vv, slots), nbytes * 3 // 4 + 8 * KVH * T,
                     lambda: write_kv_reference(kv8[0], kk, vv, slots), eager_ref=True)
        gu = torch.randn(T, 2 * FFN, dtype=torch.bfloat16, device=DEV)
        guarded(row)(f"silu_and_mul T={T}", lambda: fused.silu_and_mul(gu), 3 * T * FFN * 2, lambda: SiluAndMul()(gu))


# -- main ----------------------------------------------------------------------------------------------

def run_tests(out_dir: Path | None) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", str(ROOT / "tests/engine/kernels/attention/test_paged_gpu.py")]
    try:
        import xdist  # noqa: F401
        cmd += ["-n", "4"]
    except ImportError:
        pass
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    log = p.stdout + p.stderr
    if out_dir:
        (out_dir / "pytest.log").write_text(log)
    lines = [line for line in log.splitlines() if line.strip()]
    print("\n".join(lines[-25:]), flush=True)
    return {"returncode": p.returncode, "summary": lines[-1] if lines else "", "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: check that the script runs")
    args = ap.parse_args()
    global SHRINK, LAYERS
    if args.smoke:
        SHRINK, LAYERS = 256, 2
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    started = time.perf_counter()
    import triton
    props = torch.cuda.get_device_properties(0)
    info = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True).stdout.strip()
    except OSError:
        pass
    print(info, flush=True)
    tests = {"skipped": True} if args.skip_tests else run_tests(out_dir)
    ceil = ceilings()

    C = A.AttnConfig
    sweep = not args.no_sweep
    # AttnConfig(block_m, block_n, num_warps, num_stages, num_splits, min_tiles); defaults in A.DECODE/A.PREFILL
    dec_sweeps = {
        512: {"min_tiles1": C(16, 64, 4, 3, 64, 1), "min_tiles4": C(16, 64, 4, 3, 64, 4),
              "splits16": C(16, 64, 4, 3, 16, 2)},
        8192: {"min_tiles1": C(16, 64, 4, 3, 64, 1), "min_tiles4": C(16, 64, 4, 3, 64, 4),
               "bn128 min1": C(16, 128, 4, 3, 64, 1), "splits32": C(16, 64, 4, 3, 32, 2)},
        32768: {"bn128": C(16, 128, 4, 3, 64, 2), "bn64 s2": C(16, 64, 4, 2, 64, 2), "bn64 s4": C(16, 64, 4, 4, 64, 2),
                "bn32 s4": C(16, 32, 4, 4, 64, 4), "splits32": C(16, 64, 4, 3, 32, 2),
                "splits128": C(16, 64, 4, 3, 128, 2)},
    } if sweep else {}
    pre_cfgs = {
        "bn128 w8 s2": C(128, 128, 8, 2), "bn128 w8 s3": C(128, 128, 8, 3), "bn64 w8 s2": C(128, 64, 8, 2),
        "bn64 w8 s4": C(128, 64, 8, 4), "bm64 bn64 w4 s3": C(64, 64, 4, 3),
    } if sweep else None
    print("attention (qwen3-8b shapes, one layer unless noted):", flush=True)
    for ctxlen in (512, 8192, 32768, 131072):
        attention_case(f"decode b1 ctx{ctxlen}", ceil, [1], [ctxlen], configs=dec_sweeps.get(ctxlen),
                       step_graph=ctxlen <= 32768)
    attention_case("decode b1 ctx32768 int8", ceil, [1], [32768], kv_dtype=torch.int8, step_graph=True, peer=False)
    attention_case("decode b1 ctx131072 int8", ceil, [1], [131072], kv_dtype=torch.int8, peer=False, reference=False)
    attention_case("decode b1 ctx32768 page64", ceil, [1], [32768], page=64, peer=False, reference=False)
    attention_case("decode b8 ctx8192", ceil, [1] * 8, [8192] * 8, step_graph=True)
    attention_case("verify q4 b1 ctx8192", ceil, [4], [8192], step_graph=True)
    attention_case("verify q4 b8 ctx8192", ceil, [4] * 8, [8192] * 8, peer=False)
    attention_case("prefill chunk4096 ctx0", ceil, [4096], [4096], configs=pre_cfgs)
    attention_case("prefill chunk4096 after 28k", ceil, [4096], [32768], configs=pre_cfgs)
    attention_case("prefill chunk4096 after 28k int8", ceil, [4096], [32768], kv_dtype=torch.int8, peer=False,
                   reference=False)
    attention_case("prefill chunk4096 after 28k page64", ceil, [4096], [32768], page=64, peer=False, reference=False)
    guarded(prefill_total)(ceil, 4096, 4096)
    guarded(prefill_total)(ceil, 32768, 4096)
    print("elementwise:", flush=True)
    elementwise(ceil)
    print("peers (torch SDPA on contiguous K/V):", flush=True)
    run_peers()

    seconds = time.perf_counter() - started
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "kernels.json").write_text(json.dumps(
            {"info": info, "tests": tests, "ceilings": ceil, "results": RESULTS, "seconds": seconds}, indent=1))
    print(f"\n=== kernels on {info['device']} (torch {info['torch']}, triton {info['triton']}), {seconds:.0f} s ===")
    print(f"tests: {tests.get('summary', 'skipped')}")
    print(f"copy {ceil['copy_Bps'] / 1e12:.3f} TB/s, matmul {ceil['matmul_flops'] / 1e12:.0f} TFLOP/s")
    print(f"{'case':52s} {'ours ms':>9s} {'floor':>8s} {'of fl':>5s} {'ref ms':>8s} {'peer ms':>8s} {'peer':6s} "
          f"{'TB/s':>5s} {'TF/s':>5s}")
    for r in RESULTS:
        if "error" in r:
            print(f"{r['name']:52s} {r['error'][:60]}")
            continue
        f = lambda k, fmt: format(r[k], fmt) if r.get(k) is not None else "-"      # noqa: E731
        print(f"{r['name'][:52]:52s} {r['ours_ms']:9.4f} {r['floor_ms']:8.4f} {r['of_floor']:5.2f} "
              f"{f('ref_ms', '8.3f'):>8s} {f('peer_ms', '8.4f'):>8s} {(r.get('peer') or '-')[:6]:6s} "
              f"{f('TBps', '5.2f'):>5s} {f('TFLOPs', '5.0f'):>5s}")


if __name__ == "__main__":
    main()
