// needs engine.distributed.cuda_communicator.KERNEL_SOURCE and engine.distributed.fused_allreduce.ADD_NORM_SOURCE before it
// RankArgs here: stage[q] = rank q's receive area recv[3][MAX_RANKS][cap]; state = this rank's push
// state {u64 count, u32 done, u32 last units}; flags unused.
#define PUSH_SENTINEL 0x80008000u

__device__ __forceinline__ u32 canonical_lane(u32 v) {    // -0.0 halves -> +0.0
    if ((v & 0xffffu) == 0x8000u) v &= 0xffff0000u;
    if ((v >> 16) == 0x8000u) v &= 0x0000ffffu;
    return v;
}
__device__ __forceinline__ uint4 canonical(uint4 w) {
    w.x = canonical_lane(w.x); w.y = canonical_lane(w.y); w.z = canonical_lane(w.z); w.w = canonical_lane(w.w);
    return w;
}
__device__ __forceinline__ void push_word(uint4* p, uint4 w) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w) : "memory");
}
__device__ __forceinline__ uint4 poll_word(const uint4* p) {
    uint4 w;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w) : "l"(p) : "memory");
    return w;
}
__device__ __forceinline__ bool arrived(uint4 w) {
    return w.x != PUSH_SENTINEL && w.y != PUSH_SENTINEL && w.z != PUSH_SENTINEL && w.w != PUSH_SENTINEL;
}
__device__ __noinline__ void push_timed_out(int rank, int peer, u64 call) {
    printf("ninfer push all-reduce: rank %d block %d waited too long for rank %d (call %llu)\n",
           rank, (int)blockIdx.x, peer, call);
    __trap();
}
__device__ __forceinline__ uint4 wait_word(const uint4* p, const RankArgs& a, int peer, u64 call) {
    uint4 w = poll_word(p);
    if (arrived(w)) return w;
    const u64 start = global_ns();
    while (!arrived(w = poll_word(p))) {
        if (a.timeout_ns != 0ull && global_ns() - start > a.timeout_ns) push_timed_out(a.rank, peer, call);
    }
    return w;
}

// this rank's receive slot of `src` in buffer b; `cap` bytes per slot
__device__ __forceinline__ uint4* recv_slot(const RankArgs& a, int owner, int b, int src) {
    return (uint4*)(a.stage[owner] + ((u64)b * MAX_RANKS + (u64)src) * a.cap);
}

__device__ __forceinline__ u64 push_call(const RankArgs& a, u64* s_call, u32* s_last) {
    if (threadIdx.x == 0) {
        *s_call = *(volatile u64*)a.state + 1ull;
        *s_last = *(volatile u32*)(a.state + 12ull);
    }
    __syncthreads();
    return *s_call;
}

// step 4 and 5: reset the words call - 1 used, then the last block publishes this call
__device__ __forceinline__ void push_finish(const RankArgs& a, u64 call, u32 last_units, u32 units) {
    const int prev = (int)((call + 2ull) % 3ull);
    const uint4 clean = make_uint4(PUSH_SENTINEL, PUSH_SENTINEL, PUSH_SENTINEL, PUSH_SENTINEL);
    for (int q = 0; q < a.world; ++q) {
        if (q == a.rank) continue;
        uint4* slot = recv_slot(a, a.rank, prev, q);
        for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < last_units; i += gridDim.x * blockDim.x)
            slot[i] = clean;
    }
    __syncthreads();
    if (threadIdx.x == 0 && last_block(a)) {
        *(volatile u32*)(a.state + 12ull) = units;
        *(volatile u64*)a.state = call;
    }
}

template <typename T>
__device__ __forceinline__ void push_all_reduce(const RankArgs& a, void* xp, int units) {
    typedef Unit<T, true> U;
    __shared__ u64 s_call;
    __shared__ u32 s_last;
    const u64 call = push_call(a, &s_call, &s_last);
    const int b = (int)(call % 3ull);
    uint4* x = (uint4*)xp;
    const int stride = (int)(gridDim.x * blockDim.x);
    const int first = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    for (int i = first; i < units; i += stride) {                       // 1. push
        const uint4 w = canonical(x[i]);
        for (int q = 0; q < a.world; ++q)
            if (q != a.rank) push_word(recv_slot(a, q, b, a.rank) + i, w);
    }
    for (int i = first; i < units; i += stride) {                       // 2-3. wait, sum in rank order
        float acc[U::N];
        for (int s = 0; s < a.world; ++s) {
            const uint4 v = s == a.rank ? canonical(x[i]) : wait_word(recv_slot(a, a.rank, b, s) + i, a, s, call);
            U::add(acc, v, s == 0);
        }
        x[i] = U::pack(acc);
    }
    push_finish(a, call, s_last, (u32)units);
}

template <typename T>
__device__ __forceinline__ void push_add_norm(const RankArgs& a, const void* xp, const void* rp, const void* wp,
                                              void* op, void* rop, int rows, int row_units, float eps,
                                              int zero_centred) {
    typedef Unit<T, true> U;
    typedef typename U::word word;
    __shared__ u64 s_call;
    __shared__ u32 s_last;
    __shared__ float s_part[32];
    const u64 call = push_call(a, &s_call, &s_last);
    const int b = (int)(call % 3ull);
    const word* x = (const word*)xp;
    const word* res = (const word*)rp;
    const word* w = (const word*)wp;
    word* out = (word*)op;
    word* res_out = (word*)rop;
    const int i = (int)threadIdx.x;                  // one word of the row per thread (row_units <= blockDim)
    const bool mine = i < row_units;
    const float n = (float)(row_units * U::N);
    for (int row = (int)blockIdx.x; row < rows; row += (int)gridDim.x) {
        const int base = row * row_units;
        word own = make_uint4(0u, 0u, 0u, 0u);
        if (mine) {                                  // 1. this rank's partial, pushed
            own = canonical(x[base + i]);            // every rank sums the numbers it sends
            for (int q = 0; q < a.world; ++q)
                if (q != a.rank) push_word(recv_slot(a, q, b, a.rank) + base + i, own);
        }
        float ss = 0.f;
        float acc[U::N];
        if (mine) {                                  // 2-3. wait, sum in rank order, add the residual
            for (int s = 0; s < a.world; ++s) {
                const word v = s == a.rank ? own : wait_word(recv_slot(a, a.rank, b, s) + base + i, a, s, call);
                U::add(acc, v, s == 0);
            }
            add_residual<T>(acc, res[base + i], ss);
            res_out[base + i] = U::pack(acc);
        }
        const float rstd = rsqrtf(block_sum(ss, s_part) / n + eps);   // every thread of the block
        if (mine) out[base + i] = normed_word<T>(U::pack(acc), w[i], rstd, zero_centred);
    }
    push_finish(a, call, s_last, (u32)(rows * row_units));
}

#define PUSH_ENTRY(NAME, T)                                                                       \
    extern "C" __global__ void __launch_bounds__(1024) NAME(const RankArgs a, void* x, int units) { \
        allow_dependents();                                                                       \
        push_all_reduce<T>(a, x, units);                                                          \
    }
PUSH_ENTRY(ninfer_push_ar_bf16, BF16)
PUSH_ENTRY(ninfer_push_ar_f16, F16)
ADD_NORM_ENTRY(ninfer_push_ar_add_norm_bf16, push_add_norm, BF16)
ADD_NORM_ENTRY(ninfer_push_ar_add_norm_f16, push_add_norm, F16)
