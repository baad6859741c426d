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
