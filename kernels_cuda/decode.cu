// decode.cu -- the glue of one HCA decode step on the GPU (minirun/kv/hca_cuda.py), each in one
// launch where torch took several ops: on an H100 a layer's step was bound by launches and Python
// (docs/PROFILE.md), not by the GPU.
//
//   decode_prep_*       the step's queries (scaled; turned for far positions), the new token's k, v
//                       copied into the exact tier's spare row, the selection histogram zeroed
//   pack_selection_*    the copy-back block [counts | idx[:, :w] | z at idx] for the host value sum
//   lse_merge_staged_*  the merge of P device partials and the host's staged (o, m, l), written in
//                       the model's dtype
//   store_rows_*        a captured token's eviction: the leaving token's values into the (mapped
//                       host) value pool at a row read from device memory
// (gather.cu: the GPU's own value sum, which replaces the copy-back and the host's sum.)
//
// Compiled without --use_fast_math (-inf handling in the merge).

#include "common.cuh"

#define MR_PREP_THREADS 128
#define MR_PACK_THREADS 256
#define MR_MERGE_THREADS 128

__device__ __forceinline__ void mr_store(float* p, float x) { *p = x; }

// float32 -> bfloat16 bits, round to nearest even (as torch's .to(torch.bfloat16)); NaN stays NaN.
__device__ __forceinline__ void mr_store(unsigned short* p, float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        *p = (unsigned short)((u >> 16) | 0x40u);
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    *p = (unsigned short)(u >> 16);
}

// ---------------------------------------------------------------------------
// decode_prep: block b < Hq: query head b -> qs[b] = q[b] * scale and, when has_far, qf[b] = qs[b]
// turned by the angles cs = [cos (d/2) | sin (d/2)] in HF Llama's half split
// ([x1 c - x2 s, x2 c + x1 s]); block Hq + j: k[j] -> k_slot[j]; block Hq + Hkv + j: v[j] -> v_slot[j]
// (raw element copies, same dtype).  Every block also zeroes its share of zero[0:n_zero].
// has_rope (float32 / bfloat16 only): q and k come before RoPE and are turned first by rope = the
// position's [cos | sin] in their dtype, rounded where kernels_cuda/layer.cu's rope_ rounds.
// Launch: block MR_PREP_THREADS, grid (Hq + 2 Hkv).  d even.  qf is not written without has_far.
// ---------------------------------------------------------------------------
template <typename Tag> struct MrRopeRound { static constexpr bool ok = false; };
template <> struct MrRopeRound<MrF32> : MrRoundF32 { static constexpr bool ok = true; };
template <> struct MrRopeRound<MrBF16> : MrRoundBF16 { static constexpr bool ok = true; };

// Element i of head row x (d elements): as it is, or turned by rope (the pair (f, f + d/2) it
// belongs to, rounded as rope_ rounds); `other` gets the pair's other element the same way.
template <typename Tag>
__device__ __forceinline__ float mr_prep_elem(const typename Tag::S* x, int i, int d, const typename Tag::S* rope,
                                              float& other) {
    const int half = d / 2;
    const bool lo = i < half;
    const int f = lo ? i : i - half;
    const float x1 = Tag::cvt(x[f]), x2 = Tag::cvt(x[f + half]);
    float r1 = x1, r2 = x2;
    if constexpr (MrRopeRound<Tag>::ok) {
        if (rope != nullptr) mr_rope_pair<MrRopeRound<Tag>>(x1, x2, Tag::cvt(rope[f]), Tag::cvt(rope[half + f]), r1, r2);
    }
    other = lo ? r2 : r1;
    return lo ? r1 : r2;
}

template <typename Tag>
__device__ __forceinline__ void decode_prep_impl(
    const typename Tag::S* __restrict__ q, long long q_s0, const typename Tag::S* __restrict__ k, long long k_s0,
    const typename Tag::S* __restrict__ v, long long v_s0, float scale, const float* __restrict__ cs, int has_far,
    const typename Tag::S* __restrict__ rope_cs, int has_rope, int Hq, int Hkv, int d, float* __restrict__ qs,
    float* __restrict__ qf, typename Tag::S* __restrict__ k_slot, long long ks_s0, typename Tag::S* __restrict__ v_slot,
    long long vs_s0, float* __restrict__ zero, long long n_zero) {
    const int b = blockIdx.x;
    const typename Tag::S* rope = has_rope ? rope_cs : nullptr;
    if (b < Hq) {
        const int half = d / 2;
        const typename Tag::S* qh = q + (long long)b * q_s0;
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            float y;
            const float x = mr_prep_elem<Tag>(qh, i, d, rope, y) * scale;
            qs[(long long)b * d + i] = x;
            if (has_far) {
                y *= scale;   // the pair's other half
                const bool lo = i < half;
                const int f = lo ? i : i - half;
                const float c = cs[f], s = cs[half + f];
                qf[(long long)b * d + i] = lo ? x * c - y * s : x * c + y * s;
            }
        }
    } else if (b < Hq + Hkv) {
        const int j = b - Hq;
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            if constexpr (MrRopeRound<Tag>::ok) {
                if (rope != nullptr) {   // (the rounded value's bits: mr_store rounds no further)
                    float y;
                    mr_store(k_slot + j * ks_s0 + i, mr_prep_elem<Tag>(k + j * k_s0, i, d, rope, y));
                    continue;
                }
            }
            k_slot[j * ks_s0 + i] = k[j * k_s0 + i];
        }
    } else if (b < Hq + 2 * Hkv) {
        const int j = b - Hq - Hkv;
        for (int i = threadIdx.x; i < d; i += blockDim.x) v_slot[j * vs_s0 + i] = v[j * v_s0 + i];
    }
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)b * blockDim.x + threadIdx.x; i < n_zero; i += stride) zero[i] = 0.f;
}

extern "C" __global__ void __launch_bounds__(MR_PREP_THREADS)
decode_prep_f32(const float* __restrict__ q, long long q_s0, const float* __restrict__ k, long long k_s0,
               const float* __restrict__ v, long long v_s0, float scale, const float* __restrict__ cs, int has_far,
               const float* __restrict__ rope_cs, int has_rope, int Hq, int Hkv, int d, float* __restrict__ qs,
               float* __restrict__ qf, float* __restrict__ k_slot, long long ks_s0, float* __restrict__ v_slot,
               long long vs_s0, float* __restrict__ zero, long long n_zero) {
    decode_prep_impl<MrF32>(q, q_s0, k, k_s0, v, v_s0, scale, cs, has_far, rope_cs, has_rope, Hq, Hkv, d, qs, qf, k_slot,
                           ks_s0, v_slot, vs_s0, zero, n_zero);
}

extern "C" __global__ void __launch_bounds__(MR_PREP_THREADS)
decode_prep_f16(const unsigned short* __restrict__ q, long long q_s0, const unsigned short* __restrict__ k, long long k_s0,
               const unsigned short* __restrict__ v, long long v_s0, float scale, const float* __restrict__ cs, int has_far,
               const unsigned short* __restrict__ rope_cs, int has_rope, int Hq, int Hkv, int d, float* __restrict__ qs,
               float* __restrict__ qf, unsigned short* __restrict__ k_slot, long long ks_s0, unsigned short* __restrict__ v_slot,
               long long vs_s0, float* __restrict__ zero, long long n_zero) {
    decode_prep_impl<MrF16>(q, q_s0, k, k_s0, v, v_s0, scale, cs, has_far, rope_cs, has_rope, Hq, Hkv, d, qs, qf, k_slot,
                           ks_s0, v_slot, vs_s0, zero, n_zero);
}

extern "C" __global__ void __launch_bounds__(MR_PREP_THREADS)
decode_prep_bf16(const unsigned short* __restrict__ q, long long q_s0, const unsigned short* __restrict__ k, long long k_s0,
                const unsigned short* __restrict__ v, long long v_s0, float scale, const float* __restrict__ cs, int has_far,
                const unsigned short* __restrict__ rope_cs, int has_rope, int Hq, int Hkv, int d, float* __restrict__ qs,
                float* __restrict__ qf, unsigned short* __restrict__ k_slot, long long ks_s0, unsigned short* __restrict__ v_slot,
                long long vs_s0, float* __restrict__ zero, long long n_zero) {
    decode_prep_impl<MrBF16>(q, q_s0, k, k_s0, v, v_s0, scale, cs, has_far, rope_cs, has_rope, Hq, Hkv, d, qs, qf, k_slot,
                            ks_s0, v_slot, vs_s0, zero, n_zero);
}

// ---------------------------------------------------------------------------
// pack_selection: head h = blockIdx.x of Hq = gridDim.x; c = min(counts[h], cap)
//   pack[h]                        = c
//   pack[Hq + h w + t]             = j = idx[h, t] clamped to [0, n - 1]     for t < min(c, w)
//   pack[Hq + Hq w + h w + t]      = the bits of z[h, j]                    for t < min(c, w)
// Entries t >= min(c, w) are not written (the host reads the first c; c > w means "copy wider").
// Launch: block MR_PACK_THREADS, grid (Hq).  n >= 1.
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(MR_PACK_THREADS)
pack_selection_i32(const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z, long long z_s0,
                   const int* __restrict__ counts, int cap, int n, int w, int* __restrict__ pack) {
    const int h = blockIdx.x;
    const int Hq = gridDim.x;
    const int c = counts[h] < cap ? counts[h] : cap;
    if (threadIdx.x == 0) pack[h] = c;
    const int m = c < w ? c : w;
    const int* ih = idx + (long long)h * idx_s0;
    const float* zh = z + (long long)h * z_s0;
    int* pi = pack + Hq + (long long)h * w;
    int* pz = pack + Hq + (long long)Hq * w + (long long)h * w;
    for (int t = threadIdx.x; t < m; t += blockDim.x) {
        long long j = (long long)ih[t];
        j = j < 0 ? 0 : (j >= n ? n - 1 : j);
        pi[t] = (int)j;
        pz[t] = __float_as_int(zh[j]);
    }
}

// ---------------------------------------------------------------------------
// lse_merge_staged: the LSE merge of P device parts os [P, Hq, d], ms, ls [P, Hq]
// plus one more part staged by the host, stage [Hq, d + 2] (row h: o[0:d] | m | l), writing only the
// merged output o [Hq, d], in float32 or bfloat16 bits.  Empty parts (!(l > 0) or m = -inf) are
// skipped, their o never read; none live -> o = 0.  Launch: block MR_MERGE_THREADS, grid (Hq).
// ---------------------------------------------------------------------------
template <typename Out>
__device__ __forceinline__ void lse_merge_staged_impl(const float* __restrict__ os, const float* __restrict__ ms,
                                                      const float* __restrict__ ls, int P,
                                                      const float* __restrict__ stage, int Hq, int d,
                                                      Out* __restrict__ o) {
    // The parts' (m, l) are reduced by the whole block (one pass each: M, then L), their weights
    // exp(m - M) l / L go to shared memory a chunk at a time, and thread (sub, x) sums the parts
    // sub, sub + nsub, ... of element x, four at a time: independent loads in flight, no expf per
    // element (a serial loop over the parts per element was ~50 us at P ~ 60 on an H100).
    __shared__ float scratch[64];
    __shared__ float w[MR_MERGE_THREADS];
    __shared__ float red[MR_MERGE_THREADS];
    const int h = blockIdx.x, tid = threadIdx.x;
    const float* st = stage + (long long)h * (d + 2);
    const int parts = P + 1;  // the device parts, then the staged one
    float M = mr_neg_inf();
    for (int p = tid; p < parts; p += blockDim.x) {
        const float mp = p < P ? ms[(long long)p * Hq + h] : st[d];
        const float lp = p < P ? ls[(long long)p * Hq + h] : st[d + 1];
        if (lp > 0.f && mp > mr_neg_inf()) M = fmaxf(M, mp);
    }
    M = mr_block_max(M, scratch);
    float L = 0.f;
    if (M > mr_neg_inf())
        for (int p = tid; p < parts; p += blockDim.x) {
            const float mp = p < P ? ms[(long long)p * Hq + h] : st[d];
            const float lp = p < P ? ls[(long long)p * Hq + h] : st[d + 1];
            if (lp > 0.f && mp > mr_neg_inf()) L += expf(mp - M) * lp;
        }
    L = mr_block_sum(L, scratch);
    const bool live = M > mr_neg_inf() && L > 0.f;
    const int nsub = d < (int)blockDim.x ? (int)blockDim.x / d : 1;
    const int sub = tid / d < nsub ? tid / d : nsub;  // sub == nsub: idle in the sums
    for (int x0 = 0; x0 < d; x0 += blockDim.x) {
        const int x = x0 + (nsub > 1 ? tid - sub * d : tid);
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
        for (int c0 = 0; live && c0 < parts; c0 += blockDim.x) {
            const int cnt = (int)mr_min_ll(blockDim.x, parts - c0);
            __syncthreads();  // the previous chunk's weights are read
            if (tid < cnt) {
                const int p = c0 + tid;
                const float mp = p < P ? ms[(long long)p * Hq + h] : st[d];
                const float lp = p < P ? ls[(long long)p * Hq + h] : st[d + 1];
                w[tid] = (lp > 0.f && mp > mr_neg_inf()) ? expf(mp - M) * lp / L : 0.f;
            }
            __syncthreads();
            if (sub < nsub && x < d) {
                int i = sub;
                for (; i + 3 * nsub < cnt; i += 4 * nsub) {
                    const int p = c0 + i;  // a part of weight 0 may hold garbage: never multiply it in
                    const float o0 = w[i] != 0.f ? (p < P ? os[((long long)p * Hq + h) * d + x] : st[x]) : 0.f;
                    const float o1 = w[i + nsub] != 0.f
                        ? (p + nsub < P ? os[((long long)(p + nsub) * Hq + h) * d + x] : st[x]) : 0.f;
                    const float o2 = w[i + 2 * nsub] != 0.f
                        ? (p + 2 * nsub < P ? os[((long long)(p + 2 * nsub) * Hq + h) * d + x] : st[x]) : 0.f;
                    const float o3 = w[i + 3 * nsub] != 0.f
                        ? (p + 3 * nsub < P ? os[((long long)(p + 3 * nsub) * Hq + h) * d + x] : st[x]) : 0.f;
                    a0 = fmaf(w[i], o0, a0);
                    a1 = fmaf(w[i + nsub], o1, a1);
                    a2 = fmaf(w[i + 2 * nsub], o2, a2);
                    a3 = fmaf(w[i + 3 * nsub], o3, a3);
                }
                for (; i < cnt; i += nsub) {
                    const int p = c0 + i;
                    if (w[i] != 0.f) a0 = fmaf(w[i], p < P ? os[((long long)p * Hq + h) * d + x] : st[x], a0);
                }
            }
        }
        __syncthreads();
        if (sub < nsub) red[tid] = (a0 + a1) + (a2 + a3);
        __syncthreads();
        if (sub == 0 && x < d) {
            float acc = red[tid];
            for (int s2 = 1; s2 < nsub; ++s2) acc += red[s2 * d + tid];
            mr_store(o + (long long)h * d + x, live ? acc : 0.f);
        }
    }
}

extern "C" __global__ void __launch_bounds__(MR_MERGE_THREADS)
lse_merge_staged_f32(const float* __restrict__ os, const float* __restrict__ ms, const float* __restrict__ ls,
                     int P, const float* __restrict__ stage, int Hq, int d, float* __restrict__ o) {
    lse_merge_staged_impl<float>(os, ms, ls, P, stage, Hq, d, o);
}

extern "C" __global__ void __launch_bounds__(MR_MERGE_THREADS)
lse_merge_staged_bf16(const float* __restrict__ os, const float* __restrict__ ms, const float* __restrict__ ls,
                      int P, const float* __restrict__ stage, int Hq, int d, unsigned short* __restrict__ o) {
    lse_merge_staged_impl<unsigned short>(os, ms, ls, P, stage, Hq, d, o);
}

// ---------------------------------------------------------------------------
// store_rows: block r -> dst[r * d_s0 + j * d_s1 + e] = src[r * s_s0 + e] for e < d, j = row[0]: the
// values of the token leaving the ring (all layers and kv heads, R = L Hkv rows) into the value pool
// at the store row a captured decode token reads from device memory (minirun/kv/hca_graph.py); dst
// may be mapped host memory (the pool).  Raw element copies: b16 for bfloat16 / float16, b32 for
// float32.  Launch: block MR_PREP_THREADS, grid (R).
// ---------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ void store_rows_impl(const T* __restrict__ src, long long s_s0, const int* __restrict__ row,
                                                T* __restrict__ dst, long long d_s0, long long d_s1, int d) {
    const long long r = blockIdx.x;
    const long long j = row[0];
    for (int e = threadIdx.x; e < d; e += blockDim.x) dst[r * d_s0 + j * d_s1 + e] = src[r * s_s0 + e];
}

extern "C" __global__ void __launch_bounds__(MR_PREP_THREADS)
store_rows_b16(const unsigned short* __restrict__ src, long long s_s0, const int* __restrict__ row,
               unsigned short* __restrict__ dst, long long d_s0, long long d_s1, int d) {
    store_rows_impl<unsigned short>(src, s_s0, row, dst, d_s0, d_s1, d);
}

extern "C" __global__ void __launch_bounds__(MR_PREP_THREADS)
store_rows_b32(const float* __restrict__ src, long long s_s0, const int* __restrict__ row, float* __restrict__ dst,
               long long d_s0, long long d_s1, int d) {
    store_rows_impl<float>(src, s_s0, row, dst, d_s0, d_s1, d);
}
