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

Measured on the H200 (bench/results/2026-12-01-h200-s14/d-41c76c8-mma-persistent-warps, fraction of copy
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
from engine.kernels.linear.splitk import num_sms

# Decode rows that go to this tensor-core GEMV where it takes the layer (engine/kernels/linear/quant_gemm.py routes them);
# the Triton GEMV and skinny kernels keep the rest (and all of them with NINFER_QUANT_MMA_GEMV=0). From the H200
# sweep (bench/results/2026-12-01-h200-s14/d-41c76c8-mma-persistent-warps), fraction of copy summed over a
# qwen3-8b layer: NVFP4 1 row 0.48 (Triton 0.42), 2 rows 0.46 (0.22); FP8 2 rows 0.70 (0.38). FP8 at one row
# stays on the Triton GEMV, 0.76 against 0.71: with so few instructions per byte it was not issue-bound.
MMA_GEMV_ROWS = {"nvfp4": range(1, 9), "fp8": range(2, 9)}

CUDA_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

__device__ __forceinline__ uint4 ld_stream(const u8* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ u32 e4m3x2_lo(u32 w) {   // bytes 0, 1 -> fp16x2 (exact)
    u32 d;
    asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, l;}" : "=r"(d) : "r"(w));
    return d;
}

__device__ __forceinline__ u32 e4m3x2_hi(u32 w) {   // bytes 2, 3 -> fp16x2 (exact)
    u32 d;
    asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, h;}" : "=r"(d) : "r"(w));
    return d;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ u16 f32_to_out(float f, bool bf16) {
    u16 h;
    if (bf16) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// 8 E2M1 codes (nibble i = column i) -> fp16x2 pairs of columns (0,4) (2,6) (1,5) (3,7), value * 2^-14
__device__ __forceinline__ void e2m1x8(u32 w, u32& p0, u32& p1, u32& p2, u32& p3) {
    p0 = ((w << 9) & 0x0E000E00u) | ((w << 12) & 0x80008000u);
    p1 = ((w << 1) & 0x0E000E00u) | ((w << 4) & 0x80008000u);
    p2 = ((w << 5) & 0x0E000E00u) | ((w << 8) & 0x80008000u);
    p3 = ((w >> 3) & 0x0E000E00u) | (w & 0x80008000u);
}

__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// a bf16 or fp16 value -> fp16 bits, bf16 saturated to fp16's finite range
__device__ __forceinline__ u16 to_f16(u16 v, bool bf16) {
    if (!bf16) return v;
    float f = __uint_as_float(((u32)v) << 16);
    return f32_to_f16(fminf(fmaxf(f, -65504.f), 65504.f));
}

// the raw weights of one batch of U chunks (and, NVFP4, their group scales): chunk u of the batch is
// u * USTRIDE chunks after the first (USTRIDE = WARPS: the warps of a CTA interleave chunk by chunk; 1: a
// batch is U adjacent chunks, U * 64 contiguous bytes of each row), `valid` of them exist
template <int FMT, int USTRIDE, int U>
__device__ __forceinline__ void load_batch(const u8* pa, const u8* pc, const u8* qa, const u8* qc, int valid,
                                           uint4 (&a)[U], uint4 (&c)[U], u32 (&sa)[U], u32 (&sc)[U]) {
    #pragma unroll
    for (int u = 0; u < U; ++u) {
        if (u < valid) {
            a[u] = ld_stream(pa + u * USTRIDE * 64);
            c[u] = ld_stream(pc + u * USTRIDE * 64);
            if (FMT == 1) {
                sa[u] = *(const u16*)(qa + u * USTRIDE * 8);
                sc[u] = *(const u16*)(qc + u * USTRIDE * 8);
            }
        }
    }
}

// the math of one batch: rows g, g + 8 of the block against the staged activations xp (this lane's columns
// of the batch's first chunk); FP8 scales each chunk's partial sum by its block scale (bsp: the block row)
template <int FMT, int USTRIDE, int U>
__device__ __forceinline__ void mma_batch(const uint4 (&a)[U], const uint4 (&c)[U], const u32 (&sa)[U],
                                          const u32 (&sc)[U], int valid, const u16* xp,
                                          const float* bsp, int ch, int block_shift, float (&acc)[4]) {
    constexpr int CHUNK = FMT == 1 ? 128 : 64;
    #pragma unroll
    for (int u = 0; u < U; ++u) {
        if (u >= valid) break;
        const u32 wa[4] = {a[u].x, a[u].y, a[u].z, a[u].w};
        const u32 wc[4] = {c[u].x, c[u].y, c[u].z, c[u].w};
        const uint4* x4 = (const uint4*)(xp + u * USTRIDE * CHUNK);
        if (FMT == 1) {
            u32 b[16];
            #pragma unroll
            for (int q = 0; q < 4; ++q) {
                const uint4 v = x4[q];
                b[4 * q] = v.x; b[4 * q + 1] = v.y; b[4 * q + 2] = v.z; b[4 * q + 3] = v.w;
            }
            // group scales * 2^7 as fp16x2 (448 * 128 < 65504): words 0, 1 are group 2t, words 2, 3 group 2t + 1
            const u32 f_a = hmul2(e4m3x2_lo(sa[u]), 0x58005800u), f_c = hmul2(e4m3x2_lo(sc[u]), 0x58005800u);
            #pragma unroll
            for (int q = 0; q < 4; ++q) {
                const u32 ga = __byte_perm(f_a, 0, q < 2 ? 0x1010 : 0x3232);
                const u32 gc = __byte_perm(f_c, 0, q < 2 ? 0x1010 : 0x3232);
                u32 a0, a1, a2, a3, c0, c1, c2, c3;
                e2m1x8(wa[q], a0, a1, a2, a3);
                e2m1x8(wc[q], c0, c1, c2, c3);
                a0 = hmul2(a0, ga); a1 = hmul2(a1, ga); a2 = hmul2(a2, ga); a3 = hmul2(a3, ga);
                c0 = hmul2(c0, gc); c1 = hmul2(c1, gc); c2 = hmul2(c2, gc); c3 = hmul2(c3, gc);
                mma16816(acc, a0, c0, a1, c1, b[4 * q], b[4 * q + 1]);
                mma16816(acc, a2, c2, a3, c3, b[4 * q + 2], b[4 * q + 3]);
            }
        } else {
            u32 b[8];
            #pragma unroll
            for (int q = 0; q < 2; ++q) {
                const uint4 v = x4[q];
                b[4 * q] = v.x; b[4 * q + 1] = v.y; b[4 * q + 2] = v.z; b[4 * q + 3] = v.w;
            }
            float part[4] = {0.f, 0.f, 0.f, 0.f};
            #pragma unroll
            for (int q = 0; q < 4; ++q)
                mma16816(part, e4m3x2_lo(wa[q]), e4m3x2_lo(wc[q]), e4m3x2_hi(wa[q]), e4m3x2_hi(wc[q]),
                         b[2 * q], b[2 * q + 1]);
            const float s = bsp[(ch + u * USTRIDE) >> block_shift];
            #pragma unroll
            for (int j = 0; j < 4; ++j) acc[j] += part[j] * s;
        }
    }
}

// FMT 1: NVFP4 (weight u8 [N, K/2], gs e4m3 [N, K/16], rs f32 [N]); FMT 0: FP8 block (weight e4m3 [N, K],
// bs f32 [N/br, K/bc], bc = 64 << block_shift). x, out: bf16 (XBF16) or fp16, M <= 8 rows.
// Persistent CTAs of WARPS warps: CTA b takes row blocks b, b + gridDim.x, ... (16 rows each), so x is
// staged once per CTA; dynamic shared memory M * K * 2 bytes. CONTIG: a warp's batch is U adjacent chunks
// (chunks w U .. w U + U - 1, then + U WARPS), else chunk w, w + WARPS, ... (needs K / CHUNK % U == 0).
template <int FMT, int WARPS, int U, bool XBF16, bool CONTIG>
__global__ void __launch_bounds__(WARPS * 32)
qgemv_mma(const u16* __restrict__ x, long long x_stride, int M,
          const u8* __restrict__ w, long long w_stride,
          const u8* __restrict__ gs, long long gs_stride, const float* __restrict__ rs,
          const float* __restrict__ bs, long long bs_stride, int br, int block_shift,
          u16* __restrict__ out, long long out_stride, int N, int K)
{
    constexpr int CHUNK = FMT == 1 ? 128 : 64;        // columns per chunk: 64 bytes of each row
    // U: chunks per batch; two batches in flight per warp (2 U KB)
    constexpr int STEP = U * WARPS;                   // chunks from one batch of a warp to its next
    constexpr int USTRIDE = CONTIG ? 1 : WARPS;       // chunks from one chunk of a batch to the next
    constexpr int FIRST = CONTIG ? U : 1;             // warp w's first chunk is w * FIRST
    extern __shared__ __align__(16) u16 xs[];          // [M][K] fp16 bits, in B order
    __shared__ float red[WARPS][16][8];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int blocks = N / 16;
    const int nchunks = K / CHUNK;
    // this warp's chunks (CONTIG: whole batches of U, as nchunks % U == 0)
    const int mine = CONTIG ? (warp < nchunks / U ? U * ((nchunks / U - warp + WARPS - 1) / WARPS) : 0)
                            : (warp < nchunks ? (nchunks - warp + WARPS - 1) / WARPS : 0);
    // this lane's bytes of a row block's first chunk: rows g and g + 8 (and, NVFP4, their 2 group scales)
    const long long lane_w = (long long)g * w_stride + 16 * t + warp * FIRST * 64;
    const long long lane_s = (long long)g * gs_stride + 2 * t + warp * FIRST * 8;

    uint4 a0[U], c0[U], a1[U], c1[U];                // rows g, g + 8 of two batches
    u32 sa0[U], sc0[U], sa1[U], sc1[U];
    int rb = blockIdx.x;
    {
        const u8* pa = w + (long long)rb * 16 * w_stride + lane_w;
        const u8* qa = gs + (long long)rb * 16 * gs_stride + lane_s;
        load_batch<FMT, USTRIDE, U>(pa, pa + 8 * w_stride, qa, qa + 8 * gs_stride, min(U, mine), a0, c0, sa0, sc0);
    }                                                 // weights only: before the wait

    asm volatile("griddepcontrol.wait;" ::: "memory");
    // stage x as fp16 in B order: NVFP4 reverses the 3 low bits of each column index (pairs (0,4) (2,6)
    // (1,5) (3,7) of the decoder land next to each other); FP8 keeps the order
    for (int i = threadIdx.x; i < M * K / 8; i += WARPS * 32) {
        const int m = (i * 8) / K, k = (i * 8) % K;
        const uint4 v = *(const uint4*)(x + m * x_stride + k);
        const u16* e = (const u16*)&v;
        u16 h[8];
        #pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int p = FMT == 1 ? (((j & 1) << 2) | (j & 2) | ((j >> 2) & 1)) : j;
            h[p] = to_f16(e[j], XBF16);
        }
        *(uint4*)(xs + m * K + k) = *(const uint4*)h;
    }
    __syncthreads();
    asm volatile("griddepcontrol.launch_dependents;");

    // B column g is activation row g; lanes past the M rows read row 0 into columns that are never stored
    const u16* xp = xs + (g < M ? g : 0) * K + warp * FIRST * CHUNK + (FMT == 1 ? 32 : 16) * t;
    for (; rb < blocks; rb += gridDim.x) {
        const u8* pa = w + (long long)rb * 16 * w_stride + lane_w;
        const u8* pc = pa + 8 * w_stride;
        const u8* qa = gs + (long long)rb * 16 * gs_stride + lane_s;
        const u8* qc = qa + 8 * gs_stride;
        const float* bsp = FMT == 1 ? bs : bs + (long long)((rb * 16) / br) * bs_stride;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        // two batches in flight: the next one's loads are issued before this one's math (no register copies)
        for (int done = 0; done < mine; done += 2 * U) {
            const int v1 = min(U, mine - done - U);
            const long long o1 = (long long)(done / U + 1) * STEP;
            if (v1 > 0) load_batch<FMT, USTRIDE, U>(pa + o1 * 64, pc + o1 * 64, qa + o1 * 8, qc + o1 * 8, v1, a1, c1, sa1, sc1);
            mma_batch<FMT, USTRIDE, U>(a0, c0, sa0, sc0, min(U, mine - done), xp + (done / U) * STEP * CHUNK, bsp,
                                     warp * FIRST + (done / U) * STEP, block_shift, acc);
            if (v1 <= 0) break;
            const int v2 = min(U, mine - done - 2 * U);
            const long long o2 = o1 + STEP;
            if (v2 > 0) load_batch<FMT, USTRIDE, U>(pa + o2 * 64, pc + o2 * 64, qa + o2 * 8, qc + o2 * 8, v2, a0, c0, sa0, sc0);
            mma_batch<FMT, USTRIDE, U>(a1, c1, sa1, sc1, v1, xp + o1 * CHUNK, bsp, warp * FIRST + (int)o1, block_shift, acc);
        }
        // the next row block's first batch goes out before this one's sums meet
        const int next = rb + gridDim.x;
        if (next < blocks) {
            const u8* na = w + (long long)next * 16 * w_stride + lane_w;
            const u8* nq = gs + (long long)next * 16 * gs_stride + lane_s;
            load_batch<FMT, USTRIDE, U>(na, na + 8 * w_stride, nq, nq + 8 * gs_stride, min(U, mine), a0, c0, sa0, sc0);
        }
        // lane (g, t) holds rows g, g + 8 of the block for activation rows 2t, 2t + 1
        red[warp][g][2 * t] = acc[0];
        red[warp][g][2 * t + 1] = acc[1];
        red[warp][g + 8][2 * t] = acc[2];
        red[warp][g + 8][2 * t + 1] = acc[3];
        __syncthreads();
        if (threadIdx.x < 16 * M) {
            const int r = threadIdx.x & 15, m = threadIdx.x >> 4;
            float y = 0.f;
            #pragma unroll
            for (int j = 0; j < WARPS; ++j) y += red[j][r][m];
            const int row = rb * 16 + r;
            if (FMT == 1) y *= 128.f * rs[row];
            out[m * out_stride + row] = f32_to_out(y, XBF16);
        }
        __syncthreads();                              // red is written again by the next row block
    }
}
"""

NVFP4_CHUNK, FP8_CHUNK = 128, 64
MAX_ROWS = 8                       # the mma's 8 columns
# 16 warps per CTA (one CTA per SM at 75 registers): the best or within 0.01 of it on every per-model sum of
# the H200 sweep (bench/results/2026-12-01-h200-s14/d-41c76c8-mma-persistent-warps), e.g. FP8 at 2 rows,
# qwen3-8b: 0.70 of copy against 0.62 with 8 warps and 0.53 with 4
WARPS = 16
MAX_SMEM_BYTES = 200 * 1024        # x staged as fp16, M * K * 2 bytes per CTA (a CTA may have 227 KiB)


BATCH = 2                          # chunks per batch (two batches in flight per warp)


# CONTIG: a warp's batch is U adjacent chunks (128 contiguous bytes of each row at U = 2) rather than chunks
# interleaved across the warps (64 bytes of a row each), for both formats. Served on the H200 (qwen3-8b, three
# interleaved reps): NVFP4 one row 2.763 -> 2.749 ms a step; FP8 at 2-8 rows +0.03 of copy per model in the
# sweep (0.713 -> 0.745 at 2 rows), its 8-stream decode within the run-to-run noise (0.704 -> 0.683 ms a token)
# (bench/results/2026-12-02-h200-s19/a-de4097e-mma-tests-ab-contig, b-f9fcd47-mma-tests-ab-contig-per-format).
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
        _AVAILABLE[idx] = enabled() and _cupy() is not None and torch.cuda.get_device_capability(idx)[0] >= 9
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
