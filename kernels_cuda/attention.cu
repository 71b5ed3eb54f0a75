// attention.cu -- exact decode attention (split-K, flash-decoding style); its partial results are
// merged by decode.cu's lse_merge_staged.
//
// Compiled without --use_fast_math (-inf handling in the online softmax).
//
// Layouts (element strides; the last axis is always contiguous):
//   q        [Hq, d]          float32, contiguous (already scaled by 1/sqrt(d))
//   K, V     [Hkv, n_cap, d]  float32 / float16 bits / bfloat16 bits, strides (s0, s1, 1)
//   q_to_kv  [Hq]             int32
//   o_part   [P, Hq, d]       float32, contiguous (normalized partial outputs)
//   m_part, l_part [P, Hq]    float32, contiguous
// A split is empty when its l == 0 or m == -inf; an empty result is
// o = 0, m = -inf, l = 0.

#include "common.cuh"

#define MR_ATT_THREADS 256  // attend_partial block size (the wrapper launches exactly this)
#define MR_ATT_TILE 256     // tokens per shared-memory tile in attend_partial
#define MR_ATT_ILP 4        // tokens per warp step in the score phase

// ---------------------------------------------------------------------------
// attend_partial: one block per (split, q head) over tokens
// [split*tokens_per_split, min(n, (split+1)*tokens_per_split)), processed in
// tiles of MR_ATT_TILE tokens with an online softmax.  Writes the normalized
// partial output o_part[split, h, :], m_part[split, h], l_part[split, h]
// (layout [nsplit, Hq, ...] = lse_merge_staged's input layout).  An empty range
// writes (0, -inf, 0).
//
// Launch: block MR_ATT_THREADS, grid (nsplit, Hq), d <= MR_ATT_THREADS,
// dynamic shared memory (d + MR_ATT_TILE + MR_ATT_THREADS) floats.
// Scores: warp w computes q.k for tokens w, w + 8, ... of the tile, MR_ATT_ILP
// at a time (lanes split d, shuffle reduction).  Values: thread (grp, e) with grp = tid / d,
// e = tid % d accumulates tokens grp, grp + ngroups, ... of the tile
// (ngroups = MR_ATT_THREADS / d; coalesced row reads), groups summed at the end.
// ---------------------------------------------------------------------------
template <typename Tag>
__device__ __forceinline__ void attend_partial_impl(
    const float* __restrict__ q, const typename Tag::S* __restrict__ K, long long k_s0, long long k_s1,
    const typename Tag::S* __restrict__ V, long long v_s0, long long v_s1, const int* __restrict__ q_to_kv,
    const unsigned char* __restrict__ valid, int has_valid, int n, int d, int tokens_per_split,
    float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    MR_DYN_SMEM(smem);
    __shared__ float scratch[64];
    const int tid = threadIdx.x;
    const int h = blockIdx.y;
    const int Hq = gridDim.y;
    const int kv = q_to_kv[h];
    float* qs = smem;                 // [d]
    float* ps = smem + d;             // [MR_ATT_TILE] scores, then probabilities
    float* red = ps + MR_ATT_TILE;    // [MR_ATT_THREADS] >= ngroups * d
    for (int i = tid; i < d; i += blockDim.x) qs[i] = q[(long long)h * d + i];

    const int lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const int ngroups = blockDim.x / d;  // >= 1 since d <= blockDim.x
    const int grp = tid / d, e = tid - grp * d;
    const bool active = grp < ngroups;
    const typename Tag::S* Kh = K + (long long)kv * k_s0;
    const typename Tag::S* Vh = V + (long long)kv * v_s0;
    const long long start = (long long)blockIdx.x * tokens_per_split;
    const long long end = mr_min_ll(start + tokens_per_split, (long long)n);

    float acc = 0.f, m_run = mr_neg_inf(), l_run = 0.f;
    __syncthreads();  // qs visible
    for (long long t0 = start; t0 < end; t0 += MR_ATT_TILE) {
        const int cnt = (int)mr_min_ll(MR_ATT_TILE, end - t0);
        // 1. scores of the tile; each warp takes MR_ATT_ILP tokens per step
        //    (independent loads in flight).  i0 and i are uniform per warp, so
        //    the shuffles in mr_warp_sum always run with the whole warp.
        for (int i0 = warp; i0 < cnt; i0 += MR_ATT_ILP * nwarps) {
            float s[MR_ATT_ILP];
#pragma unroll
            for (int u = 0; u < MR_ATT_ILP; ++u) s[u] = 0.f;
            for (int x = lane; x < d; x += 32) {
                const float qx = qs[x];
#pragma unroll
                for (int u = 0; u < MR_ATT_ILP; ++u) {
                    const int i = i0 + u * nwarps;
                    if (i < cnt) s[u] = fmaf(qx, Tag::cvt(Kh[(t0 + i) * k_s1 + x]), s[u]);
                }
            }
#pragma unroll
            for (int u = 0; u < MR_ATT_ILP; ++u) {
                const float su = mr_warp_sum(s[u]);
                const int i = i0 + u * nwarps;
                if (lane == 0 && i < cnt) ps[i] = (has_valid && !valid[t0 + i]) ? mr_neg_inf() : su;
            }
        }
        __syncthreads();
        // 2. tile max, rescale of the running state
        float tm = mr_neg_inf();
        for (int i = tid; i < cnt; i += blockDim.x) tm = fmaxf(tm, ps[i]);
        tm = mr_block_max(tm, scratch);
        const float m_new = fmaxf(m_run, tm);
        const bool dead = !(m_new > mr_neg_inf());  // only for -inf / NaN scores
        const float scale = dead ? 0.f : expf(m_run - m_new);  // m_run = -inf -> 0
        // 3. probabilities (in place) and their sum
        float ls = 0.f;
        for (int i = tid; i < cnt; i += blockDim.x) {
            const float p = dead ? 0.f : expf(ps[i] - m_new);
            ps[i] = p;
            ls += p;
        }
        ls = mr_block_sum(ls, scratch);  // its barriers also publish ps
        l_run = l_run * scale + ls;
        if (!dead) m_run = m_new;
        // 4. probability-weighted values
        //    (four independent rows in flight per thread: one dependent load per row was the
        //    kernel's critical path)
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
        if (active) {
            int i = grp;
            for (; i + 3 * ngroups < cnt; i += 4 * ngroups) {
                a0 = fmaf(ps[i], Tag::cvt(Vh[(t0 + i) * v_s1 + e]), a0);
                a1 = fmaf(ps[i + ngroups], Tag::cvt(Vh[(t0 + i + ngroups) * v_s1 + e]), a1);
                a2 = fmaf(ps[i + 2 * ngroups], Tag::cvt(Vh[(t0 + i + 2 * ngroups) * v_s1 + e]), a2);
                a3 = fmaf(ps[i + 3 * ngroups], Tag::cvt(Vh[(t0 + i + 3 * ngroups) * v_s1 + e]), a3);
            }
            for (; i < cnt; i += ngroups) a0 = fmaf(ps[i], Tag::cvt(Vh[(t0 + i) * v_s1 + e]), a0);
        }
        acc = acc * scale + ((a0 + a1) + (a2 + a3));
        __syncthreads();  // ps is overwritten by the next tile
    }
    if (active) red[grp * d + e] = acc;
    __syncthreads();
    mr_write_partial(red, ngroups, d, m_run, l_run, (long long)blockIdx.x * Hq + h, o_part, m_part, l_part);
}

// valid: uint8 [>= n], read only when has_valid (0: the slot holds no token, e.g. a ring slot
// emptied by a truncate); such tokens score -inf.  Without it every token in [0, n) is live.
extern "C" __global__ void __launch_bounds__(MR_ATT_THREADS)
attend_partial_f32(const float* __restrict__ q, const float* __restrict__ K, long long k_s0, long long k_s1,
                   const float* __restrict__ V, long long v_s0, long long v_s1, const int* __restrict__ q_to_kv,
                   const unsigned char* __restrict__ valid, int has_valid, int n, int d, int tokens_per_split,
                   float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    attend_partial_impl<MrF32>(q, K, k_s0, k_s1, V, v_s0, v_s1, q_to_kv, valid, has_valid, n, d, tokens_per_split,
                              o_part, m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_ATT_THREADS)
attend_partial_f16(const float* __restrict__ q, const unsigned short* __restrict__ K, long long k_s0, long long k_s1,
                   const unsigned short* __restrict__ V, long long v_s0, long long v_s1, const int* __restrict__ q_to_kv,
                   const unsigned char* __restrict__ valid, int has_valid, int n, int d, int tokens_per_split,
                   float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    attend_partial_impl<MrF16>(q, K, k_s0, k_s1, V, v_s0, v_s1, q_to_kv, valid, has_valid, n, d, tokens_per_split,
                              o_part, m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_ATT_THREADS)
attend_partial_bf16(const float* __restrict__ q, const unsigned short* __restrict__ K, long long k_s0, long long k_s1,
                    const unsigned short* __restrict__ V, long long v_s0, long long v_s1, const int* __restrict__ q_to_kv,
                    const unsigned char* __restrict__ valid, int has_valid, int n, int d, int tokens_per_split,
                    float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    attend_partial_impl<MrBF16>(q, K, k_s0, k_s1, V, v_s0, v_s1, q_to_kv, valid, has_valid, n, d, tokens_per_split,
                               o_part, m_part, l_part);
}

// ---------------------------------------------------------------------------
// attend_gqa: attend_partial's result for a GQA group at once: one block per (split, kv head),
// its G = Hq / Hkv query heads h = kv G + g (G <= MAXG) reading each key and value row once (G
// times fewer bytes than a block per query head), without barriers in the token loop.
//
// Lanes: a token is LPT = d / 8 consecutive lanes, each holding 8 of its d elements (one 16-byte
// load of a bfloat16 / float16 row slice); a warp takes TPW = 32 / LPT tokens a step, MR_GQA_U
// steps' rows loaded before any is used. Each token slot keeps its own online softmax (m, l, the
// unnormalized value sum) per head; the slots are merged by shuffles, the warps through shared
// memory, and the block writes the normalized partials o_part[split, h], m_part, l_part (the layout
// lse_merge_staged reads, as attend_partial). Empty ranges and masked tokens as attend_partial.
//
// Launch: block MR_GQA_THREADS, grid (nsplit, Hkv), d = 8 * 2^k <= 256, K and V rows 16-byte
// aligned (row strides multiples of 8 elements), q [Hq, d] pre-scaled.
// ---------------------------------------------------------------------------
#define MR_GQA_THREADS 128
#define MR_GQA_U 4

struct MrLoad8F32 {
    typedef float S;
    static __device__ __forceinline__ void load8(const float* p, float* x) {
        const MrVec16 a = *reinterpret_cast<const MrVec16*>(p);
        const MrVec16 b = *reinterpret_cast<const MrVec16*>(p + 4);
        x[0] = __uint_as_float(a.a), x[1] = __uint_as_float(a.b), x[2] = __uint_as_float(a.c), x[3] = __uint_as_float(a.d);
        x[4] = __uint_as_float(b.a), x[5] = __uint_as_float(b.b), x[6] = __uint_as_float(b.c), x[7] = __uint_as_float(b.d);
    }
};
template <typename Tag>
struct MrLoad8B16 {
    typedef unsigned short S;
    static __device__ __forceinline__ void load8(const unsigned short* p, float* x) {
        const MrVec16 v = *reinterpret_cast<const MrVec16*>(p);
        const unsigned int w[4] = {v.a, v.b, v.c, v.d};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            x[2 * j] = Tag::cvt((unsigned short)(w[j] & 0xffffu));
            x[2 * j + 1] = Tag::cvt((unsigned short)(w[j] >> 16));
        }
    }
};

template <typename Ld, int MAXG>
__device__ __forceinline__ void attend_gqa_impl(
    const float* __restrict__ q, const typename Ld::S* __restrict__ K, long long k_s0, long long k_s1,
    const typename Ld::S* __restrict__ V, long long v_s0, long long v_s1, int G,
    const unsigned char* __restrict__ valid, int has_valid, int n, int d, int tokens_per_split,
    float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    __shared__ float st[MR_GQA_THREADS / 32][MAXG][2];   // per warp and head: m, l
    MR_DYN_SMEM(smem);                                    // [nwarps][MAXG][d]: value sums
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int lpt = d >> 3, tpw = 32 / lpt;
    const int slot = lane / lpt, x0 = (lane - slot * lpt) * 8;
    const int kv = blockIdx.y, Hq = gridDim.y * G;
    const long long start = (long long)blockIdx.x * tokens_per_split;
    const long long end = mr_min_ll(start + tokens_per_split, (long long)n);
    const typename Ld::S* Kh = K + (long long)kv * k_s0 + x0;
    const typename Ld::S* Vh = V + (long long)kv * v_s0 + x0;

    float qr[MAXG][8], acc[MAXG][8], m[MAXG], l[MAXG];
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        m[g] = mr_neg_inf(), l[g] = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            qr[g][j] = g < G ? q[(long long)(kv * G + g) * d + x0 + j] : 0.f;
            acc[g][j] = 0.f;
        }
    }
    const long long step = (long long)nwarps * tpw * MR_GQA_U;
    for (long long t0 = start + (long long)warp * tpw * MR_GQA_U + slot; t0 - slot < end; t0 += step) {
        float kx[MR_GQA_U][8], vx[MR_GQA_U][8];
        bool ok[MR_GQA_U];
#pragma unroll
        for (int u = 0; u < MR_GQA_U; ++u) {   // every load of the step in flight before the first use
            const long long t = t0 + u * tpw;
            ok[u] = t < end && (!has_valid || valid[t]);
            if (ok[u]) {
                Ld::load8(Kh + t * k_s1, kx[u]);
                Ld::load8(Vh + t * v_s1, vx[u]);
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) kx[u][j] = vx[u][j] = 0.f;
            }
        }
#pragma unroll
        for (int g = 0; g < MAXG; ++g) {
            if (g >= G) break;   // (uniform)
            float s[MR_GQA_U];
            float mx = m[g];
#pragma unroll
            for (int u = 0; u < MR_GQA_U; ++u) {
                float p = 0.f;
#pragma unroll
                for (int j = 0; j < 8; ++j) p = fmaf(qr[g][j], kx[u][j], p);
                for (int o = 1; o < lpt; o <<= 1) p += __shfl_xor_sync(MR_FULL_MASK, p, o);
                s[u] = ok[u] ? p : mr_neg_inf();
                mx = fmaxf(mx, s[u]);
            }
            if (mx == mr_neg_inf()) continue;   // nothing live yet in this slot (uniform per slot)
            const float sc = expf(m[g] - mx);   // m = -inf -> 0
            float ls = 0.f, pu[MR_GQA_U];
#pragma unroll
            for (int u = 0; u < MR_GQA_U; ++u) ls += (pu[u] = expf(s[u] - mx));
            l[g] = l[g] * sc + ls;
            m[g] = mx;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                float a = acc[g][j] * sc;
#pragma unroll
                for (int u = 0; u < MR_GQA_U; ++u) a = fmaf(pu[u], vx[u][j], a);
                acc[g][j] = a;
            }
        }
    }
    // merge the warp's token slots (lanes x0 equal, slot differs: xor of multiples of lpt)
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        if (g >= G) break;
        for (int o = lpt; o < 32; o <<= 1) {
            const float m2 = __shfl_xor_sync(MR_FULL_MASK, m[g], o);
            const float l2 = __shfl_xor_sync(MR_FULL_MASK, l[g], o);
            const float mn = fmaxf(m[g], m2);
            const float a = mn == mr_neg_inf() ? 0.f : expf(m[g] - mn);
            const float b = mn == mr_neg_inf() ? 0.f : expf(m2 - mn);
            l[g] = l[g] * a + l2 * b;
            m[g] = mn;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float a2 = __shfl_xor_sync(MR_FULL_MASK, acc[g][j], o);
                acc[g][j] = acc[g][j] * a + a2 * b;
            }
        }
        if (slot == 0) {
#pragma unroll
            for (int j = 0; j < 8; ++j) smem[((long long)warp * MAXG + g) * d + x0 + j] = acc[g][j];
            if (lane == 0) st[warp][g][0] = m[g], st[warp][g][1] = l[g];
        }
    }
    __syncthreads();
    // merge the warps: thread (g, x) over the G d outputs
    for (int i = threadIdx.x; i < G * d; i += blockDim.x) {
        const int g = i / d, x = i - g * d;
        float M = mr_neg_inf();
        for (int w = 0; w < nwarps; ++w) M = fmaxf(M, st[w][g][0]);
        float L = 0.f, O = 0.f;
        if (M > mr_neg_inf()) {
            for (int w = 0; w < nwarps; ++w) {
                const float e = expf(st[w][g][0] - M);
                L = fmaf(st[w][g][1], e, L);
                O = fmaf(smem[((long long)w * MAXG + g) * d + x], e, O);
            }
        }
        const bool empty = !(L > 0.f);
        const long long h = (long long)blockIdx.x * Hq + kv * G + g;
        o_part[h * d + x] = empty ? 0.f : O / L;
        if (x == 0) {
            m_part[h] = empty ? mr_neg_inf() : M;
            l_part[h] = empty ? 0.f : L;
        }
    }
}

typedef MrLoad8B16<MrF16> MrLoad8F16;
typedef MrLoad8B16<MrBF16> MrLoad8BF16;

// (the parameter lists are written out, not made by a macro: the tests' emulator reads the kernels'
// signatures from this text)

extern "C" __global__ void __launch_bounds__(MR_GQA_THREADS)
attend_gqa_f32_g4(const float* __restrict__ q, const float* __restrict__ K, long long k_s0, long long k_s1,
                   const float* __restrict__ V, long long v_s0, long long v_s1, int G,
                   const unsigned char* __restrict__ valid, int has_valid, int n, int d, int tokens_per_split,
                   float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    attend_gqa_impl<MrLoad8F32, 4>(q, K, k_s0, k_s1, V, v_s0, v_s1, G, valid, has_valid, n, d, tokens_per_split, o_part,
                               m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GQA_THREADS)
attend_gqa_f32_g8(const float* __restrict__ q, const float* __restrict__ K, long long k_s0, long long k_s1,
                   const float* __restrict__ V, long long v_s0, long long v_s1, int G,
                   const unsigned char* __restrict__ valid, int has_valid, int n, int d, int tokens_per_split,
                   float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    attend_gqa_impl<MrLoad8F32, 8>(q, K, k_s0, k_s1, V, v_s0, v_s1, G, valid, has_valid, n, d, tokens_per_split, o_part,
                               m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GQA_THREADS)
attend_gqa_f16_g4(const float* __restrict__ q, const unsigned short* __restrict__ K, long long k_s0, long long k_s1,
                   const unsigned short* __restrict__ V, long long v_s0, long long v_s1, int G,
                   const unsigned char* __restrict__ valid, int has_valid, int n, int d, int tokens_per_split,
                   float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    attend_gqa_impl<MrLoad8F16, 4>(q, K, k_s0, k_s1, V, v_s0, v_s1, G, valid, has_valid, n, d, tokens_per_split, o_part,
                               m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GQA_THREADS)
attend_gqa_f16_g8(const float* __restrict__ q, const unsigned short* __restrict__ K, long long k_s0, long long k_s1,
                   const unsigned short* __restrict__ V, long long v_s0, long long v_s1, int G,
                   const unsigned char* __restrict__ valid, int has_valid, int n, int d, int tokens_per_split,
                   float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    attend_gqa_impl<MrLoad8F16, 8>(q, K, k_s0, k_s1, V, v_s0, v_s1, G, valid, has_valid, n, d, tokens_per_split, o_part,
                               m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GQA_THREADS)
attend_gqa_bf16_g4(const float* __restrict__ q, const unsigned short* __restrict__ K, long long k_s0, long long k_s1,
                   const unsigned short* __restrict__ V, long long v_s0, long long v_s1, int G,
                   const unsigned char* __restrict__ valid, int has_valid, int n, int d, int tokens_per_split,
                   float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    attend_gqa_impl<MrLoad8BF16, 4>(q, K, k_s0, k_s1, V, v_s0, v_s1, G, valid, has_valid, n, d, tokens_per_split, o_part,
                               m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GQA_THREADS)
attend_gqa_bf16_g8(const float* __restrict__ q, const unsigned short* __restrict__ K, long long k_s0, long long k_s1,
                   const unsigned short* __restrict__ V, long long v_s0, long long v_s1, int G,
                   const unsigned char* __restrict__ valid, int has_valid, int n, int d, int tokens_per_split,
                   float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    attend_gqa_impl<MrLoad8BF16, 8>(q, K, k_s0, k_s1, V, v_s0, v_s1, G, valid, has_valid, n, d, tokens_per_split, o_part,
                               m_part, l_part);
}
