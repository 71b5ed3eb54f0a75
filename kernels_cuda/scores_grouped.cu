// approx_scores_grouped (kernels_cuda/launch.py launch_approx_scores): scores.cu's approx_scores
// for the query heads of one kv head at once. Compiled with scores.cu's options.

#include "common.cuh"

// ---------------------------------------------------------------------------
// approx_scores_grouped: approx_scores for the G query heads h = kv G + i (i < G <= MAXG) of each
// kv head in one pass over its codes: a thread loads a token's code row once and looks it up in
// the G heads' tables (the per-head kernel loads each row G times: with SmolLM2's G = 3 at 1M
// tokens, 300 MB a layer for 100 MB of codes). Same outputs as approx_scores (z rows, part_m /
// part_l [Hq, nblk]).
// Launch: block 256, grid (nblk, Hkv); dynamic shared memory G*g*c floats: the tables
// T[kv G .. kv G + G - 1] (the wrapper takes this kernel only where they fit). At most 128
// registers (two blocks an SM: the tables of SmolLM2's g64c16 take 96 KiB a block).
// ---------------------------------------------------------------------------
// Code q of a 16-byte row chunk (q a constant after unrolling: no local-memory array).
template <typename IdxT>
__device__ __forceinline__ int mr_vec_code(const MrVec16& v, int q) {
    const int per_word = 4 / (int)sizeof(IdxT);
    const int wi = q / per_word, sh = (q % per_word) * 8 * (int)sizeof(IdxT);
    const unsigned int w = wi == 0 ? v.a : wi == 1 ? v.b : wi == 2 ? v.c : v.d;
    return (int)((w >> sh) & (sizeof(IdxT) == 1 ? 0xffu : 0xffffu));
}

template <typename IdxT, int MAXG>
__device__ __forceinline__ void approx_scores_grouped_impl(const float* __restrict__ T, const IdxT* __restrict__ P,
                                                           long long p_s0, float* __restrict__ z, long long z_s0,
                                                           float* __restrict__ part_m, float* __restrict__ part_l,
                                                           int n, int g, int c, int G, int tokens_per_block,
                                                           int vec16) {
    MR_DYN_SMEM(smem);
    __shared__ float scratch[64];
    const int kv = blockIdx.y;
    const int gc = g * c;
    const float* Tg = T + (long long)kv * G * gc;   // the group's heads are consecutive rows of T
    for (int i = threadIdx.x; i < G * gc; i += blockDim.x) smem[i] = Tg[i];
    __syncthreads();
    const IdxT* Pk = P + (long long)kv * p_s0;
    const long long start = (long long)blockIdx.x * tokens_per_block;
    const long long end = mr_min_ll(start + tokens_per_block, (long long)n);
    float m[MAXG], l[MAXG];
#pragma unroll
    for (int i = 0; i < MAXG; ++i) {
        m[i] = mr_neg_inf();
        l[i] = 0.f;
    }
    for (long long t = start + threadIdx.x; t < end; t += blockDim.x) {
        float s[MAXG];
#pragma unroll
        for (int i = 0; i < MAXG; ++i) s[i] = 0.f;
        const IdxT* row = Pk + t * g;
        if (vec16) {
            const int PER = 16 / (int)sizeof(IdxT);
            const MrVec16* r4 = reinterpret_cast<const MrVec16*>(row);
            for (int j0 = 0; j0 < g; j0 += PER) {
                const MrVec16 v = r4[j0 / PER];
                const float* Tj = smem + j0 * c;
#pragma unroll
                for (int i = 0; i < MAXG; ++i) {   // (head outer, codes inner: few live registers)
                    if (i >= G) continue;
                    float acc = 0.f;
#pragma unroll
                    for (int q = 0; q < PER; ++q) acc += Tj[i * gc + q * c + mr_vec_code<IdxT>(v, q)];
                    s[i] += acc;
                }
            }
        } else {
            for (int j = 0; j < g; ++j) {
                const float* Tj = smem + j * c + mr_code(row[j]);
#pragma unroll
                for (int i = 0; i < MAXG; ++i)
                    if (i < G) s[i] += Tj[i * gc];
            }
        }
#pragma unroll
        for (int i = 0; i < MAXG; ++i) {
            if (i >= G) continue;
            z[(long long)(kv * G + i) * z_s0 + t] = s[i];
            if (s[i] > m[i]) {
                l[i] = l[i] * expf(m[i] - s[i]) + 1.f;
                m[i] = s[i];
            } else if (s[i] == s[i]) {
                l[i] += expf(s[i] - m[i]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MAXG; ++i) {
        if (i >= G) continue;   // (G is the block's: every thread takes the same branches)
        mr_block_ms(m[i], l[i], scratch);
        if (threadIdx.x == 0) {
            part_m[(long long)(kv * G + i) * gridDim.x + blockIdx.x] = m[i];
            part_l[(long long)(kv * G + i) * gridDim.x + blockIdx.x] = l[i];
        }
    }
}

// (entry points written out: the CUDA emulator reads kernel signatures from this text)
extern "C" __global__ void __launch_bounds__(256, 2)
approx_scores_grouped_u8_g4(const float* __restrict__ T, const unsigned char* __restrict__ P, long long p_s0,
                            float* __restrict__ z, long long z_s0, float* __restrict__ part_m,
                            float* __restrict__ part_l, int n, int g, int c, int G, int tokens_per_block,
                            int vec16, const int* __restrict__ n_live, int has_live) {
    if (has_live) n = mr_live_n(n, n_live);
    approx_scores_grouped_impl<unsigned char, 4>(T, P, p_s0, z, z_s0, part_m, part_l, n, g, c, G,
                                                 tokens_per_block, vec16);
}

extern "C" __global__ void __launch_bounds__(256, 2)
approx_scores_grouped_u8_g8(const float* __restrict__ T, const unsigned char* __restrict__ P, long long p_s0,
                            float* __restrict__ z, long long z_s0, float* __restrict__ part_m,
                            float* __restrict__ part_l, int n, int g, int c, int G, int tokens_per_block,
                            int vec16, const int* __restrict__ n_live, int has_live) {
    if (has_live) n = mr_live_n(n, n_live);
    approx_scores_grouped_impl<unsigned char, 8>(T, P, p_s0, z, z_s0, part_m, part_l, n, g, c, G,
                                                 tokens_per_block, vec16);
}

extern "C" __global__ void __launch_bounds__(256, 2)
approx_scores_grouped_i16_g4(const float* __restrict__ T, const short* __restrict__ P, long long p_s0,
                             float* __restrict__ z, long long z_s0, float* __restrict__ part_m,
                             float* __restrict__ part_l, int n, int g, int c, int G, int tokens_per_block,
                             int vec16, const int* __restrict__ n_live, int has_live) {
    if (has_live) n = mr_live_n(n, n_live);
    approx_scores_grouped_impl<short, 4>(T, P, p_s0, z, z_s0, part_m, part_l, n, g, c, G, tokens_per_block,
                                         vec16);
}

extern "C" __global__ void __launch_bounds__(256, 2)
approx_scores_grouped_i16_g8(const float* __restrict__ T, const short* __restrict__ P, long long p_s0,
                             float* __restrict__ z, long long z_s0, float* __restrict__ part_m,
                             float* __restrict__ part_l, int n, int g, int c, int G, int tokens_per_block,
                             int vec16, const int* __restrict__ n_live, int has_live) {
    if (has_live) n = mr_live_n(n, n_live);
    approx_scores_grouped_impl<short, 8>(T, P, p_s0, z, z_s0, part_m, part_l, n, g, c, G, tokens_per_block,
                                         vec16);
}
