// needs the definitions of engine.distributed.cuda_communicator.KERNEL_SOURCE (RankArgs, Num, Unit, flags)
__device__ __forceinline__ float block_sum(float v, float* s_part) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();                              // the previous row's readers are done with s_part
    if ((threadIdx.x & 31) == 0) s_part[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = 0.f;
    const int warps = (int)blockDim.x >> 5;
    for (int w = 0; w < warps; ++w) t += s_part[w];           // same order in every thread and rank
    return t;
}

// The ranks' fp32 sum rounded, plus the residual word, rounded: the new residual in place in acc
// (fp32 values of T); its squares added to ss in element order.
template <typename T>
__device__ __forceinline__ void add_residual(float (&acc)[Unit<T, true>::N], uint4 residual_word, float& ss) {
    typename Unit<T, true>::View r;
    r.u = residual_word;
#pragma unroll
    for (int j = 0; j < Unit<T, true>::N; ++j) {
        const float sum = Num<T>::load(Num<T>::store(acc[j]));
        const float h = Num<T>::load(Num<T>::store(sum + Num<T>::load(r.e[j])));
        acc[j] = h;
        ss += h * h;
    }
}

// One word of the normed output from a word of the new residual and one of the weight.
template <typename T>
__device__ __forceinline__ uint4 normed_word(uint4 h_word, uint4 w_word, float rstd, int zero_centred) {
    typename Unit<T, true>::View h, wt;
    h.u = h_word;
    wt.u = w_word;
    float y[Unit<T, true>::N];
#pragma unroll
    for (int j = 0; j < Unit<T, true>::N; ++j) {
        const float hn = Num<T>::load(h.e[j]) * rstd;
        const float wj = Num<T>::load(wt.e[j]);
        y[j] = zero_centred ? hn * (1.0f + wj) : Num<T>::load(Num<T>::store(hn)) * wj;
    }
    return Unit<T, true>::pack(y);
}

template <typename T>
__device__ __forceinline__ void one_shot_add_norm(const RankArgs& a, const void* xp, const void* rp,
                                                  const void* wp, void* op, void* rop, int rows,
                                                  int row_units, float eps, int zero_centred) {
    typedef Unit<T, true> U;
    typedef typename U::word word;
    typedef typename Num<T>::raw raw;
    __shared__ u64 s_epoch;
    __shared__ float s_part[32];
    const u64 epoch = next_epoch(a, &s_epoch);
    const int parity = (int)(epoch & 1ull);
    const word* x = (const word*)xp;
    const word* res = (const word*)rp;
    const word* w = (const word*)wp;
    word* out = (word*)op;
    word* res_out = (word*)rop;
    word* mine = (word*)(a.stage[a.rank] + (u64)parity * a.cap);

    // 1. Stage this block's rows of the local partial where the peers can read them.
    for (int row = (int)blockIdx.x; row < rows; row += (int)gridDim.x) {
        const int base = row * row_units;
        for (int i = (int)threadIdx.x; i < row_units; i += (int)blockDim.x) mine[base + i] = x[base + i];
    }
    __syncthreads();

    // 2. Thread q signals peer q (release) and waits for peer q's signal (acquire).
    exchange_flags(a, parity, epoch);

    const float n = (float)(row_units * U::N);
    for (int row = (int)blockIdx.x; row < rows; row += (int)gridDim.x) {
        const int base = row * row_units;
        // 3. Sum the ranks in rank order, round, add the residual, round: the new residual.
        float ss = 0.f;
        for (int i = (int)threadIdx.x; i < row_units; i += (int)blockDim.x) {
            word v[MAX_RANKS];
#pragma unroll
            for (int s = 0; s < MAX_RANKS; ++s) {
                if (s < a.world) {
                    v[s] = s == a.rank ? mine[base + i]
                                       : U::load_peer((const word*)(a.stage[s] + (u64)parity * a.cap) + base + i);
                }
            }
            float acc[U::N];
#pragma unroll
            for (int s = 0; s < MAX_RANKS; ++s) {
                if (s < a.world) U::add(acc, v[s], s == 0);
            }
            add_residual<T>(acc, res[base + i], ss);
            res_out[base + i] = U::pack(acc);
        }
        // 4. The row's RMS, then the weighted output (each thread rereads its own residual words).
        const float rstd = rsqrtf(block_sum(ss, s_part) / n + eps);
        for (int i = (int)threadIdx.x; i < row_units; i += (int)blockDim.x)
            out[base + i] = normed_word<T>(res_out[base + i], w[i], rstd, zero_centred);
    }

    // 5. The last block to finish publishes the epoch for the next launch on this rank.
    if (threadIdx.x == 0 && last_block(a)) *(volatile u64*)a.state = epoch;
}

// The kernel entry of a fused all-reduce + add + norm whose body is BODY<T> (this pull kernel, and
// engine.distributed.p2p_push's push_add_norm).
#define ADD_NORM_ENTRY(NAME, BODY, T)                                                             \
    extern "C" __global__ void __launch_bounds__(1024) NAME(const RankArgs a, const void* x,      \
            const void* residual, const void* weight, void* out, void* residual_out, int rows,    \
            int row_units, float eps, int zero_centred) {                                         \
        allow_dependents();                                                                       \
        BODY<T>(a, x, residual, weight, out, residual_out, rows, row_units, eps, zero_centred);   \
    }
ADD_NORM_ENTRY(ninfer_ar_add_norm_f32, one_shot_add_norm, F32)
ADD_NORM_ENTRY(ninfer_ar_add_norm_f16, one_shot_add_norm, F16)
ADD_NORM_ENTRY(ninfer_ar_add_norm_bf16, one_shot_add_norm, BF16)
