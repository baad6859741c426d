"""Check and time the fused all-reduce + residual add + RMSNorm (engine.distributed.fused_allreduce) on 2 GPUs.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        python3 tools/dev/tp_fuse_check.py [--quick]

Correctness: every rank's outputs against `add_norm_reference` (the new residual bit for bit;
the normed output within two units of the last place: the row's sum of squares is added in another order than
torch's) and against the unfused engine ops (P2P all-reduce, then the RMSNorm layer), ranks
bitwise equal; eagerly (sizes back to back, plain all-reduces in between) and inside per-rank
CUDA graphs replayed with new inputs. Timing: µs per call inside a graph of `ops` calls per
rank, fused against unfused (all-reduce + Triton RMSNorm; for the zero-centred norm the torch
ops of ZeroCentredRMSNorm), for decode sizes. Writes $OUT/tp_fuse.json and prints a table.
The check helpers are reused by tests/engine/distributed/test_communicators_multi_gpu.py.
"""

import os

from tools.dev.comm_check import NVLS_OFF, _capture, replay_us, run_ranks  # noqa: F401  (sets NVLS_OFF first)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402

from engine.layers.hybrid_norm import ZeroCentredRMSNorm  # noqa: E402
from engine.layers.norm import RMSNorm  # noqa: E402
from engine.distributed.fused_allreduce import add_norm_reference  # noqa: E402

EPS = 1e-6


def _norm(hidden: int, zero_centred: bool, weight: torch.Tensor, device) -> torch.nn.Module:
    norm = (ZeroCentredRMSNorm if zero_centred else RMSNorm)(hidden, EPS).to(device=device, dtype=weight.dtype)
    norm.weight.data.copy_(weight)
    return norm


def _case(rows: int, hidden: int, dtype, world: int, gen: torch.Generator, zero_centred: bool):
    parts = [torch.randn(rows, hidden, generator=gen).to(dtype) for _ in range(world)]
    residual = (torch.randn(rows, hidden, generator=gen) * 4).to(dtype)
    w = torch.randn(hidden, generator=gen) * (0.1 if zero_centred else 1.0)
    return parts, residual, w.to(dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the dtype's last place at b's magnitude."""
    if a.numel() == 0:
        return 0.0
    eps = torch.finfo(a.dtype).eps
    scale = b.float().abs().clamp_min(torch.finfo(a.dtype).tiny) * eps
    return float(((a.float() - b.float()).abs() / scale).max())


def check_fused(comm, shapes, dtype=torch.bfloat16, zero_centred=False, graph=False, replays=3, seed=0):
    """Fused calls for each (rows, hidden) from every rank's thread, back to back (a plain
    all-reduce between them), eagerly or captured once per rank and replayed with new inputs.
    Records: residual exact, output within one rounding of the reference, ranks bitwise equal,
    and the unfused engine ops' output beside it."""
    world, gen = comm.world_size, torch.Generator().manual_seed(seed)
    n_iter = replays if graph else 1
    cases = [[_case(r, h, dtype, world, gen, zero_centred) for r, h in shapes] for _ in range(n_iter)]
    between = [[torch.randn(4099, generator=gen).to(dtype) for _ in range(world)] for _ in range(n_iter)]

    def body(rank, barrier):
        dev = comm.devices[rank]
        staged = [[(p[rank].to(dev), res.to(dev), w.to(dev)) for p, res, w in it] for it in cases]
        mid = [b[rank].to(dev) for b in between]

        def calls(inputs, extra):
            outs = []
            for x, res, w in inputs:
                got = comm.all_reduce_add_rms_norm(rank, x, res, w, EPS, zero_centred=zero_centred)
                assert got is not None, f"fused op refused {tuple(x.shape)} {x.dtype}"
                outs.append(got)
                comm.all_reduce(rank, extra)
            return outs

        if not graph:
            torch.cuda.synchronize()
            barrier.wait(60)
            outs = [calls(staged[0], mid[0])]
            # the unfused engine ops on the same inputs, for comparison
            unfused = []
            for x, res, w in staged[0]:
                y = comm.all_reduce(rank, x.clone())
                unfused.append(_norm(x.shape[-1], zero_centred, w, dev)(y, res))
            torch.cuda.synchronize()
            return [[(o.cpu(), r.cpu()) for o, r in outs[0]], [(o.cpu(), r.cpu()) for o, r in unfused], [mid[0].cpu()]]
        static = [tuple(t.clone() for t in trip) for trip in staged[0]]
        static_mid = mid[0].clone()
        torch.cuda.synchronize()
        barrier.wait(60)
        holder = {}

        def record():
            holder["outs"] = calls(static, static_mid)
        g = _capture(record, barrier)
        results = []
        for it in range(n_iter):
            for s, f in zip(static, staged[it]):
                for st, fr in zip(s, f):
                    st.copy_(fr)
            static_mid.copy_(mid[it])
            g.replay()
            results.append(([(o.clone(), r.clone()) for o, r in holder["outs"]], static_mid.clone()))
        torch.cuda.synchronize()
        return [[[(o.cpu(), r.cpu()) for o, r in outs], m.cpu()] for outs, m in results]

    got = run_ranks(comm.devices, body)
    records = []
    for it in range(n_iter):
        for j, (rows, hidden) in enumerate(shapes):
            parts, residual, w = cases[it][j]
            ref_out, ref_res = add_norm_reference(parts, residual, w, EPS, zero_centred)
            if graph:
                outs = [got[r][it][0][j] for r in range(world)]
            else:
                outs = [got[r][0][j] for r in range(world)]
            ranks_equal = all(torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1]) for o in outs)
            res_exact = all(torch.equal(o[1], ref_res) for o in outs)
            out_ulps = max(_ulps(o[0], ref_out) for o in outs)
            rec = {"check": "graph" if graph else "eager", "dtype": str(dtype)[6:], "zero_centred": zero_centred,
                   "rows": rows, "hidden": hidden, "replay": it, "ranks_equal": ranks_equal,
                   "residual_exact": res_exact, "out_max_ulps_vs_reference": out_ulps}
            if not graph:
                un_out, un_res = got[0][1][j]
                rec["unfused_residual_equal"] = bool(torch.equal(un_res, outs[0][1]))
                rec["out_max_ulps_vs_unfused"] = _ulps(outs[0][0], un_out)
            # bf16/fp16: one rounding either way of round(h * rstd); fp32: rstd's last bits (rsqrtf,
            # the order of the row's sum of squares) at ~1e-7 each
            max_ulps = 2.0 if dtype != torch.float32 else 16.0
            rec["ok"] = ranks_equal and res_exact and out_ulps <= max_ulps and all(
                bool(torch.isfinite(o[0]).all()) for o in outs)
            records.append(rec)
        # the plain all-reduce between the fused calls
        # summed once per shape, in place: after the first call every rank holds the same value,
        # so each further call multiplies by world (exact for a power of two)
        mid_ref = (sum(b.float() for b in between[it]).to(dtype).float() * world ** (len(shapes) - 1)).to(dtype)
        mids = [got[r][it][1] if graph else got[r][2][0] for r in range(world)]
        records.append({"check": "graph" if graph else "eager", "plain_all_reduce_between": True,
                        "ok": all(torch.equal(m, mid_ref) for m in mids)})
    return records


def time_fused(comm, rows: int, hidden: int, variant: str, ops: int = 50, replays: int = 10,
               dtype=torch.bfloat16) -> float:
    """µs per call in a graph of `ops` calls per rank (all ranks captured at once, replayed back to
    back from this thread; min over ranks, median over replays). variant: fused, fused-zc,
    unfused (P2P all-reduce + Triton RMSNorm), unfused-zc (P2P all-reduce + ZeroCentredRMSNorm)."""
    zero_centred = variant.endswith("-zc")

    def body(rank, barrier):
        dev = comm.devices[rank]
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(rows, hidden, generator=gen).to(dtype).to(dev) * 1e-3
        pristine = x.clone()
        res = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(7)).to(dtype).to(dev)
        norm = _norm(hidden, zero_centred, torch.ones(hidden, dtype=dtype), dev)

        def many():
            for _ in range(ops):
                if variant.startswith("fused"):
                    comm.all_reduce_add_rms_norm(rank, x, res, norm.weight, EPS, zero_centred=zero_centred)
                else:
                    norm(comm.all_reduce(rank, x), res)
        return _capture(many, barrier), x, pristine

    return statistics.median(replay_us(comm.devices, run_ranks(comm.devices, body), ops, replays))


def time_eager(comm, rows: int, hidden: int, variant: str, fast: bool, calls: int = 100, repeats: int = 5,
               dtype=torch.bfloat16) -> dict:
    """Host µs per call (and GPU µs per call) of `calls` eager calls back to back from both rank
    threads at once, as the engine's eager TP path makes them; max over ranks, median over repeats.
    variant: plain (the all-reduce alone), fused, unfused (all-reduce + Triton RMSNorm)."""
    import time
    saved = comm.fast_launch
    comm.fast_launch = fast

    def body(rank, barrier):
        dev = comm.devices[rank]
        x = (torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rank)) * 1e-3).to(dtype).to(dev)
        res = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(7)).to(dtype).to(dev)
        norm = _norm(hidden, False, torch.ones(hidden, dtype=dtype), dev)

        def one():
            if variant == "plain":
                comm.all_reduce(rank, x)
            elif variant == "fused":
                comm.all_reduce_add_rms_norm(rank, x, res, norm.weight, EPS)
            else:
                norm(comm.all_reduce(rank, x), res)
        for _ in range(5):
            one()
        host, gpu = [], []
        for _ in range(repeats):
            x.mul_(0)                                   # keep repeated doublings finite
            torch.cuda.synchronize()
            barrier.wait(60)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            for _ in range(calls):
                one()
            end.record()
            host.append((time.perf_counter() - t0) * 1e6 / calls)
            end.synchronize()
            gpu.append(start.elapsed_time(end) * 1000 / calls)
        return host, gpu

    try:
        per_rank = run_ranks(comm.devices, body)
    finally:
        comm.fast_launch = saved
    host = [max(r[0][i] for r in per_rank) for i in range(repeats)]
    gpu = [max(r[1][i] for r in per_rank) for i in range(repeats)]
    return {"host_us": statistics.median(host), "gpu_us": statistics.median(gpu)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from engine.distributed.cuda_communicator import NcclCommunicator, P2PCommunicator
    nccl = NcclCommunicator([0, 1])
    comm = P2PCommunicator([0, 1], fallback=nccl, max_bytes=64 << 20, timeout_s=20.0)
    out = {"kernel_attributes": comm.kernel_attributes(), "checks": [], "timings": []}
    shapes = [(1, 4096), (3, 5120), (8, 4096), (64, 5120), (65, 4096), (1, 2048), (512, 4096)]
    for zc in (False, True):
        out["checks"] += check_fused(comm, shapes, zero_centred=zc)
        out["checks"] += check_fused(comm, shapes[:5], zero_centred=zc, graph=True)
    out["checks"] += check_fused(comm, [(2, 4096), (7, 1024)], dtype=torch.float32)
    out["checks"] += check_fused(comm, [(2, 4096)], dtype=torch.float16, zero_centred=True)
    comm.fast_launch = False                                    # CuPy's generic launch path too
    out["checks"] += check_fused(comm, shapes[:3])
    comm.fast_launch = True
    def save():                                                 # after each phase: a cut run keeps its part
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "tp_fuse.json"), "w") as f:
                json.dump(out, f, indent=1)
    save()
    bad = [c for c in out["checks"] if not c["ok"]]
    print(f"checks: {len(out['checks'])} run, {len(bad)} failed")
    for c in bad[:10]:
        print("  FAILED", c)
    worst = max((c.get("out_max_ulps_vs_unfused", 0.0) for c in out["checks"]), default=0.0)
    print(f"largest output difference to the unfused ops: {worst:.2f} ulp")

    tokens = (1, 8, 64) if args.quick else (1, 2, 4, 8, 16, 32, 64)
    print(f"\n{'tokens':>6} {'hidden':>6} {'KB':>6} | {'unfused':>8} {'fused':>8} {'ratio':>6} | "
          f"{'unf-zc':>8} {'fused-zc':>8} {'ratio':>6}   (µs per call, graph of 50)")
    for hidden in (4096, 5120):
        for t in tokens:
            row = {"tokens": t, "hidden": hidden, "kb": t * hidden * 2 / 1024}
            for v in ("unfused", "fused", "unfused-zc", "fused-zc"):
                row[v] = time_fused(comm, t, hidden, v)
            out["timings"].append(row)
            save()
            print(f"{t:6d} {hidden:6d} {row['kb']:6.0f} | {row['unfused']:8.2f} {row['fused']:8.2f} "
                  f"{row['fused'] / row['unfused']:6.2f} | {row['unfused-zc']:8.2f} {row['fused-zc']:8.2f} "
                  f"{row['fused-zc'] / row['unfused-zc']:6.2f}")
    for t in (() if args.quick else (512, 4096)):
        row = {"tokens": t, "hidden": 4096, "kb": t * 4096 * 2 / 1024}
        for v in ("unfused", "fused"):
            row[v] = time_fused(comm, t, 4096, v, ops=10 if t <= 512 else 4, replays=6)
        out["timings"].append(row)
        print(f"{t:6d} {4096:6d} {row['kb']:6.0f} | {row['unfused']:8.2f} {row['fused']:8.2f} "
              f"{row['fused'] / row['unfused']:6.2f}")
    print("\neager, both rank threads at once (host µs per call / GPU µs per call):")
    out["eager"] = []
    for rows in ((1,) if args.quick else (1, 512)):
        for variant, fast in (("plain", False), ("plain", True), ("unfused", True), ("fused", True)):
            r = {"tokens": rows, "hidden": 4096, "variant": variant,
                 "launch": "ctypes" if fast else "cupy", **time_eager(comm, rows, 4096, variant, fast)}
            out["eager"].append(r)
            print(f"  {rows:4d} x 4096 {variant:8s} {r['launch']:6s} host {r['host_us']:7.1f}  gpu {r['gpu_us']:7.1f}")
    save()
    comm.close()
    nccl.close()
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
