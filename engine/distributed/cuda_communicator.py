"""Tensor-parallel communicators for one engine process that drives several GPUs itself.

Each rank's shard runs in its own Python thread on its own device (rank r on `devices[r]`); a
row-parallel layer calls `all_reduce(rank, x)` on its partial output, and so do the
vocabulary-parallel embedding and lm_head (zero-padded: `engine.layers.embedding`). `all_gather`
is there for other callers. Both work eagerly and inside a CUDA graph that the rank's thread
captures; every call uses the current torch stream of x's device.

`NcclCommunicator` -- NCCL through CuPy, one communicator per rank from `ncclCommInitAll`.

`P2PCommunicator` -- a one-shot all-reduce for the decode case (8-64 KB: one token, or a batch x
(k+1) tokens, of hidden 4096-5120 in bf16; and the zero-padded logits) that reads the peers' data
over NVLink; NCCL above its size limit and for all_gather. The one-shot idea (stage the input where every peer can read
it, publish an epoch in the peers' flag slots, each rank sums all inputs itself) is the one of
vLLM's custom all-reduce and TensorRT-LLM's one-shot all-reduce; this kernel is written anew.

Protocol of the one-shot kernel (rank r, one launch, `world` ranks, blocks b = 0..grid-1):

  device memory per rank:  stage[2][cap]                 its inputs, one half per call parity
                           flags[2][MAX_BLOCKS][MAX_RANKS]  u64 epochs written by the peers
                           state = {u64 epoch, u32 done}   epoch of the last finished call
  1. e = state.epoch + 1 (read on the device: a graph replays it unchanged), p = e % 2.
  2. Block b copies its slice of x into stage_r[p].
  3. __syncthreads; thread q (q != r) does __threadfence_system (release: the slice is visible
     system-wide before the flag), then a system-scope store of e into flags_q[p][b][r].
  4. Thread q spins (ld.relaxed.sys) until flags_r[p][b][q] == e, then fence.acq_rel.sys
     (acquire); __syncthreads.
  5. Every thread sums its elements of stage_0[p] .. stage_{world-1}[p] in rank order, in fp32,
     and writes x. All ranks add the same numbers in the same order: bitwise-equal results.
  6. The last block to finish (atomic counter) publishes state.epoch = e for the next launch.

  Why call e+2 cannot overwrite stage_s[p] while rank r still reads it for call e: rank s reaches
  call e+2 only after its call e+1 finished, and call e+1 on s needed rank r's flag for e+1 in at
  least block 0; r writes that flag inside its own call e+1, which starts only after r's call e
  kernel (all its reads of stage_s[p]) completed, because one rank's calls are ordered on its
  stream. The same chain protects the flag slots: s writes e+2 into flags_r[p][b][s] only after r
  has consumed e there, so waiting for equality is exact and flags never need resetting. The
  epoch is one per call (not per block), so calls of different sizes (grids) can follow each
  other: every rank makes the same calls in the same order with the same sizes, hence the same
  grid and slices, whatever the alignment of its own x (a misaligned x is copied first).

  `P2PCommunicator.all_reduce_add_rms_norm` runs a variant of this kernel (engine.distributed.fused_allreduce)
  that also adds the residual and applies the next RMSNorm, one block per row; it shares the
  stages, flags and epoch counter, so plain and fused calls may follow each other in any order.
  Kernels are launched through engine.distributed.p2p_launch (parameters packed once per rank).

  Requirements: peer access between all devices; one all_reduce at a time per rank, ordered on
  its stream (the model's layers are); every rank makes the same sequence of calls.
  A rank that waits longer than `timeout_s` for its peer traps (the CUDA context is lost) rather
  than hanging the process silently.

Using them from rank threads (both communicators): call torch.cuda.set_device(devices[rank]) at
the start of the thread; make at least one eager call per rank thread before capturing (CuPy
sets up its per-thread context on the first launch); capture with
`engine.worker.cuda_graphs.capture_graph(..., mode="thread_local")` -- in the default "global" mode the
other rank's allocations during the capture are errors -- on every rank's thread at the same time:
NCCL may talk to its peers while a collective is being captured, so a rank must not wait for
another's capture to end. (`torch.cuda.graph` synchronizes and empties the allocator's cache on
entry; that cudaFree can wait behind a peer's all-reduce kernel forever.) Replays may run
concurrently, or be launched one after the other from one thread.

Predictions for 2 x H200 (NV18), per all-reduce, median, before any measurement
(tools/dev/comm_check.py measures them):

  size (bf16)        NCCL eager   NCCL graph   P2P eager   P2P graph
  8 KB               ~20 us       ~8-10 us     ~12-18 us   ~4-5 us
  64 KB              ~22 us       ~10-12 us    ~12-18 us   ~5-6 us

  In a graph a P2P call is about: kernel-node launch ~1-1.5 us + stage and system fence ~0.5-1 us
  + flag one way over NVLink ~0.7-1 us + peer read round trip ~1-1.5 us + write; 64 KB adds
  ~0.2 us of NVLink transfer. Eagerly both communicators are bound by the Python launch path
  (two rank threads share the GIL), not by the link. The goal of issue #6 is <= 6 us for 8 KB
  in graphs. A push variant with flags inside the data words (NCCL's LL protocol) saves one more
  NVLink crossing and the system fence: engine.distributed.p2p_push, for 16-bit messages up to
  `push_max_bytes` (NINFER_P2P_PUSH_MAX_BYTES, default 64 KB; 0 turns it off).
"""

from __future__ import annotations

import numpy as np
import structlog
import torch

from engine import envs
from engine.distributed import p2p_push
from engine.distributed.p2p_launch import RankLaunch
from engine.distributed.tp_group import TPGroup
from engine.kernels.cuda_source import read_cuda_source
from engine.distributed.fused_allreduce import ADD_NORM_KERNEL_NAMES, ADD_NORM_SOURCE, add_norm_launch_shape

log = structlog.get_logger(__name__)

MAX_RANKS = 8
MAX_BLOCKS = 64
DEFAULT_P2P_MAX_BYTES = 512 * 1024          # larger all-reduces go to NCCL
# Up to this size a launch uses `small_threads` per block: on 2 x H200 in graphs, 128 threads took
# 5.41-5.71 us for 8-32 KB against 5.84-5.96 us with 512, and lost from 64 KB up (run 2, 2026-11-30).
SMALL_MESSAGE_BYTES = 32 * 1024
# The fused all-reduce + add + RMSNorm (engine.distributed.fused_allreduce) up to this size; larger ones run the
# unfused ops (the plain kernel or NCCL, then the norm kernel). None: up to max_bytes.
FUSED_MAX_BYTES: int | None = None
# The push variant (engine.distributed.p2p_push) for 16-bit messages up to this many bytes; 0: pull only. On the
# H200 pair it took a 27B hybrid TP=2 round from 9.94 to 9.63 ms (sync) and 9.45 to 9.20 (async), and a
# qwen3-8b TP=2 round from 3.81 to 3.63 (bench/results/2026-12-01-h200-fold/). The default, 64 KB, is the registry's
# (engine.envs.P2P_PUSH_MAX_BYTES).
_FLAG_BYTES = 2 * MAX_BLOCKS * MAX_RANKS * 8
_STATE_BYTES = 256
_NCCL_SUM = 0                                # ncclSum
# ncclDataType_t values (nccl.h); CuPy exports the same numbers as NCCL_* where it has them.
_NCCL_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4,
                torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
_P2P_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704

# Kernel arguments of one rank, passed by value; mirrors `struct RankArgs` below.
_ARGS_DTYPE = np.dtype([("stage", "<u8", (MAX_RANKS,)), ("flags", "<u8", (MAX_RANKS,)),
                        ("state", "<u8"), ("cap", "<u8"), ("timeout_ns", "<u8"),
                        ("rank", "<i4"), ("world", "<i4")])
assert _ARGS_DTYPE.itemsize == 160  # a layout constant of this file, checked again in the kernel

KERNEL_SOURCE = read_cuda_source(__file__, "one_shot_allreduce.cu", MAX_RANKS=MAX_RANKS, MAX_BLOCKS=MAX_BLOCKS)

KERNEL_NAMES = {(kind, vec): f"ninfer_ar_{kind}_{'vec' if vec else 'one'}"
                for kind in _P2P_DTYPES.values() for vec in (True, False)}


def _import_cupy():
    try:
        import cupy
    except ImportError as e:  # the CPU install has no CuPy; only these classes need it
        raise RuntimeError("the CUDA communicators need CuPy: pip install 'ninfer[gpu]' "
                           "(cupy-cuda13x)") from e
    return cupy


def _check_devices(devices, least: int) -> list[int]:
    devices = [int(d) for d in devices]
    if len(devices) < least:
        raise ValueError(f"needs at least {least} devices, got {devices}")
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices repeat: {devices}")
    visible = torch.cuda.device_count()
    missing = [d for d in devices if not 0 <= d < visible]
    if missing:
        raise ValueError(f"devices {missing} are not visible (torch sees {visible} CUDA devices)")
    for d in devices:                       # create the primary contexts before CuPy or NCCL use them
        torch.empty(1, device=f"cuda:{d}")
    return devices


class _Stream:
    """What CuPy's kernel launch reads from its `stream` argument: the raw handle as `.ptr`."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


def _launch(function, grid, block, args, stream) -> None:
    function(grid, block, args, stream=stream)


class _CudaCommunicator:
    kind = "?"
    devices: list[int]
    world_size: int

    def groups(self) -> list[TPGroup]:
        return [TPGroup(rank=r, size=self.world_size, comm=self) for r in range(self.world_size)]

    def all_reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        """Sum x over ranks, in place; x on devices[rank], any shape. Returns x."""
        self._check(rank, x)
        if torch.cuda.current_device() != self.devices[rank]:
            with torch.cuda.device(self.devices[rank]):
                return self._all_reduce(rank, x)
        return self._all_reduce(rank, x)

    def all_gather(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        """[..., d] on every rank -> [..., world * d], ranks in order along the last dim (new tensor)."""
        self._check(rank, x)
        if x.dim() == 0:
            raise ValueError("all_gather needs a tensor with a last dimension")
        if torch.cuda.current_device() != self.devices[rank]:
            with torch.cuda.device(self.devices[rank]):
                return self._all_gather(rank, x)
        return self._all_gather(rank, x)

    def _check(self, rank: int, x: torch.Tensor) -> None:
        device = x.device
        if device.type != "cuda" or device.index != self.devices[rank]:
            raise ValueError(f"rank {rank} works on cuda:{self.devices[rank]}, got a tensor on {device}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={self.devices})"


class NcclCommunicator(_CudaCommunicator):
    """NCCL through CuPy: one communicator per rank, created together by ncclCommInitAll.

    Safe to call from one thread per rank at once (CuPy releases the GIL inside NCCL) and while
    that thread captures a CUDA graph. Set NCCL_* variables (e.g. NCCL_NVLS_ENABLE=0) before
    constructing it: NCCL reads them here.
    """

    kind = "nccl"

    def __init__(self, devices):
        _import_cupy()
        from cupy.cuda import nccl
        if not getattr(nccl, "available", False):
            raise RuntimeError("CuPy cannot load NCCL here (install nvidia-nccl-cu13)")
        self.devices = _check_devices(devices, least=1)
        self.world_size = len(self.devices)
        self._nccl = nccl
        self._comms = nccl.NcclCommunicator.initAll(list(self.devices))
        self._warm_up()

    def _warm_up(self) -> None:
        """First collectives from this thread as one group: NCCL connects its peers lazily, and
        that must not happen first inside a graph capture or from two threads that race."""
        for numel in (1024, 1 << 20):
            bufs = [torch.ones(numel, dtype=torch.float32, device=f"cuda:{d}") for d in self.devices]
            outs = [torch.empty(self.world_size * numel, dtype=torch.float32, device=f"cuda:{d}")
                    for d in self.devices]
            for op in ("all_reduce", "all_gather"):
                self._nccl.groupStart()
                try:
                    for r, d in enumerate(self.devices):
                        stream = torch.cuda.current_stream(d).cuda_stream
                        if op == "all_reduce":
                            self._comms[r].allReduce(bufs[r].data_ptr(), bufs[r].data_ptr(), numel,
                                                     _NCCL_DTYPES[torch.float32], _NCCL_SUM, stream)
                        else:
                            self._comms[r].allGather(bufs[r].data_ptr(), outs[r].data_ptr(), numel,
                                                     _NCCL_DTYPES[torch.float32], stream)
                finally:
                    self._nccl.groupEnd()
            for d in self.devices:
                torch.cuda.synchronize(d)
            for b in bufs:
                if not bool((b == self.world_size).all()):
                    raise RuntimeError(f"NCCL warm-up all-reduce gave a wrong sum on {b.device}")

    @staticmethod
    def _dtype(x: torch.Tensor) -> int:
        try:
            return _NCCL_DTYPES[x.dtype]
        except KeyError:
            raise TypeError(f"NCCL has no reduction for {x.dtype}") from None

    def _all_reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return x
        buf = x if x.is_contiguous() else x.contiguous()
        self._comms[rank].allReduce(buf.data_ptr(), buf.data_ptr(), buf.numel(), self._dtype(x), _NCCL_SUM,
                                    torch.cuda.current_stream(x.device).cuda_stream)
        if buf is not x:
            x.copy_(buf)
        return x

    def _all_gather(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        src = x.contiguous()
        # NCCL gathers whole buffers one after another: [world, *x.shape]; then ranks move to
        # just before the last dim and merge with it.
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        if x.numel():
            self._comms[rank].allGather(src.data_ptr(), out.data_ptr(), src.numel(), self._dtype(x),
                                        torch.cuda.current_stream(x.device).cuda_stream)
        return gathered_to_last_dim(out)

    def close(self) -> None:
        for d in self.devices:
            torch.cuda.synchronize(d)
        for c in self._comms:
            c.destroy()
        self._comms = []


def gathered_to_last_dim(out: torch.Tensor) -> torch.Tensor:
    """[world, ..., d] (rank w's tensor at [w]) -> [..., world * d] with rank w at [..., w*d:(w+1)*d]."""
    world, *shape = out.shape
    return out.movedim(0, -2).reshape(*shape[:-1], world * shape[-1])


class P2PCommunicator(_CudaCommunicator):
    """One-shot all-reduce over peer-to-peer reads for messages up to `max_bytes`; NCCL otherwise.

    The protocol and its reasoning are in this module's docstring. `threads` per block (messages up
    to SMALL_MESSAGE_BYTES: `small_threads`) and at most `max_blocks` blocks per launch (a block
    takes one 16-byte word per thread per step). `fallback` lets
    several instances share one NcclCommunicator (it is then not closed by this one).
    """

    kind = "p2p"

    def __init__(self, devices, *, max_bytes: int = DEFAULT_P2P_MAX_BYTES, threads: int = 512,
                 small_threads: int | None = 128, max_blocks: int = MAX_BLOCKS, timeout_s: float = 60.0,
                 fallback: NcclCommunicator | None = None, self_test: bool = True, fast_launch: bool = True,
                 push_max_bytes: int | None = None):
        cupy = _import_cupy()
        self.devices = _check_devices(devices, least=2)
        self.world_size = len(self.devices)
        if self.world_size > MAX_RANKS:
            raise ValueError(f"the one-shot all-reduce handles up to {MAX_RANKS} ranks, got {self.world_size}")
        small_threads = threads if small_threads is None else small_threads
        for name, n in (("threads", threads), ("small_threads", small_threads)):
            if n % 32 or not 32 <= n <= 1024:
                raise ValueError(f"{name} must be a multiple of 32 in [32, 1024], got {n}")
        if not 1 <= max_blocks <= MAX_BLOCKS:
            raise ValueError(f"max_blocks must be in [1, {MAX_BLOCKS}], got {max_blocks}")
        if max_bytes < 16:
            raise ValueError(f"max_bytes must be at least 16, got {max_bytes}")
        self.max_bytes, self.threads, self.max_blocks = int(max_bytes), int(threads), int(max_blocks)
        if push_max_bytes is None:
            push_max_bytes = envs.P2P_PUSH_MAX_BYTES.read()
        self.push_max_bytes = min(int(push_max_bytes), self.max_bytes)
        self.small_threads = int(small_threads)
        self.fast_launch = fast_launch      # engine.distributed.p2p_launch; False: CuPy's generic kernel call
        self._cupy = cupy
        self._allocations: list[tuple[int, int]] = []           # (device, pointer) to free
        self._owns_nccl = fallback is None
        self._nccl: NcclCommunicator | None = fallback
        try:
            _enable_peer_access(cupy, self.devices)
            cap = -(-self.max_bytes // 256) * 256
            stage, flags, state = [], [], []
            for d in self.devices:
                with cupy.cuda.Device(d):
                    for size, into in ((2 * cap, stage), (_FLAG_BYTES, flags), (_STATE_BYTES, state)):
                        ptr = cupy.cuda.runtime.malloc(size)       # plain cudaMalloc, never managed
                        self._allocations.append((d, ptr))
                        cupy.cuda.runtime.memset(ptr, 0, size)
                        into.append(ptr)
                    cupy.cuda.runtime.deviceSynchronize()
            timeout_ns = int(timeout_s * 1e9) if timeout_s else 0
            self._args = [self._rank_args(r, stage, flags, state[r], cap, timeout_ns) for r in range(self.world_size)]
            self._push_args = self._push_buffers(timeout_ns) if self.push_max_bytes else []
            source = KERNEL_SOURCE + ADD_NORM_SOURCE + (p2p_push.PUSH_SOURCE if self.push_max_bytes else "")
            module = cupy.RawModule(code=source, options=("-std=c++17",))
            self._kernels = []          # per rank: RawKernel objects (attributes, for reports)
            self._functions = []        # per rank: the loaded function of that rank's device
            names = {**KERNEL_NAMES, **{("add_norm", kind): n for kind, n in ADD_NORM_KERNEL_NAMES.items()},
                     **(p2p_push.PUSH_KERNEL_NAMES if self.push_max_bytes else {})}
            for d in self.devices:
                with cupy.cuda.Device(d):
                    kernels = {key: module.get_function(name) for key, name in names.items()}
                    self._functions.append({key: k.kernel for key, k in kernels.items()})
                    self._kernels.append(kernels)
            self._function_ptrs = [{key: f.ptr for key, f in fns.items()} for fns in self._functions]
            self._pack_launches()
            if self._nccl is None:
                self._nccl = NcclCommunicator(self.devices)
            if self_test:
                self._self_test()
        except BaseException:
            try:
                self.close()
            except Exception as e:          # keep the first error; a dead context fails here too
                log.warning("p2p_close_after_failed_init", error=str(e))
            raise

    def _rank_args(self, rank: int, stage: list[int], flags: list[int], state: int, cap: int, timeout_ns: int):
        a = np.zeros(1, dtype=_ARGS_DTYPE)
        a["stage"][0, :self.world_size] = stage
        a["flags"][0, :self.world_size] = flags
        a["state"], a["cap"], a["rank"], a["world"] = state, cap, rank, self.world_size
        a["timeout_ns"] = timeout_ns
        return a

    def _push_buffers(self, timeout_ns: int) -> list[np.ndarray]:
        """Receive areas (the sentinel in every word) and push states; the push kernels' RankArgs."""
        cupy = self._cupy
        cap = -(-self.push_max_bytes // 256) * 256
        recv, state = [], []
        for d in self.devices:
            with cupy.cuda.Device(d):
                size = p2p_push.recv_bytes(cap, MAX_RANKS)
                ptr = cupy.cuda.runtime.malloc(size)
                self._allocations.append((d, ptr))
                memory = cupy.cuda.UnownedMemory(ptr, size, owner=None, device_id=d)
                cupy.ndarray((size // 4,), cupy.uint32, cupy.cuda.MemoryPointer(memory, 0)).fill(p2p_push.SENTINEL_WORD)
                recv.append(ptr)
                ptr = cupy.cuda.runtime.malloc(_STATE_BYTES)
                self._allocations.append((d, ptr))
                cupy.cuda.runtime.memset(ptr, 0, _STATE_BYTES)
                state.append(ptr)
                cupy.cuda.runtime.deviceSynchronize()
        return [self._rank_args(r, recv, [0] * self.world_size, state[r], cap, timeout_ns)
                for r in range(self.world_size)]

    def kernel_attributes(self) -> dict[str, dict]:
        """Registers, local (spill) bytes and binary version per kernel, on rank 0's device."""
        names = {**KERNEL_NAMES, **{("add_norm", kind): n for kind, n in ADD_NORM_KERNEL_NAMES.items()},
                 **p2p_push.PUSH_KERNEL_NAMES}
        with self._cupy.cuda.Device(self.devices[0]):
            return {names[key]: {"num_regs": k.num_regs, "local_size_bytes": k.local_size_bytes,
                                        "binary_version": k.binary_version}
                    for key, k in self._kernels[0].items()}

    def _all_reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        kind = _P2P_DTYPES.get(x.dtype)
        nbytes = x.numel() * x.element_size()
        if kind is None or nbytes > self.max_bytes:
            return self._nccl._all_reduce(rank, x)
        if nbytes == 0:
            return x
        # The launch shape may depend on the size only, never on this rank's pointer: every rank
        # must run the same grid. A misaligned or strided x is reduced through a copy.
        vec = nbytes % 16 == 0
        buf = x
        if not x.is_contiguous() or (vec and x.data_ptr() % 16):
            buf = x.clone(memory_format=torch.contiguous_format)
        units = nbytes // 16 if vec else x.numel()
        threads = self.small_threads if nbytes <= SMALL_MESSAGE_BYTES else self.threads
        blocks = min(self.max_blocks, -(-units // threads))
        stream = torch.cuda.current_stream(x.device).cuda_stream
        push = vec and kind != "f32" and nbytes <= self.push_max_bytes
        key, args, fast = ((("push", kind), self._push_args, self._fast_push) if push
                           else ((kind, vec), self._args, self._fast))
        if self.fast_launch:
            call = (fast[rank].all_reduce, self._function_ptrs[rank][key], blocks, threads, stream,
                    buf.data_ptr(), units)
        else:
            call = (_launch, self._functions[rank][key], (blocks,), (threads,),
                    (args[rank], np.uint64(buf.data_ptr()), np.int32(units)), _Stream(stream))
        self._in_context(rank, call)
        if buf is not x:
            x.copy_(buf)
        return x

    def _all_gather(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        return self._nccl._all_gather(rank, x)

    def all_reduce_add_rms_norm(self, rank: int, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float, zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One launch for `h = all_reduce(x) + residual; (rms_norm(h) * weight, h)` (engine.distributed.fused_allreduce).

        x, residual: [..., H] on devices[rank]; weight: [H]. Returns (normed, h) as new tensors,
        or None where the fused kernel does not apply (dtype, shapes, rows not 16-byte multiples,
        more than max_bytes): the caller then runs the unfused ops. The decision depends on shapes
        and dtypes only, never on this rank's pointers, so every rank decides alike."""
        self._check(rank, x)
        kind = _P2P_DTYPES.get(x.dtype)
        hidden = residual.shape[-1] if residual.dim() else 0
        row_bytes = hidden * x.element_size()
        nbytes = residual.numel() * x.element_size()
        limit = self.max_bytes if FUSED_MAX_BYTES is None else min(self.max_bytes, FUSED_MAX_BYTES)
        if (kind is None or nbytes == 0 or nbytes > limit or row_bytes % 16 or x.shape != residual.shape
                or residual.dtype != x.dtype or weight.dtype != x.dtype or weight.shape != (hidden,)):
            return None
        if torch.cuda.current_device() != self.devices[rank]:
            with torch.cuda.device(self.devices[rank]):
                return self._add_norm(rank, kind, x, residual, weight, eps, zero_centred)
        return self._add_norm(rank, kind, x, residual, weight, eps, zero_centred)

    def _add_norm(self, rank, kind, x, residual, weight, eps, zero_centred):
        def aligned(t):           # contiguous and 16-byte aligned, else a copy (pointers differ per rank)
            return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)
        x, residual, weight = aligned(x), aligned(residual), aligned(weight)
        out, residual_out = torch.empty_like(residual), torch.empty_like(residual)
        rows = residual.numel() // residual.shape[-1]
        blocks, threads, units = add_norm_launch_shape(rows, residual.shape[-1] * x.element_size(), self.max_blocks)
        pointers = (x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), residual_out.data_ptr())
        stream = torch.cuda.current_stream(x.device).cuda_stream
        push = (kind != "f32" and residual.numel() * x.element_size() <= self.push_max_bytes
                and units <= p2p_push.PUSH_MAX_ROW_UNITS)
        key, args, fast = ((("push_add_norm", kind), self._push_args, self._fast_push) if push
                           else (("add_norm", kind), self._args, self._fast))
        if self.fast_launch:
            call = (fast[rank].add_norm, self._function_ptrs[rank][key], blocks, threads, stream,
                    pointers, rows, units, eps, zero_centred)
        else:
            call = (_launch, self._functions[rank][key], (blocks,), (threads,),
                    (args[rank], *(np.uint64(p) for p in pointers), np.int32(rows), np.int32(units),
                     np.float32(eps), np.int32(1 if zero_centred else 0)), _Stream(stream))
        self._in_context(rank, call)
        return out, residual_out

    def _in_context(self, rank: int, call: tuple) -> None:
        """call[0](*call[1:]) with devices[rank] current for CuPy (launches use the current context)."""
        device = self.devices[rank]
        if self._cupy.cuda.runtime.getDevice() == device:
            call[0](*call[1:])
        else:
            with self._cupy.cuda.Device(device):
                call[0](*call[1:])

    def _pack_launches(self) -> None:
        self._fast = [RankLaunch(self._cupy.cuda.driver, a.tobytes()) for a in self._args]
        self._fast_push = [RankLaunch(self._cupy.cuda.driver, a.tobytes()) for a in self._push_args]

    def _self_test(self) -> None:
        """Launch a few all-reduces for all ranks from this thread (launches return at once; the
        kernels meet on the devices) and check the sums; a short timeout so a dead link fails fast."""
        saved = self._args, self._push_args
        self._args, self._push_args = [a.copy() for a in saved[0]], [a.copy() for a in saved[1]]
        for a in self._args + self._push_args:
            a["timeout_ns"] = min(int(a["timeout_ns"][0]) or 10**10, 10**10)
        self._pack_launches()
        try:
            for numel in (1, 4097, 4096, min(self.max_bytes // 2, 1 << 17)):
                xs = [torch.full((numel,), float(r + 1), dtype=torch.bfloat16, device=f"cuda:{d}")
                      for r, d in enumerate(self.devices)]
                for r in range(self.world_size):
                    self.all_reduce(r, xs[r])
                for d in self.devices:
                    torch.cuda.synchronize(d)
                want = self.world_size * (self.world_size + 1) / 2
                for x in xs:
                    if not bool((x == want).all()):
                        raise RuntimeError(f"P2P all-reduce self-test gave a wrong sum on {x.device} "
                                           f"for {numel} elements")
            # the fused kernel: h = (1 + ... + world) + 1 everywhere, normed to 1 (weight 1)
            got = []
            for r, d in enumerate(self.devices):
                x = torch.full((3, 1024), float(r + 1), dtype=torch.bfloat16, device=f"cuda:{d}")
                one = torch.ones(1024, dtype=torch.bfloat16, device=f"cuda:{d}")
                got.append(self.all_reduce_add_rms_norm(r, x, torch.ones_like(x), one, 1e-6))
            for d in self.devices:
                torch.cuda.synchronize(d)
            want = self.world_size * (self.world_size + 1) / 2 + 1
            for out, h in got:
                if not (bool((h == want).all()) and bool((out == 1).all())):
                    raise RuntimeError(f"P2P fused all-reduce + add + norm self-test failed on {h.device}")
        finally:
            self._args, self._push_args = saved
            self._pack_launches()

    def close(self) -> None:
        cupy = self._cupy
        for d in self.devices:
            torch.cuda.synchronize(d)
        for d, ptr in self._allocations:
            with cupy.cuda.Device(d):
                cupy.cuda.runtime.free(ptr)
        self._allocations = []
        if self._owns_nccl and self._nccl is not None:
            self._nccl.close()
        self._nccl = None


def _enable_peer_access(cupy, devices: list[int]) -> None:
    runtime = cupy.cuda.runtime
    for i in devices:
        for j in devices:
            if i == j:
                continue
            if not runtime.deviceCanAccessPeer(i, j):
                raise RuntimeError(f"cuda:{i} cannot access cuda:{j} peer to peer here; use NCCL")
            with cupy.cuda.Device(i):
                try:
                    runtime.deviceEnablePeerAccess(j)
                except runtime.CUDARuntimeError as e:   # CuPy clears the runtime's error state
                    if getattr(e, "status", None) != _CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
                        raise


def _p2p_unselected(devices, kind: str) -> str:
    """The capability of the first device whose kernel paths do not take the CUDA C all-reduce; "" if none.
    `--tp-comm p2p` there is refused, naming the flag (engine.platform.check_tp_comm)."""
    from engine.platform import check_tp_comm, paths_for
    for d in devices:
        paths = paths_for(torch.device("cuda", d))
        check_tp_comm(paths, kind, len(devices))
        if paths.tp_allreduce != "p2p-one-shot+nccl":
            return paths.capability
    return ""


def make_communicator(kind: str, devices, **p2p_options) -> NcclCommunicator | P2PCommunicator:
    """kind: "nccl", "p2p" (fails where peer access or the kernel is unavailable), or "auto":
    the one-shot P2P all-reduce where it works (the faster one for decode-size messages), else NCCL."""
    if kind == "nccl":
        return NcclCommunicator(devices)
    if kind not in ("p2p", "auto"):
        raise ValueError(f"communicator kind must be 'nccl', 'p2p' or 'auto', got {kind!r}")
    unselected = _p2p_unselected(devices, kind)
    if kind == "p2p":
        return P2PCommunicator(devices, **p2p_options)
    nccl = NcclCommunicator(devices)
    if unselected:
        log.info("p2p_all_reduce_unavailable", reason=f"not selected on {unselected} (engine/platform.py)",
                 using="nccl")
        return nccl
    if not 2 <= nccl.world_size <= MAX_RANKS:
        return nccl
    try:
        comm = P2PCommunicator(devices, fallback=nccl, **p2p_options)
    except Exception as e:  # noqa: BLE001 - no peer access, no NVRTC, failed self-test: use NCCL
        log.warning("p2p_all_reduce_unavailable", reason=repr(e), using="nccl")
        return nccl
    comm._owns_nccl = True
    return comm
