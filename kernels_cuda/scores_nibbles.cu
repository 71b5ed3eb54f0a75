// approx_scores_nibbles (kernels_cuda/launch.py launch_approx_scores): scores.cu's approx_scores for
// nibble-pair codes (the g64c16 store: byte p of a row is a | b << 4, a the code of group 2p and b of
// group 2p + 1), scored from the 16-entry tables of the groups rather than the 256-entry tables of
// the pairs, and for the G query heads h = kv G + i (i < G <= MAXG) of a kv head in one pass over
// its codes. Compiled with scores.cu's options.
//
// Why: approx_scores over 256-entry tables is bound by shared-memory bank conflicts (a warp's 32
// random entries of one table fall ~3.5 to a bank). A 16-entry table lies in 16 distinct banks, so a
// warp's lookups into it never conflict (lanes on one entry are served by a broadcast), and the G
// heads' tables take G * 2 gp * 16 floats (12 KiB for SmolLM2's 3 heads), leaving room for many
// blocks an SM. Same outputs as approx_scores over the pair tables up to float32 rounding (each pair
// entry is the sum of its two group entries): z rows, part_m / part_l [Hq, nblk].
//
// Layouts: T [Hq, 2 gp, 16] f32 contiguous (build_lut of the 16-centroid factor codebooks);
// P [Hkv, n_cap, gp] uint8, strides (p_s0, gp, 1). Launch: block 256, grid (nblk, Hkv), dynamic
// shared memory G * 2 gp * 16 floats. vec16 as approx_scores (gp % 16 == 0 and 16-byte aligned rows).

#include "common.cuh"

template <int MAXG>
__device__ __forceinline__ void approx_scores_nibbles_impl(const float* __restrict__ T,
                                                           const unsigned char* __restrict__ P, long long p_s0,
                                                           float* __restrict__ z, long long z_s0,
                                                           float* __restrict__ part_m, float* __restrict__ part_l,
                                                           int n, int gp, int G, int tokens_per_block, int vec16) {
    MR_DYN_SMEM(smem);
    __shared__ float scratch[64];
    const int kv = blockIdx.y;
    const int tab = 2 * gp * 16;                   // one head's tables
    const float* Tg = T + (long long)kv * G * tab; // the group's heads are consecutive rows of T
    for (int i = threadIdx.x; i < G * tab; i += blockDim.x) smem[i] = Tg[i];
    __syncthreads();
    const unsigned char* Pk = P + (long long)kv * p_s0;
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
        const unsigned char* row = Pk + t * gp;
        if (vec16) {
            const MrVec16* r4 = reinterpret_cast<const MrVec16*>(row);
            for (int j0 = 0; j0 < gp; j0 += 16) {
                const MrVec16 v = r4[j0 / 16];
                const unsigned int w[4] = {v.a, v.b, v.c, v.d};
                const float* Tj = smem + j0 * 32;   // a byte's two groups: 32 entries
#pragma unroll
                for (int i = 0; i < MAXG; ++i) {    // (head outer, bytes inner: few live registers)
                    if (i >= G) continue;
                    const float* Ti = Tj + i * tab;
                    float acc = 0.f;
#pragma unroll
                    for (int q = 0; q < 16; ++q) {
                        const unsigned int b = (w[q >> 2] >> ((q & 3) * 8)) & 0xffu;
                        acc += Ti[q * 32 + (b & 15u)] + Ti[q * 32 + 16 + (b >> 4)];
                    }
                    s[i] += acc;
                }
            }
        } else {
            for (int j = 0; j < gp; ++j) {
                const unsigned int b = row[j];
                const float* Tj = smem + j * 32;
#pragma unroll
                for (int i = 0; i < MAXG; ++i)
                    if (i < G) s[i] += Tj[i * tab + (b & 15u)] + Tj[i * tab + 16 + (b >> 4)];
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
extern "C" __global__ void __launch_bounds__(256)
approx_scores_nibbles_g4(const float* __restrict__ T, const unsigned char* __restrict__ P, long long p_s0,
                         float* __restrict__ z, long long z_s0, float* __restrict__ part_m,
                         float* __restrict__ part_l, int n, int gp, int G, int tokens_per_block, int vec16,
                         const int* __restrict__ n_live, int has_live) {
    if (has_live) n = mr_live_n(n, n_live);
    approx_scores_nibbles_impl<4>(T, P, p_s0, z, z_s0, part_m, part_l, n, gp, G, tokens_per_block, vec16);
}

extern "C" __global__ void __launch_bounds__(256)
approx_scores_nibbles_g8(const float* __restrict__ T, const unsigned char* __restrict__ P, long long p_s0,
                         float* __restrict__ z, long long z_s0, float* __restrict__ part_m,
                         float* __restrict__ part_l, int n, int gp, int G, int tokens_per_block, int vec16,
                         const int* __restrict__ n_live, int has_live) {
    if (has_live) n = mr_live_n(n, n_live);
    approx_scores_nibbles_impl<8>(T, P, p_s0, z, z_s0, part_m, part_l, n, gp, G, tokens_per_block, vec16);
}
