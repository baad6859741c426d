// ninfer one-shot all-reduce over peer-to-peer loads. No #include: NVRTC builds it at run time.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

struct RankArgs {
    u64 stage[MAX_RANKS];   // each rank's staging area: two halves of `cap` bytes (call parity)
    u64 flags[MAX_RANKS];   // each rank's flags: u64 [2][MAX_BLOCKS][MAX_RANKS]
    u64 state;              // this rank's {u64 epoch of the last finished call, u32 blocks done}
    u64 cap;                // bytes per staging half
    u64 timeout_ns;         // how long a block waits for a peer before trapping; 0: forever
    int rank;
    int world;
};
static_assert(sizeof(RankArgs) == 160, "RankArgs must match _ARGS_DTYPE in parallel_cuda.py");

__device__ __forceinline__ void store_flag(u64* p, u64 v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 load_flag(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void fence_acquire_sys() {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
}
__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ int slot(int parity, int block, int src) {
    return (parity * MAX_BLOCKS + block) * MAX_RANKS + src;
}

__device__ __forceinline__ void wait_for(const u64* flag, u64 epoch, const RankArgs& a, int peer) {
    if (load_flag(flag) == epoch) return;
    const u64 start = global_ns();
    while (load_flag(flag) != epoch) {
        if (a.timeout_ns != 0ull && global_ns() - start > a.timeout_ns) {
            printf("ninfer p2p all-reduce: rank %d block %d waited too long for rank %d (epoch %llu)\n",
                   a.rank, (int)blockIdx.x, peer, epoch);
            __trap();
        }
    }
}

// Element types: how a stored value becomes fp32 and back (round to nearest even).
struct F32 {};
struct F16 {};
struct BF16 {};
template <typename T> struct Num;
template <> struct Num<F32> {
    typedef float raw;
    static __device__ __forceinline__ float load(raw v) { return v; }
    static __device__ __forceinline__ raw store(float f) { return f; }
};
template <> struct Num<BF16> {
    typedef u16 raw;
    static __device__ __forceinline__ float load(raw v) { return __uint_as_float(((u32)v) << 16); }
    static __device__ __forceinline__ raw store(float f) {
        u32 u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (raw)0x7fc0u;       // NaN
        u += 0x7fffu + ((u >> 16) & 1u);                                 // nearest, ties to even
        return (raw)(u >> 16);
    }
};
template <> struct Num<F16> {
    typedef u16 raw;
    static __device__ __forceinline__ float load(raw v) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
        return f;
    }
    static __device__ __forceinline__ raw store(float f) {
        raw h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
        return h;
    }
};

// What one thread moves per step: 16 bytes (VEC) or one element.
template <typename T, bool VEC> struct Unit;
template <typename T> struct Unit<T, true> {
    typedef uint4 word;
    enum { N = 16 / sizeof(typename Num<T>::raw) };
    union View { uint4 u; typename Num<T>::raw e[N]; };
    static __device__ __forceinline__ word load_peer(const word* p) { return __ldcg(p); }
    static __device__ __forceinline__ void add(float (&acc)[N], word w, bool first) {
        View v;
        v.u = w;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            const float f = Num<T>::load(v.e[j]);
            acc[j] = first ? f : acc[j] + f;
        }
    }
    static __device__ __forceinline__ word pack(const float (&acc)[N]) {
        View v;
#pragma unroll
        for (int j = 0; j < N; ++j) v.e[j] = Num<T>::store(acc[j]);
        return v.u;
    }
};
template <typename T> struct Unit<T, false> {
    typedef typename Num<T>::raw word;
    enum { N = 1 };
    static __device__ __forceinline__ word load_peer(const word* p) { return __ldcg(p); }
    static __device__ __forceinline__ void add(float (&acc)[N], word w, bool first) {
        const float f = Num<T>::load(w);
        acc[0] = first ? f : acc[0] + f;
    }
    static __device__ __forceinline__ word pack(const float (&acc)[N]) { return Num<T>::store(acc[0]); }
};

// Lets the kernel after this one (a PDL launch: engine/kernels/pdl.py) start its programs now; they
// wait in griddepcontrol.wait until this kernel has finished, so nothing here can be read early.
__device__ __forceinline__ void allow_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Step 1's epoch: the last finished call's on this rank plus one (read on the device, so that a graph
// replays it unchanged), shared by the block's threads.
__device__ __forceinline__ u64 next_epoch(const RankArgs& a, u64* s_epoch) {
    if (threadIdx.x == 0) *s_epoch = *(volatile u64*)a.state + 1ull;
    __syncthreads();
    return *s_epoch;
}

// Step 3 for this block: thread q signals peer q (release) and waits for peer q's signal (acquire).
__device__ __forceinline__ void exchange_flags(const RankArgs& a, int parity, u64 epoch) {
    const int q = (int)threadIdx.x;
    if (q < a.world && q != a.rank) {
        __threadfence_system();
        store_flag((u64*)a.flags[q] + slot(parity, (int)blockIdx.x, a.rank), epoch);
        wait_for((const u64*)a.flags[a.rank] + slot(parity, (int)blockIdx.x, q), epoch, a, q);
        fence_acquire_sys();
    }
    __syncthreads();
}

// Called by thread 0 of every block at the end: true in the call's last block to finish, which
// re-arms the counter (u32 at state + 8) and may then publish the call.
__device__ __forceinline__ bool last_block(const RankArgs& a) {
    __threadfence();
    u32* done = (u32*)(a.state + 8ull);
    if (atomicAdd(done, 1u) != gridDim.x - 1u) return false;
    *(volatile u32*)done = 0u;
    return true;
}

template <typename T, bool VEC>
__device__ __forceinline__ void one_shot(const RankArgs& a, void* xp, int units) {
    typedef Unit<T, VEC> U;
    typedef typename U::word word;
    __shared__ u64 s_epoch;
    const u64 epoch = next_epoch(a, &s_epoch);
    const int parity = (int)(epoch & 1ull);
    const int per_block = (units + (int)gridDim.x - 1) / (int)gridDim.x;
    const int begin = (int)blockIdx.x * per_block;
    const int end = min(begin + per_block, units);
    word* x = (word*)xp;
    word* mine = (word*)(a.stage[a.rank] + (u64)parity * a.cap);

    // 1. Stage this block's slice of the local input where the peers can read it.
    for (int i = begin + (int)threadIdx.x; i < end; i += (int)blockDim.x) mine[i] = x[i];
    __syncthreads();

    // 2. Thread q signals peer q (release) and waits for peer q's signal (acquire).
    exchange_flags(a, parity, epoch);

    // 3. Sum every rank's slice in rank order (same order, same bits on every rank).
    for (int i = begin + (int)threadIdx.x; i < end; i += (int)blockDim.x) {
        word v[MAX_RANKS];
#pragma unroll
        for (int s = 0; s < MAX_RANKS; ++s) {
            if (s < a.world) {
                v[s] = s == a.rank ? mine[i]
                                   : U::load_peer((const word*)(a.stage[s] + (u64)parity * a.cap) + i);
            }
        }
        float acc[U::N];
#pragma unroll
        for (int s = 0; s < MAX_RANKS; ++s) {
            if (s < a.world) U::add(acc, v[s], s == 0);
        }
        x[i] = U::pack(acc);
    }

    // 4. The last block to finish publishes the epoch for the next launch on this rank.
    if (threadIdx.x == 0 && last_block(a)) *(volatile u64*)a.state = epoch;
}

#define ENTRY(NAME, T, VEC)                                                                      \
    extern "C" __global__ void __launch_bounds__(1024) NAME(const RankArgs a, void* x, int units) { \
        allow_dependents();                                                                      \
        one_shot<T, VEC>(a, x, units);                                                           \
    }
ENTRY(ninfer_ar_f32_vec, F32, true)
ENTRY(ninfer_ar_f32_one, F32, false)
ENTRY(ninfer_ar_f16_vec, F16, true)
ENTRY(ninfer_ar_f16_one, F16, false)
ENTRY(ninfer_ar_bf16_vec, BF16, true)
ENTRY(ninfer_ar_bf16_one, BF16, false)
