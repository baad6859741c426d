"""Decode GEMV for NVFP4 and FP8-block weights on the tensor cores, in CUDA C (compiled by NVRTC via CuPy).

y[M, N] = x[M, K] @ W[N, K]^T for M = 1..8 decode rows, the weight read once, in the checkpoint's own
layout (no repacking, no second copy). The Triton GEMV (engine/kernels/linear/gemv_triton.py) turns every
weight value into fp32 and multiplies it on the CUDA cores: ~10 instructions per NVFP4 byte, and 0.41 of
copy bandwidth over a qwen3-8b layer; at two rows its tensor-core `skinny` kernel reached 0.22. Here the
values go to `mma.sync.m16n8k16` (fp16 in, fp32 accumulate), whose 8 columns hold the activation rows:

  - a warp owns 16 weight rows and walks K in chunks (NVFP4 128 columns, FP8 64: 16 bytes per row per
    lane); lane (g, t) = (lane / 4, lane % 4) loads 16 bytes of rows g and g + 8 at byte 16 t of the
    chunk, so the warp reads 16 whole 64-byte row segments per chunk;
  - the mma's k index is a permutation of the physical columns, the same for A (weights) and B
    (activations): lane t's 4 k positions in each k16 step are 4 of its own columns. Which ones is
    chosen so that A's registers come straight out of the decoder, and B is read from shared memory
    where the CTA stages x once as fp16 in that order;
  - NVFP4: a 32-bit word (8 codes) decodes into four fp16x2 pairs, columns (0,4), (2,6), (1,5), (3,7),
    each code put in the bits of an fp16 number equal to 2^-14 times its E2M1 value (shifts and masks;
    exponent 0 is fp16's subnormal, so 0 and 0.5 come out right), then multiplied (fp16x2) by its
    group's E4M3 scale times 2^7: a lane's 16 columns of a row are one whole scale group, so the scale
    is applied to A and the fp32 accumulator runs over all of K. The product is exact for every E4M3
    scale (an integer of at most 6 significant bits times 2^-17, at most 21). The output is the sum
    times 2^7 times the row's tensor scale;
  - FP8: e4m3 pairs convert to fp16x2 exactly (`cvt.rn.f16x2.e4m3x2`); a chunk lies in one 128x128
    block, so its partial sum is scaled once and added;
  - the warps of a CTA split the chunks; their sums meet in shared memory. CTAs are persistent (as many as
    fit at once), each walking every gridDim-th row block, so x is staged once per CTA and the next row
    block's first weights are in flight while this one's sums meet.
x is converted to fp16 (saturating at +-65504: a bf16 activation beyond fp16's range is clamped).

Measured on the H200 (bench/results/2026-12-01-h200-quant-gemv-mma/d-41c76c8-mma-persistent-warps, fraction of copy
bandwidth summed over one qwen3-8b layer): NVFP4 0.48 at one row (Triton 0.42) and 0.46 at two (0.22); FP8
0.70 at two rows (0.38), 0.71 at one (Triton 0.76, which keeps that case). What holds NVFP4 at 0.58 on
its largest layer (gate_up) is not settled: a lane spends ~26 instructions per 32-bit word of 8 codes
(sm_90 SASS: ~15 integer shifts and masks decode them, 4 fp16x2 multiplies apply the scales, 1 mma, the
rest loads and addresses), which at that rate is about half of the SM's issue slots, so neither issue nor bandwidth is saturated;
the likely limit is latency (per warp, two batches of 2 KB in flight). No hardware counters were read.
"""

from __future__ import annotations

import ctypes

import torch

from engine import envs
from engine.platform import paths_for

from engine.kernels.cuda_source import read_cuda_source
from engine.kernels.linear.splitk import num_sms

# Decode rows that go to this tensor-core GEMV where it takes the layer (engine/kernels/linear/quant_gemm.py routes them);
# the Triton GEMV and skinny kernels keep the rest (and all of them with NINFER_QUANT_MMA_GEMV=0). From the H200
# sweep (bench/results/2026-12-01-h200-quant-gemv-mma/d-41c76c8-mma-persistent-warps), fraction of copy summed over a
# qwen3-8b layer: NVFP4 1 row 0.48 (Triton 0.42), 2 rows 0.46 (0.22); FP8 2 rows 0.70 (0.38). FP8 at one row
# stays on the Triton GEMV, 0.76 against 0.71: with so few instructions per byte it was not issue-bound.
MMA_GEMV_ROWS = {"nvfp4": range(1, 9), "fp8": range(2, 9)}

CUDA_SOURCE = read_cuda_source(__file__, "quant_gemv_mma.cu")

NVFP4_CHUNK, FP8_CHUNK = 128, 64
MAX_ROWS = 8                       # the mma's 8 columns
# 16 warps per CTA (one CTA per SM at 75 registers): the best or within 0.01 of it on every per-model sum of
# the H200 sweep (bench/results/2026-12-01-h200-quant-gemv-mma/d-41c76c8-mma-persistent-warps), e.g. FP8 at 2 rows,
# qwen3-8b: 0.70 of copy against 0.62 with 8 warps and 0.53 with 4
WARPS = 16
MAX_SMEM_BYTES = 200 * 1024        # x staged as fp16, M * K * 2 bytes per CTA (a CTA may have 227 KiB)


BATCH = 2                          # chunks per batch (two batches in flight per warp)


# CONTIG: a warp's batch is U adjacent chunks (128 contiguous bytes of each row at U = 2) rather than chunks
# interleaved across the warps (64 bytes of a row each), for both formats. Served on the H200 (qwen3-8b, three
# interleaved reps): NVFP4 one row 2.763 -> 2.749 ms a step; FP8 at 2-8 rows +0.03 of copy per model in the
# sweep (0.713 -> 0.745 at 2 rows), its 8-stream decode within the run-to-run noise (0.704 -> 0.683 ms a token)
# (bench/results/2026-12-02-h200-mma-chunks-fp8-tiles/a-de4097e-mma-tests-ab-contig, b-f9fcd47-mma-tests-ab-contig-per-format).
# NINFER_QUANT_MMA_CONTIG=0 restores the interleaved order.
CONTIG_FORMATS = frozenset(("fp8", "nvfp4")) if envs.QUANT_MMA_CONTIG.read() else frozenset()

# (warps, batch, contig) compiled on first use; tools/dev/quant_gemv_mma_check.py sweeps these
VARIANTS = ((16, 2, False), (16, 2, True), (16, 4, True), (8, 4, True))


def _name(fmt: str, x_bf16: bool, warps: int, batch: int, contig: bool) -> str:
    flag = lambda b: "true" if b else "false"
    return f"qgemv_mma<{1 if fmt == 'nvfp4' else 0}, {warps}, {batch}, {flag(x_bf16)}, {flag(contig)}>"


_FUNCTIONS: dict[tuple[int, str], object] = {}     # (device index, kernel name) -> cupy RawKernel
_GRID: dict[tuple, int] = {}                       # (device, kernel, shared bytes) -> resident CTAs


def enabled() -> bool:
    return envs.QUANT_MMA_GEMV.read()


def _cupy():
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def supports(fmt: str, M: int, N: int, K: int, scale_block: tuple[int, int] = (128, 128)) -> bool:
    """Whether the mma GEMV takes this layer: 16-row blocks, whole chunks, x fitting shared memory."""
    chunk = NVFP4_CHUNK if fmt == "nvfp4" else FP8_CHUNK
    if not (1 <= M <= MAX_ROWS and N % 16 == 0 and K % chunk == 0 and M * K * 2 <= MAX_SMEM_BYTES):
        return False
    if fmt == "fp8":
        br, bc = scale_block
        return br % 16 == 0 and bc >= FP8_CHUNK and (bc & (bc - 1)) == 0      # bc = 64 << block_shift
    return fmt == "nvfp4"


def _function(device: torch.device, name: str):
    """The kernel `name` compiled for `device` (NVRTC, once per process and name)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if (idx, name) not in _FUNCTIONS:
        cupy = _cupy()
        with cupy.cuda.Device(idx):
            module = cupy.RawModule(code=CUDA_SOURCE, options=("-std=c++17",), name_expressions=[name])
            fn = module.get_function(name)
            fn.max_dynamic_shared_size_bytes = MAX_SMEM_BYTES
        _FUNCTIONS[(idx, name)] = fn
    return _FUNCTIONS[(idx, name)]


_AVAILABLE: dict[int, bool] = {}


def available(device: torch.device) -> bool:
    """CUDA sm_90+ with CuPy importable (the `gpu` extra) and `NINFER_QUANT_MMA_GEMV` not 0; read once."""
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _AVAILABLE:
        _AVAILABLE[idx] = enabled() and _cupy() is not None and paths_for(device).nvfp4_linear == "mma-gemv+triton-gemv"
    return _AVAILABLE[idx]


def takes(fmt: str, x: torch.Tensor, N: int, scale_block: tuple[int, int] = (128, 128)) -> bool:
    """Whether a quantized layer's decode rows x [M, K] go to this kernel."""
    return x.dtype in (torch.bfloat16, torch.float16) and available(x.device) and supports(
        fmt, x.shape[0], N, x.shape[1], scale_block)


def quant_gemv_mma(x: torch.Tensor, fmt: str, weight: torch.Tensor, scale: torch.Tensor,
                   row_scale: torch.Tensor | None, out_features: int,
                   scale_block: tuple[int, int] = (128, 128), warps: int = WARPS,
                   batch: int = BATCH, contig: bool | None = None) -> torch.Tensor:
    """x: [M <= 8, K] bf16/fp16 (unit stride); weight: packed uint8 [N, K/2] with scale e4m3 [N, K/16] and
    row_scale fp32 [N] (NVFP4), or e4m3 [N, K] with scale fp32 [N/br, K/bc] (FP8 blocks) -> [M, N]."""
    M, K = x.shape
    N = out_features
    if not supports(fmt, M, N, K, scale_block):
        raise ValueError(f"quant_gemv_mma: {fmt} M={M} N={N} K={K} block={scale_block} is not supported")
    if contig is None:
        contig = fmt in CONTIG_FORMATS
    if contig and (K // (NVFP4_CHUNK if fmt == "nvfp4" else FP8_CHUNK)) % batch:
        contig = False                  # whole batches only; the interleaved order takes any chunk count
    if x.stride(1) != 1 or weight.stride(1) != 1 or scale.stride(-1) != 1:
        raise ValueError("quant_gemv_mma: x, weight and scale need unit stride along K")
    if (x.data_ptr() | x.stride(0) * 2 | weight.data_ptr() | weight.stride(0)) % 16:
        x = x.clone() if (x.data_ptr() | x.stride(0) * 2) % 16 else x     # 16-byte rows for the vector loads
        if (weight.data_ptr() | weight.stride(0)) % 16:
            raise ValueError("quant_gemv_mma: weight rows must start on 16 bytes")
    fn = _function(x.device, _name(fmt, x.dtype == torch.bfloat16, warps, batch, contig))
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    nvfp4 = fmt == "nvfp4"
    rs = row_scale if nvfp4 else scale
    c = ctypes
    args = (c.c_void_p(x.data_ptr()), c.c_longlong(x.stride(0)), c.c_int(M),
            c.c_void_p(weight.data_ptr()), c.c_longlong(weight.stride(0)),
            c.c_void_p(scale.data_ptr()), c.c_longlong(scale.stride(0) if nvfp4 else 0), c.c_void_p(rs.data_ptr()),
            c.c_void_p(scale.data_ptr()), c.c_longlong(0 if nvfp4 else scale.stride(0)),
            c.c_int(scale_block[0]), c.c_int((scale_block[1] // FP8_CHUNK).bit_length() - 1),
            c.c_void_p(out.data_ptr()), c.c_longlong(out.stride(0)), c.c_int(N), c.c_int(K))
    ptrs = (c.c_void_p * len(args))(*(c.addressof(a) for a in args))
    cupy = _cupy()
    # pdl imports Triton, which a CPU install lacks; this module's shape rules need none of it
    from engine.kernels import pdl
    stream = torch.cuda.current_stream(x.device).cuda_stream
    with cupy.cuda.Device(x.device.index):
        grid = min(N // 16, _resident_ctas(cupy, fn, x.device, M * K * 2, warps))
        if pdl.enabled(x.device):
            _launch_pdl(fn.kernel.ptr, grid, warps * 32, M * K * 2, stream, ptrs)
        else:
            cupy.cuda.driver.launchKernel(fn.kernel.ptr, grid, 1, 1, warps * 32, 1, 1, M * K * 2, stream,
                                          c.addressof(ptrs), 0)
    return out


class _LaunchAttribute(ctypes.Structure):          # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):             # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6              # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_DRIVER: list = []


def _launch_pdl(function: int, grid: int, threads: int, smem: int, stream: int, params) -> None:
    if not _DRIVER:
        launch = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        launch.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        launch.restype = ctypes.c_int
        attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value[0] = 1                           # programmaticStreamSerializationAllowed
        _DRIVER.extend([launch, attr])
    launch, attr = _DRIVER
    config = _LaunchConfig((grid, 1, 1), (threads, 1, 1), smem, stream, ctypes.pointer(attr), 1)
    err = launch(ctypes.byref(config), function, ctypes.addressof(params), None)
    if err:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {err}")


def _resident_ctas(cupy, fn, device: torch.device, smem: int, warps: int) -> int:
    """CTAs that fit on the device at once (the persistent grid): SMs x CTAs per SM for this shared memory."""
    key = (device.index, fn.kernel.ptr, smem)
    if key not in _GRID:
        try:
            per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, warps * 32, smem)
        except AttributeError:      # a CuPy without the occupancy call: CTAs past what fits wait their turn
            per_sm = 2
        _GRID[key] = max(1, per_sm) * num_sms(device)
    return _GRID[key]
