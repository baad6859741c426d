"""Check and time the in-process TP communicators on a machine with two (or more) GPUs.

    PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        python3 tools/dev/comm_check.py [--devices 0,1]

In one run (about a minute): how the GPUs are linked (nvidia-smi topo -m); NCCL and the one-shot
P2P all-reduce checked against a reference (one thread per rank, eager calls back to back of
varying sizes, a dependent chain of 200 calls, per-rank CUDA graphs replayed with new inputs,
all_gather); then microseconds per all-reduce of 8-64 KB bf16, eager and inside CUDA graphs
(a graph of 100 back-to-back all-reduces per rank, replayed, timed with CUDA events); the
floor of a graph node; peer copy bandwidth. A compact table comes last; everything goes to
$OUT/comm.json when OUT is set (rewritten after each phase, so a crash keeps what was done).

The check helpers are reused by tests/engine/distributed/test_communicators_multi_gpu.py.
"""

import os

# NVLink multicast must stay off on the lent machines (it can take the host's GPUs down):
# set before torch, CuPy or NCCL are imported, also when this module is imported by the tests.
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NVLS_OFF)

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.worker.cuda_graphs import capture_graph  # noqa: E402  (no cache flush: see its docstring)
from engine.distributed.cuda_communicator import (MAX_RANKS, NcclCommunicator, P2PCommunicator,  # noqa: E402
                                  make_communicator)

# Element counts: 1 element, 4 KB and 8 KB of bf16, decode shapes (hidden 5120; 4 rows x 3
# tokens), 64 KB, the P2P limit (512 KB of bf16) and one past it, 1 MB, odd counts.
CHECK_SIZES = (1, 3, 2048, 4096, 4097, 5120, 12345, 4 * 3 * 5120, 32768, 262144, 262145, 524288)
# decode all-reduces (8-64 KB), gathered logits of one verify row set (1216 KB), prefill chunks (4-32 MB)
TIME_KB = (8, 16, 32, 64, 256, 1216, 4096, 32768)


def assert_nvls_off() -> None:
    wrong = {k: os.environ.get(k) for k, v in NVLS_OFF.items() if os.environ.get(k) != v}
    if wrong:
        raise SystemExit(f"NVLink multicast variables not set as required: {wrong}")


# ---------------------------------------------------------------------------------------------
# running one thread per rank

def run_ranks(devices: list[int], fn, timeout: float = 120.0) -> list:
    """fn(rank, barrier) in one thread per rank with its device current; results in rank order."""
    n = len(devices)
    results, errors = [None] * n, []
    barrier = threading.Barrier(n)

    def body(r):
        try:
            torch.cuda.set_device(devices[r])
            results[r] = fn(r, barrier)
        except BaseException as e:            # noqa: BLE001 - reported to the caller below
            errors.append((r, e, traceback.format_exc()))
            barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"rank{r}") for r in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"rank threads still running after {timeout:.0f} s (a collective hangs?)")
    if errors:
        errors.sort(key=lambda e: isinstance(e[1], threading.BrokenBarrierError))
        r, e, tb = errors[0]
        raise RuntimeError(f"rank {r} failed: {e!r}\n{tb}") from e
    return results


def _random(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, generator=gen, dtype=torch.float32).to(dtype)


def reference_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """Sum in rank order in fp32, rounded once: what the P2P kernel computes, bit for bit."""
    total = parts[0].float().clone()
    for p in parts[1:]:
        total += p.float()
    return total.to(parts[0].dtype)


def _compare(out: list[torch.Tensor], ref: torch.Tensor, exact: bool) -> dict:
    ranks_equal = all(torch.equal(o, out[0]) for o in out[1:])
    err = max(float((o.double() - ref.double()).abs().max()) if o.numel() else 0.0 for o in out)
    scale = float(ref.double().abs().max()) if ref.numel() else 0.0
    tol = 0.0 if exact else (1e-2 if ref.dtype in (torch.bfloat16, torch.float16) else 1e-5) * max(scale, 1.0)
    finite = all(bool(torch.isfinite(o).all()) for o in out)
    return {"ok": ranks_equal and finite and err <= tol, "ranks_equal": ranks_equal, "max_abs_err": err,
            "tolerance": tol}


def _exact(comm, numel: int, dtype: torch.dtype) -> bool:
    # The one-shot kernel sums in rank order in fp32: exact against reference_sum. NCCL (also the
    # P2P communicator's fallback above max_bytes) adds in its own order: within a tolerance.
    return isinstance(comm, P2PCommunicator) and numel * dtype.itemsize <= comm.max_bytes


# ---------------------------------------------------------------------------------------------
# correctness checks; each returns a list of records {"check", ..., "ok"}

def check_all_reduce_eager(comm, dtype=torch.bfloat16, sizes=CHECK_SIZES, rounds: int = 2, seed: int = 0):
    """Calls of varying sizes back to back from every rank's thread with no host sync between
    them (buffer reuse, changing grids); also a misaligned view (with guard elements around it)
    and a strided view."""
    world, gen = comm.world_size, torch.Generator().manual_seed(seed)
    plan = []                                          # (size, layout)
    for k in range(rounds):
        order = list(sizes) if k % 2 == 0 else list(reversed(sizes))
        plan += [(n, "contiguous") for n in order]
    plan += [(4096, "offset"), (32768, "offset"), (4097, "offset"), (4096, "strided")]
    inputs = [[_random(n, dtype, gen) for _ in range(world)] for n, _ in plan]
    guard = torch.tensor([12288.0], dtype=dtype)

    def body(rank, barrier):
        dev = comm.devices[rank]
        staged = []
        for (n, layout), parts in zip(plan, inputs):
            src = parts[rank].to(dev, copy=True)
            if layout == "offset":                     # one element in: misaligned for 16-byte loads
                buf = torch.cat([guard, parts[rank], guard]).to(dev)
                staged.append((buf, buf[1:1 + n]))
            elif layout == "strided":
                buf = torch.zeros(n, 2, dtype=dtype, device=dev)
                buf[:, 0] = src
                staged.append((buf, buf[:, 0]))
            else:
                staged.append((src, src))
        torch.cuda.synchronize()
        barrier.wait(60)
        for _, x in staged:
            comm.all_reduce(rank, x)
        torch.cuda.synchronize()
        return [(buf.cpu(), x.cpu()) for buf, x in staged]

    outs = run_ranks(comm.devices, body)
    records = []
    for i, ((n, layout), parts) in enumerate(zip(plan, inputs)):
        rec = _compare([outs[r][i][1] for r in range(world)], reference_sum(parts), _exact(comm, n, dtype))
        if layout == "offset":
            guards_ok = all(bool(outs[r][i][0][0] == guard[0]) and bool(outs[r][i][0][-1] == guard[0])
                            for r in range(world))
            rec["ok"] = rec["ok"] and guards_ok
            rec["guards_ok"] = guards_ok
        records.append({"check": "all_reduce eager", "comm": comm.kind, "dtype": str(dtype)[6:],
                        "numel": n, "layout": layout, **rec})
    return records


def _chain_input(y: torch.Tensor, noise: torch.Tensor, rank: int) -> torch.Tensor:
    return y + noise if rank == 0 else (y - y) + noise


def check_chain(comm, dtype=torch.bfloat16, sizes=(4096, 32768), steps: int = 200, seed: int = 1):
    """y <- all_reduce(z_rank) with z_0 = y + noise_0, z_r = (y - y) + noise_r: repeated,
    alternating sizes, no host sync. Every rank's input depends on its last output (a bounded
    random walk), so a stale read of a reused buffer changes the result."""
    world, gen = comm.world_size, torch.Generator().manual_seed(seed)
    starts = [_random(n, dtype, gen) for n in sizes]
    noise = [[_random(sizes[k % len(sizes)], dtype, gen) * 0.1 for _ in range(world)] for k in range(steps)]

    def body(rank, barrier):
        dev = comm.devices[rank]
        ys = [s.to(dev) for s in starts]
        nz = [parts[rank].to(dev) for parts in noise]
        torch.cuda.synchronize()
        barrier.wait(60)
        for k in range(steps):
            j = k % len(sizes)
            ys[j] = comm.all_reduce(rank, _chain_input(ys[j], nz[k], rank))
        torch.cuda.synchronize()
        return [y.cpu() for y in ys]

    outs = run_ranks(comm.devices, body)
    ys = list(starts)
    for k in range(steps):
        j = k % len(sizes)
        ys[j] = reference_sum([_chain_input(ys[j], noise[k][r], r) for r in range(world)])
    return [{"check": "all_reduce chain", "comm": comm.kind, "dtype": str(dtype)[6:], "numel": n,
             "steps": steps, **_compare([outs[r][j] for r in range(world)], ys[j], _exact(comm, n, dtype))}
            for j, n in enumerate(sizes)]


def check_graph(comm, dtype=torch.bfloat16, sizes=(1, 4096, 4097, 32768, 262144, 524288),
                replays: int = 4, seed: int = 2):
    """Each rank's thread captures one graph (all-reduces of several sizes and one all_gather),
    then replays it after copying new inputs into the static buffers: the outputs must follow."""
    world, gen = comm.world_size, torch.Generator().manual_seed(seed)
    gather_shape = (3, 256)
    inputs = [[[_random(n, dtype, gen) for n in sizes] + [_random(768, dtype, gen).view(gather_shape)]
               for _ in range(world)] for _ in range(replays)]

    def body(rank, barrier):
        dev = comm.devices[rank]
        fresh = [[t.to(dev) for t in per_rank[rank]] for per_rank in inputs]
        static = [t.clone() for t in fresh[0]]
        torch.cuda.synchronize()
        barrier.wait(60)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):                                  # warm-up, as before any capture
                for t in static[:-1]:
                    comm.all_reduce(rank, t)
                comm.all_gather(rank, static[-1])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        def record():
            for t in static[:-1]:
                comm.all_reduce(rank, t)
            return comm.all_gather(rank, static[-1])
        barrier.wait(60)                                        # every rank captures at once
        gathered = capture_graph(graph, record, mode="thread_local")
        results = []
        for it in range(replays):
            for s, f in zip(static, fresh[it]):
                s.copy_(f)
            graph.replay()
            results.append([t.clone() for t in static[:-1]] + [gathered.clone()])
        torch.cuda.synchronize()
        return [[t.cpu() for t in res] for res in results]

    outs = run_ranks(comm.devices, body)
    records = []
    for it in range(replays):
        for j, n in enumerate(sizes):
            ref = reference_sum([inputs[it][r][j] for r in range(world)])
            rec = _compare([outs[r][it][j] for r in range(world)], ref, _exact(comm, n, dtype))
            records.append({"check": "all_reduce graph", "comm": comm.kind, "dtype": str(dtype)[6:],
                            "numel": n, "replay": it, **rec})
        ref = torch.cat([inputs[it][r][-1] for r in range(world)], dim=-1)
        rec = _compare([outs[r][it][-1] for r in range(world)], ref, exact=True)
        records.append({"check": "all_gather graph", "comm": comm.kind, "dtype": str(dtype)[6:],
                        "shape": list(gather_shape), "replay": it, **rec})
    return records


def check_all_gather(comm, dtype=torch.bfloat16, shapes=((1, 7), (3, 4096), (5,), (2, 3, 5), (4, 75968)),
                     seed: int = 3):
    world, gen = comm.world_size, torch.Generator().manual_seed(seed)
    inputs = [[_random(int(torch.Size(s).numel()), dtype, gen).view(s) for _ in range(world)] for s in shapes]

    def body(rank, barrier):
        xs = [parts[rank].to(comm.devices[rank]) for parts in inputs]
        outs = [comm.all_gather(rank, x) for x in xs]
        torch.cuda.synchronize()
        return [o.cpu() for o in outs]

    outs = run_ranks(comm.devices, body)
    records = []
    for i, s in enumerate(shapes):
        ref = torch.cat(inputs[i], dim=-1)
        got = [outs[r][i] for r in range(world)]
        rec = _compare(got, ref, exact=True) if all(g.shape == ref.shape for g in got) else {"ok": False}
        records.append({"check": "all_gather eager", "comm": comm.kind, "dtype": str(dtype)[6:],
                        "shape": list(s), **rec})
    return records


def run_checks(comm) -> list[dict]:
    records = []
    records += check_all_reduce_eager(comm, torch.bfloat16)
    records += check_all_reduce_eager(comm, torch.float32, sizes=(1, 4096, 4097, 65536, 131072, 131073))
    records += check_all_reduce_eager(comm, torch.float16, sizes=(7, 4096, 32768), rounds=1)
    records += check_chain(comm)
    records += check_graph(comm)
    records += check_graph(comm, torch.float32, sizes=(5, 2048, 65536), replays=2)
    records += check_all_gather(comm)
    return records


# ---------------------------------------------------------------------------------------------
# timing

def time_eager(comm, kb: int, calls: int = 100, repeats: int = 7) -> dict:
    """Back-to-back all-reduces from every rank's thread (each Python call launches one);
    CUDA events around `calls` of them; median over repeats of the slowest rank."""
    n = kb * 1024 // 2

    def body(rank, barrier):
        gen = torch.Generator().manual_seed(rank)
        pristine = _random(n, torch.bfloat16, gen).to(comm.devices[rank])
        x = pristine.clone()
        for _ in range(10):
            comm.all_reduce(rank, x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        gpu_us, host_us = [], []
        for _ in range(repeats):
            x.copy_(pristine)                          # 100 doublings stay finite in bf16
            torch.cuda.synchronize()
            barrier.wait(60)
            t0 = time.perf_counter()
            start.record()
            for _ in range(calls):
                comm.all_reduce(rank, x)
            end.record()
            t1 = time.perf_counter()
            end.synchronize()
            gpu_us.append(start.elapsed_time(end) * 1000 / calls)
            host_us.append((t1 - t0) * 1e6 / calls)
        return gpu_us, host_us

    per_rank = run_ranks(comm.devices, body)
    us = [max(r[0][i] for r in per_rank) for i in range(repeats)]
    host = [max(r[1][i] for r in per_rank) for i in range(repeats)]
    return {"us": statistics.median(us), "us_all": us, "host_us": statistics.median(host)}


def _capture(fn, barrier: threading.Barrier | None = None, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """Warm up on a side stream, then capture; with a barrier every rank captures at the same time."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if barrier is not None:
        barrier.wait(60)
    capture_graph(graph, fn, mode="thread_local")
    return graph


def _wait(devices: list[int], timeout_s: float) -> None:
    """Wait for every device's current stream, or raise: a collective that never completes inside
    a replayed graph must not hang the check (the GPU stays busy; later phases may fail)."""
    events = []
    for d in devices:
        with torch.cuda.device(d):
            events.append(torch.cuda.current_stream().record_event())
    deadline = time.monotonic() + timeout_s
    while not all(e.query() for e in events):
        if time.monotonic() > deadline:
            raise TimeoutError(f"graph replay did not finish in {timeout_s:.0f} s (a collective hangs in the graph)")
        time.sleep(1e-4)


def time_graph(comm, kb: int, ops: int = 100, replays: int = 20) -> dict:
    """Each rank's thread captures a graph of `ops` all-reduces of one buffer (all ranks capture at
    once); the main thread replays all ranks' graphs back to back and times each with CUDA events.
    The rank launched first also waits for the later launch; the last-launched rank's time is the
    clean one, so take the minimum over ranks, then the median over replays."""
    n = kb * 1024 // 2

    def body(rank, barrier):
        gen = torch.Generator().manual_seed(rank)
        pristine = _random(n, torch.bfloat16, gen).to(comm.devices[rank])
        x = pristine.clone()

        def many():
            for _ in range(ops):
                comm.all_reduce(rank, x)
        return _capture(many, barrier), x, pristine

    us = replay_us(comm.devices, run_ranks(comm.devices, body), ops, replays)
    return {"us": statistics.median(us), "us_all": us, "ops_per_graph": ops}


def replay_us(devices: list[int], captured: list[tuple], ops: int, replays: int) -> list[float]:
    """µs per op of each replay of every rank's graph of `ops` calls (captured: (graph, buffer, its
    pristine copy) per device, the buffer reset before each replay), launched back to back from this
    thread. The rank launched first also waits for the later launches, so each replay counts the
    minimum over ranks; the first two replays (they upload the graphs) are dropped."""
    us = []
    for _ in range(replays + 2):
        for d, (_graph, x, pristine) in zip(devices, captured):
            with torch.cuda.device(d):
                x.copy_(pristine)
        _wait(devices, 30)
        events = []
        for d, (graph, _x, _pristine) in zip(devices, captured):
            with torch.cuda.device(d):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                events.append((start, end))
        _wait(devices, 30)
        us.append(min(s.elapsed_time(e) for s, e in events) * 1000 / ops)
    return us[2:]


def graph_us(fn, ops: int, replays: int) -> float:
    """Median µs per call of `fn` in a graph of `ops` calls on the current device (first two replays dropped)."""
    graph = _capture(lambda: [fn() for _ in range(ops)])
    us = []
    for _ in range(replays + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        us.append(start.elapsed_time(end) * 1000 / ops)
    return statistics.median(us[2:])


def time_graph_floor(device: int, ops: int = 100, replays: int = 20) -> float:
    """Microseconds per tiny kernel (in-place add on 8 KB) in a graph: the cost of a graph node."""
    with torch.cuda.device(device):
        x = torch.randn(4096, device=f"cuda:{device}").to(torch.bfloat16)
        return graph_us(lambda: x.add_(1.0), ops, replays)


def peer_copy_bandwidth(devices: list[int], mib: int = 256, iters: int = 10) -> dict:
    """GB/s of torch copies between two devices' memories (bytes moved once), each way and both
    ways at once (one thread per direction)."""
    a, b = devices[0], devices[1]
    n = mib << 20
    src = {d: torch.randint(0, 255, (n,), dtype=torch.uint8, device=f"cuda:{d}") for d in (a, b)}
    dst = {d: torch.empty(n, dtype=torch.uint8, device=f"cuda:{d}") for d in (a, b)}

    def one_way(s, t):
        dst[t].copy_(src[s])
        torch.cuda.synchronize(s)
        torch.cuda.synchronize(t)
        t0 = time.perf_counter()
        for _ in range(iters):
            dst[t].copy_(src[s])
        torch.cuda.synchronize(s)
        torch.cuda.synchronize(t)
        return n * iters / (time.perf_counter() - t0) / 1e9

    out = {f"{a}->{b}": one_way(a, b), f"{b}->{a}": one_way(b, a)}

    def both(rank, barrier):                           # rank r pulls into its own memory
        me, other = (b, a) if rank == 0 else (a, b)
        dst[me].copy_(src[other])
        torch.cuda.synchronize()
        barrier.wait(60)
        t0 = time.perf_counter()
        for _ in range(iters):
            dst[me].copy_(src[other])
        torch.cuda.synchronize()
        return t0, time.perf_counter()

    spans = run_ranks([b, a], both)
    out["both"] = 2 * n * iters / (max(s[1] for s in spans) - min(s[0] for s in spans)) / 1e9
    return out


# ---------------------------------------------------------------------------------------------

def _topology() -> str:
    if not shutil.which("nvidia-smi"):
        return "nvidia-smi not found"
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except Exception as e:  # noqa: BLE001
        return f"nvidia-smi topo -m failed: {e!r}"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=ROOT, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        return "?"


class Report:
    def __init__(self, path: Path | None):
        self.path = path
        self.data = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "commit": _commit(), "env": {k: os.environ.get(k) for k in NVLS_OFF},
                     "checks": [], "timings": [], "errors": []}

    def save(self) -> None:
        if self.path is not None:
            self.path.write_text(json.dumps(self.data, indent=1, default=str))

    def error(self, phase: str, e: BaseException) -> None:
        print(f"[{phase}] FAILED: {e!r}\n{traceback.format_exc()}", flush=True)
        self.data["errors"].append({"phase": phase, "error": repr(e)[:2000]})
        self.save()


def _phase(report: Report, name: str, fn):
    t0 = time.perf_counter()
    try:
        out = fn()
        print(f"[{name}] done in {time.perf_counter() - t0:.1f} s", flush=True)
        return out
    except Exception as e:  # noqa: BLE001 - every phase reports and the run goes on
        report.error(name, e)
        return None
    finally:
        report.save()


def _checks(report: Report, comm) -> bool:
    records = run_checks(comm)
    report.data["checks"] += records
    bad = [r for r in records if not r["ok"]]
    for r in bad[:10]:
        print("  FAILED", r, flush=True)
    print(f"  {comm.kind}: {len(records) - len(bad)} checks passed, {len(bad)} failed", flush=True)
    return not bad


def _timings(report: Report, comm, label: str, eager: bool = True, graph: bool = True, ops: int = 100,
             sizes=TIME_KB) -> None:
    for kb in sizes:
        modes = ((("eager", time_eager),) if eager else ()) + \
                ((("graph", lambda c, k: time_graph(c, k, ops=ops)),) if graph else ())
        for mode, fn in modes:
            r = fn(comm, kb)
            report.data["timings"].append({"comm": label, "mode": mode, "kb": kb, **r})
            print(f"  {label:10s} {mode:5s} {kb:4d} KB  {r['us']:8.2f} us", flush=True)


def _table(report: Report) -> str:
    t = {(x["comm"], x["mode"], x["kb"]): x["us"] for x in report.data["timings"]}
    cols = [(c, m) for c in ("nccl", "nccl/x100", "p2p", "p2p/x8", "p2p/t128") for m in ("eager", "graph") if any(
        k[:2] == (c, m) for k in t)]
    lines = ["all-reduce bf16, us per call (median; graph = 100 calls per replay, nccl graph: 8)",
             "size    " + "".join(f"{c + ' ' + m:>15s}" for c, m in cols)]
    for kb in TIME_KB:
        lines.append(f"{kb:4d} KB " + "".join(f"{t[(c, m, kb)]:15.2f}" if (c, m, kb) in t else f"{'-':>15s}"
                                           for c, m in cols))
    host = {x["comm"]: x["host_us"] for x in report.data["timings"] if x["mode"] == "eager" and x["kb"] == 8}
    if host:
        lines.append("eager 8 KB, host us per call (Python + launch, slowest rank): "
                     + ", ".join(f"{c} {v:.1f}" for c, v in host.items()))
    checks = report.data["checks"]
    for kind in ("nccl", "p2p"):
        mine = [c for c in checks if c["comm"] == kind]
        if mine:
            bad = [c for c in mine if not c["ok"]]
            worst = max((c.get("max_abs_err", 0.0) for c in mine), default=0.0)
            lines.append(f"checks {kind}: {len(mine) - len(bad)} passed, {len(bad)} failed, "
                         f"max abs err {worst:.3g}")
    if "graph_floor_us" in report.data:
        lines.append(f"graph node floor (tiny kernel): {report.data['graph_floor_us']:.2f} us")
    if "peer_copy_GBps" in report.data:
        lines.append("peer copy GB/s: " + ", ".join(f"{k} {v:.0f}" for k, v in report.data["peer_copy_GBps"].items()))
    if "p2p_kernels" in report.data:
        k = report.data["p2p_kernels"].get("ninfer_ar_bf16_vec", {})
        lines.append(f"p2p bf16 kernel: {k.get('num_regs')} registers, {k.get('local_size_bytes')} B local, "
                     f"sm_{k.get('binary_version')}")
    p2p, nccl = t.get(("p2p", "graph", 8)), t.get(("nccl", "graph", 8))
    if p2p is not None:
        lines.append(f"goal p2p graph 8 KB <= 6 us: {'MET' if p2p <= 6 else 'MISSED'} ({p2p:.2f} us)")
    if p2p is not None and nccl is not None:
        lines.append(f"default: {'p2p' if p2p < nccl else 'nccl'} (graph 8 KB: p2p {p2p:.2f} us, nccl {nccl:.2f} us)")
    for e in report.data["errors"]:
        lines.append(f"ERROR in {e['phase']}: {e['error'][:300]}")
    return "\n".join(lines)


def _auto_kind(devices: list[int]) -> str:
    comm = make_communicator("auto", devices, timeout_s=20.0)
    comm.close()
    return comm.kind


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="0,1", help="comma-separated CUDA device indices")
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop and report after this long")
    parser.add_argument("--skip-nccl", action="store_true",
                        help="no NCCL checks or timings (NCCL is still the P2P fallback above its size limit)")
    parser.add_argument("--p2p-max-bytes", type=int, default=None, help="P2P size limit (default: its own)")
    args = parser.parse_args()
    assert_nvls_off()
    out = os.environ.get("OUT")
    report = Report(Path(out) / "comm.json" if out else None)

    def watchdog():
        report.data["errors"].append({"phase": "watchdog", "error": f"over {args.budget_s:.0f} s; stopped"})
        report.save()
        print(_table(report), flush=True)
        os._exit(2)
    timer = threading.Timer(args.budget_s, watchdog)
    timer.daemon = True
    timer.start()

    topo = _topology()
    print(topo, flush=True)
    devices = [int(d) for d in args.devices.split(",")]
    report.data.update(topology=topo, devices=devices, torch=torch.__version__,
                       cuda_devices=torch.cuda.device_count())
    if torch.cuda.device_count() < max(2, max(devices) + 1):
        print(f"needs {max(2, max(devices) + 1)} CUDA devices, torch sees {torch.cuda.device_count()}")
        report.data["errors"].append({"phase": "setup", "error": "not enough CUDA devices"})
        report.save()
        return 1
    import cupy
    from cupy.cuda import nccl as cupy_nccl
    report.data.update(
        names=[torch.cuda.get_device_name(d) for d in devices], cupy=cupy.__version__,
        nccl=cupy_nccl.get_version() if getattr(cupy_nccl, "available", False) else None,
        can_access_peer={f"{i}->{j}": bool(cupy.cuda.runtime.deviceCanAccessPeer(i, j))
                         for i in devices for j in devices if i != j})
    print({k: report.data[k] for k in ("names", "torch", "cupy", "nccl", "can_access_peer")}, flush=True)

    nccl = _phase(report, "nccl init", lambda: NcclCommunicator(devices))
    floor = _phase(report, "graph floor", lambda: time_graph_floor(devices[0]))
    if floor is not None:
        report.data["graph_floor_us"] = floor
    bw = _phase(report, "peer copy", lambda: peer_copy_bandwidth(devices))
    if bw is not None:
        report.data["peer_copy_GBps"] = bw
    # The P2P kernel comes last: if a peer never signals, it traps after timeout_s and the
    # process loses its CUDA contexts; everything above is already saved.
    if nccl is not None and len(devices) <= MAX_RANKS:
        limit = {} if args.p2p_max_bytes is None else {"max_bytes": args.p2p_max_bytes}
        p2p = _phase(report, "p2p init", lambda: P2PCommunicator(devices, fallback=nccl, timeout_s=20.0, **limit))
        if p2p is not None:
            report.data["p2p_kernels"] = _phase(report, "p2p kernels", p2p.kernel_attributes) or {}
            ok = _phase(report, "p2p checks", lambda: _checks(report, p2p))
            if ok is not None:                  # wrong sums are still worth timing; a crash is not
                _phase(report, "p2p timings", lambda: _timings(report, p2p, "p2p"))
                _phase(report, "p2p graph x8", lambda: _timings(report, p2p, "p2p/x8", eager=False, ops=8,
                                                                sizes=(8, 64)))
                p128 = _phase(report, "p2p/t128 init", lambda: P2PCommunicator(
                    devices, fallback=nccl, threads=128, timeout_s=20.0, **limit))
                if p128 is not None:
                    _phase(report, "p2p/t128 timings", lambda: _timings(report, p128, "p2p/t128", eager=False))
    # NCCL last: a collective that never completes inside a capture hangs its rank threads
    if nccl is not None and not args.skip_nccl:
        ok = _phase(report, "nccl checks", lambda: _checks(report, nccl))
        graph_ok = ok is not None and all(c["ok"] for c in report.data["checks"]
                                          if c["comm"] == "nccl" and "graph" in c["check"])
        # 100 NCCL all-reduces in one graph hung on 2 x H200 (NCCL 2.28, CuPy 14.2): time graphs
        # of 8 first, then eager, then one try at 100 last
        _phase(report, "nccl graph timings", lambda: _timings(report, nccl, "nccl", eager=False, graph=graph_ok, ops=8))
        _phase(report, "nccl eager timings", lambda: _timings(report, nccl, "nccl", graph=False))
        report.data["auto"] = _phase(report, "auto", lambda: _auto_kind(devices))
        _phase(report, "nccl graph x100", lambda: _timings(report, nccl, "nccl/x100", eager=False, graph=graph_ok,
                                                           sizes=(8,)))
    timer.cancel()
    report.save()
    print("\n" + _table(report), flush=True)
    failed = [c for c in report.data["checks"] if not c["ok"]]
    return 1 if failed or report.data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
