// decode.cu -- the glue of one HCA decode step on the GPU (minirun/kv/hca_cuda.py), each in one
// launch where torch took several ops: on an H100 a layer's step was bound by launches and Python
// (docs/BENCHMARKS.md, twelfth session), not by the GPU.
//
//   decode_prep_*       the step's queries (scaled; turned for far positions), the new token's k, v
//                       copied into the exact tier's spare row, the selection histogram zeroed
//   pack_selection_*    the copy-back block [counts | idx[:, :w] | z at idx] for the host value sum
//   lse_merge_staged_*  the merge of P device partials and the host's staged (o, m, l), written in
//                       the model's dtype
//   gather_value_sum_*  the store's weighted value sum read by the GPU itself from the host value
//                       pool (pinned and mapped): no copy-back, no host sum, no host wait
//   gather_value_sum_grouped_*  the same, each row read once per kv group (GQA heads overlap)
//
// Compiled without --use_fast_math (-inf handling in the merge).

#include "common.cuh"

#define MR_PREP_THREADS 128
#define MR_PACK_THREADS 256
#define MR_MERGE_THREADS 128
#define MR_GATHER_THREADS 256
#define MR_GATHER_TILE 256   // tokens whose (row, weight) a block stages in shared memory at a time
#define MR_GATHER_ILP 4      // value rows in flight per thread (each read crosses the host bus)
#define MR_GATHER_MAX_GROUP 8   // query heads per kv head the grouped gather takes
#define MR_GROUP_TILE 128       // its tile (its shared memory holds a weight per head and token)

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
// Launch: block MR_PREP_THREADS, grid (Hq + 2 Hkv).  d even.  qf is not written without has_far.
// ---------------------------------------------------------------------------
template <typename Tag>
__device__ __forceinline__ void decode_prep_impl(
    const typename Tag::S* __restrict__ q, long long q_s0, const typename Tag::S* __restrict__ k, long long k_s0,
    const typename Tag::S* __restrict__ v, long long v_s0, float scale, const float* __restrict__ cs, int has_far,
    int Hq, int Hkv, int d, float* __restrict__ qs, float* __restrict__ qf, typename Tag::S* __restrict__ k_slot,
    long long ks_s0, typename Tag::S* __restrict__ v_slot, long long vs_s0, float* __restrict__ zero,
    long long n_zero) {
    const int b = blockIdx.x;
    if (b < Hq) {
        const int half = d / 2;
        const typename Tag::S* qh = q + (long long)b * q_s0;
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            const float x = Tag::cvt(qh[i]) * scale;
            qs[(long long)b * d + i] = x;
            if (has_far) {
                const bool lo = i < half;
                const int f = lo ? i : i - half;
                const float y = Tag::cvt(qh[lo ? i + half : i - half]) * scale;   // the pair's other half
                const float c = cs[f], s = cs[half + f];
                qf[(long long)b * d + i] = lo ? x * c - y * s : x * c + y * s;
            }
        }
    } else if (b < Hq + Hkv) {
        const int j = b - Hq;
        for (int i = threadIdx.x; i < d; i += blockDim.x) k_slot[j * ks_s0 + i] = k[j * k_s0 + i];
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
                int Hq, int Hkv, int d, float* __restrict__ qs, float* __restrict__ qf, float* __restrict__ k_slot,
                long long ks_s0, float* __restrict__ v_slot, long long vs_s0, float* __restrict__ zero,
                long long n_zero) {
    decode_prep_impl<MrF32>(q, q_s0, k, k_s0, v, v_s0, scale, cs, has_far, Hq, Hkv, d, qs, qf, k_slot, ks_s0, v_slot,
                          vs_s0, zero, n_zero);
}

extern "C" __global__ void __launch_bounds__(MR_PREP_THREADS)
decode_prep_f16(const unsigned short* __restrict__ q, long long q_s0, const unsigned short* __restrict__ k, long long k_s0,
                const unsigned short* __restrict__ v, long long v_s0, float scale, const float* __restrict__ cs, int has_far,
                int Hq, int Hkv, int d, float* __restrict__ qs, float* __restrict__ qf, unsigned short* __restrict__ k_slot,
                long long ks_s0, unsigned short* __restrict__ v_slot, long long vs_s0, float* __restrict__ zero,
                long long n_zero) {
    decode_prep_impl<MrF16>(q, q_s0, k, k_s0, v, v_s0, scale, cs, has_far, Hq, Hkv, d, qs, qf, k_slot, ks_s0, v_slot,
                          vs_s0, zero, n_zero);
}

extern "C" __global__ void __launch_bounds__(MR_PREP_THREADS)
decode_prep_bf16(const unsigned short* __restrict__ q, long long q_s0, const unsigned short* __restrict__ k, long long k_s0,
                 const unsigned short* __restrict__ v, long long v_s0, float scale, const float* __restrict__ cs, int has_far,
                 int Hq, int Hkv, int d, float* __restrict__ qs, float* __restrict__ qf, unsigned short* __restrict__ k_slot,
                 long long ks_s0, unsigned short* __restrict__ v_slot, long long vs_s0, float* __restrict__ zero,
                 long long n_zero) {
    decode_prep_impl<MrBF16>(q, q_s0, k, k_s0, v, v_s0, scale, cs, has_far, Hq, Hkv, d, qs, qf, k_slot, ks_s0, v_slot,
                          vs_s0, zero, n_zero);
}

// ---------------------------------------------------------------------------
// pack_selection: head h = blockIdx.x of Hq = gridDim.x; c = min(counts[h], cap)
//   pack[h]                        = c
//   pack[Hq + h w + t]             = j = idx[h, t] clamped to [0, n - 1]     for t < min(c, w)
//   pack[Hq + Hq w + h w + t]      = the bits of z[h, j]                    for t < min(c, w)
// Entries t >= min(c, w) are not written (the host reads the first c; c > w means "copy wider").
// Launch: block MR_PACK_THREADS, grid (Hq).  n >= 1.
// ---------------------------------------------------------------------------
template <typename I>
__device__ __forceinline__ void pack_selection_impl(const I* __restrict__ idx, long long idx_s0,
                                                    const float* __restrict__ z, long long z_s0,
                                                    const int* __restrict__ counts, int cap, int n, int w,
                                                    int* __restrict__ pack) {
    const int h = blockIdx.x;
    const int Hq = gridDim.x;
    const int c = counts[h] < cap ? counts[h] : cap;
    if (threadIdx.x == 0) pack[h] = c;
    const int m = c < w ? c : w;
    const I* ih = idx + (long long)h * idx_s0;
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

extern "C" __global__ void __launch_bounds__(MR_PACK_THREADS)
pack_selection_i32(const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z, long long z_s0,
                   const int* __restrict__ counts, int cap, int n, int w, int* __restrict__ pack) {
    pack_selection_impl<int>(idx, idx_s0, z, z_s0, counts, cap, n, w, pack);
}

extern "C" __global__ void __launch_bounds__(MR_PACK_THREADS)
pack_selection_i64(const long long* __restrict__ idx, long long idx_s0, const float* __restrict__ z,
                   long long z_s0, const int* __restrict__ counts, int cap, int n, int w, int* __restrict__ pack) {
    pack_selection_impl<long long>(idx, idx_s0, z, z_s0, counts, cap, n, w, pack);
}

// ---------------------------------------------------------------------------
// lse_merge_staged: lse_merge_f32 (attention.cu) over P device parts os [P, Hq, d], ms, ls [P, Hq]
// plus one more part staged by the host, stage [Hq, d + 2] (row h: o[0:d] | m | l), writing only the
// merged output o [Hq, d], in float32 or bfloat16 bits.  Empty parts (!(l > 0) or m = -inf) are
// skipped, their o never read; none live -> o = 0.  Launch: block MR_MERGE_THREADS, grid (Hq).
// ---------------------------------------------------------------------------
template <typename Out>
__device__ __forceinline__ void lse_merge_staged_impl(const float* __restrict__ os, const float* __restrict__ ms,
                                                      const float* __restrict__ ls, int P,
                                                      const float* __restrict__ stage, int Hq, int d,
                                                      Out* __restrict__ o) {
    const int h = blockIdx.x;
    const float* st = stage + (long long)h * (d + 2);
    float M = mr_neg_inf();
    for (int p = 0; p <= P; ++p) {
        const float mp = p < P ? ms[(long long)p * Hq + h] : st[d];
        const float lp = p < P ? ls[(long long)p * Hq + h] : st[d + 1];
        if (lp > 0.f && mp > mr_neg_inf()) M = fmaxf(M, mp);
    }
    float L = 0.f;
    if (M > mr_neg_inf()) {
        for (int p = 0; p <= P; ++p) {
            const float mp = p < P ? ms[(long long)p * Hq + h] : st[d];
            const float lp = p < P ? ls[(long long)p * Hq + h] : st[d + 1];
            if (lp > 0.f && mp > mr_neg_inf()) L += expf(mp - M) * lp;
        }
    }
    const bool live = M > mr_neg_inf() && L > 0.f;
    for (int x = threadIdx.x; x < d; x += blockDim.x) {
        float acc = 0.f;
        if (live) {
            for (int p = 0; p <= P; ++p) {
                const float mp = p < P ? ms[(long long)p * Hq + h] : st[d];
                const float lp = p < P ? ls[(long long)p * Hq + h] : st[d + 1];
                if (lp > 0.f && mp > mr_neg_inf()) {
                    const float op = p < P ? os[((long long)p * Hq + h) * d + x] : st[x];
                    acc = fmaf(expf(mp - M) * lp, op, acc);
                }
            }
            acc /= L;
        }
        mr_store(o + (long long)h * d + x, acc);
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
// gather_value_sum: the store's part of a decode step summed on the GPU, reading the value rows
// straight from the host pool V [Hkv, cap, d] (page-locked and mapped: a device address of host
// memory).  Block (s, h) of grid (nsplit, Hq) takes the s-th of nsplit equal shares of the head's
// list t < c = min(counts[h], cap): j = idx[h, t] clamped to [0, n), w = exp(z[h, j] - m[h]) and
//   o_part[s, h] = sum w V[q_to_kv[h], j] / sum w,  m_part[s, h] = m[h],  l_part[s, h] = sum w
// (lse_merge's partial layout [nsplit, Hq, ...]; an empty share, or m[h] = -inf: 0, -inf, 0).
// m[h] is the max of every score z[h, :n] (approx_scores' stats), so no weight exceeds 1.
// Launch: block MR_GATHER_THREADS, grid (nsplit, Hq), d even, 2 <= d <= MR_GATHER_THREADS, V's rows
// aligned to two elements, no dynamic smem.  A tile of MR_GATHER_TILE tokens at a time: thread i
// stages token t0 + i's (row, weight); then thread (grp, e), grp = tid / (d/2), e = 2 (tid % (d/2)),
// sums elements e, e + 1 of rows grp, grp + ngroups, ... (one two-element load each: a row is one
// coalesced read by d/2 threads: 128 B by one warp for SmolLM2's 16-bit rows), MR_GATHER_ILP
// loads issued before their first use.
// ---------------------------------------------------------------------------
template <typename Tag, typename I>
__device__ __forceinline__ void gather_value_sum_impl(
    const I* __restrict__ idx, long long idx_s0, const float* __restrict__ z, long long z_s0,
    const int* __restrict__ counts, int cap, int n, const float* __restrict__ m,
    const typename Tag::S* __restrict__ V, long long v_s0, long long v_s1, const int* __restrict__ q_to_kv, int d,
    float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    __shared__ int js[MR_GATHER_TILE];
    __shared__ float ws[MR_GATHER_TILE];
    __shared__ float red[2 * MR_GATHER_THREADS];   // >= ngroups * d
    __shared__ float scratch[64];
    const int tid = threadIdx.x, h = blockIdx.y, Hq = gridDim.y;
    const int c = counts[h] < cap ? counts[h] : cap;
    const long long share = ((long long)c + gridDim.x - 1) / gridDim.x;
    const long long start = (long long)blockIdx.x * share;
    const long long end = mr_min_ll(start + share, (long long)c);
    const float M = m[h];
    const bool live = M > mr_neg_inf();   // uniform over the block
    const I* ih = idx + (long long)h * idx_s0;
    const float* zh = z + (long long)h * z_s0;
    const typename Tag::S* Vh = V + (long long)q_to_kv[h] * v_s0;
    const int half = d >> 1;
    const int ngroups = blockDim.x / half;
    const int grp = tid / half, e = 2 * (tid - grp * half);
    const bool active = grp < ngroups;
    float acc0 = 0.f, acc1 = 0.f, lsum = 0.f;
    for (long long t0 = start; live && t0 < end; t0 += MR_GATHER_TILE) {
        const int cnt = (int)mr_min_ll(MR_GATHER_TILE, end - t0);
        for (int i = tid; i < cnt; i += blockDim.x) {
            long long j = (long long)ih[t0 + i];
            j = j < 0 ? 0 : (j >= n ? n - 1 : j);
            const float w = expf(zh[j] - M);
            js[i] = (int)j;
            ws[i] = w;
            lsum += w;
        }
        __syncthreads();
        if (active) {
            int i = grp;
            for (; i + (MR_GATHER_ILP - 1) * ngroups < cnt; i += MR_GATHER_ILP * ngroups) {
                float a[MR_GATHER_ILP], b[MR_GATHER_ILP];
#pragma unroll
                for (int u = 0; u < MR_GATHER_ILP; ++u)
                    Tag::load2(Vh + (long long)js[i + u * ngroups] * v_s1 + e, a[u], b[u]);
#pragma unroll
                for (int u = 0; u < MR_GATHER_ILP; ++u) {
                    const float w = ws[i + u * ngroups];
                    acc0 = fmaf(w, a[u], acc0);
                    acc1 = fmaf(w, b[u], acc1);
                }
            }
            for (; i < cnt; i += ngroups) {
                float a, b;
                Tag::load2(Vh + (long long)js[i] * v_s1 + e, a, b);
                acc0 = fmaf(ws[i], a, acc0);
                acc1 = fmaf(ws[i], b, acc1);
            }
        }
        __syncthreads();   // js / ws are overwritten by the next tile
    }
    lsum = mr_block_sum(lsum, scratch);
    if (active) {
        red[grp * d + e] = acc0;
        red[grp * d + e + 1] = acc1;
    }
    __syncthreads();
    mr_write_partial(red, ngroups, d, M, lsum, (long long)blockIdx.x * Hq + h, o_part, m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_f32_i32(const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z, long long z_s0,
    const int* __restrict__ counts, int cap, int n, const float* __restrict__ m, const float* __restrict__ V,
    long long v_s0, long long v_s1, const int* __restrict__ q_to_kv, int d, float* __restrict__ o_part,
    float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_impl<MrF32, int>(idx, idx_s0, z, z_s0, counts, cap, n, m, V, v_s0, v_s1, q_to_kv, d, o_part,
        m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_f32_i64(const long long* __restrict__ idx, long long idx_s0, const float* __restrict__ z, long long z_s0,
    const int* __restrict__ counts, int cap, int n, const float* __restrict__ m, const float* __restrict__ V,
    long long v_s0, long long v_s1, const int* __restrict__ q_to_kv, int d, float* __restrict__ o_part,
    float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_impl<MrF32, long long>(idx, idx_s0, z, z_s0, counts, cap, n, m, V, v_s0, v_s1, q_to_kv, d, o_part,
        m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_f16_i32(const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z, long long z_s0,
    const int* __restrict__ counts, int cap, int n, const float* __restrict__ m, const unsigned short* __restrict__ V,
    long long v_s0, long long v_s1, const int* __restrict__ q_to_kv, int d, float* __restrict__ o_part,
    float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_impl<MrF16, int>(idx, idx_s0, z, z_s0, counts, cap, n, m, V, v_s0, v_s1, q_to_kv, d, o_part,
        m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_f16_i64(const long long* __restrict__ idx, long long idx_s0, const float* __restrict__ z, long long z_s0,
    const int* __restrict__ counts, int cap, int n, const float* __restrict__ m, const unsigned short* __restrict__ V,
    long long v_s0, long long v_s1, const int* __restrict__ q_to_kv, int d, float* __restrict__ o_part,
    float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_impl<MrF16, long long>(idx, idx_s0, z, z_s0, counts, cap, n, m, V, v_s0, v_s1, q_to_kv, d, o_part,
        m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_bf16_i32(const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z, long long z_s0,
    const int* __restrict__ counts, int cap, int n, const float* __restrict__ m, const unsigned short* __restrict__ V,
    long long v_s0, long long v_s1, const int* __restrict__ q_to_kv, int d, float* __restrict__ o_part,
    float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_impl<MrBF16, int>(idx, idx_s0, z, z_s0, counts, cap, n, m, V, v_s0, v_s1, q_to_kv, d, o_part,
        m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_bf16_i64(const long long* __restrict__ idx, long long idx_s0, const float* __restrict__ z, long long z_s0,
    const int* __restrict__ counts, int cap, int n, const float* __restrict__ m, const unsigned short* __restrict__ V,
    long long v_s0, long long v_s1, const int* __restrict__ q_to_kv, int d, float* __restrict__ o_part,
    float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_impl<MrBF16, long long>(idx, idx_s0, z, z_s0, counts, cap, n, m, V, v_s0, v_s1, q_to_kv, d, o_part,
        m_part, l_part);
}

// ---------------------------------------------------------------------------
// gather_value_sum_grouped: gather_value_sum reading each selected row once per kv group (the
// query heads of one kv head select overlapping rows: 1.6x on SmolLM2, docs/DESIGN.md).
// Block (s, k) of grid (nsplit, Hkv) takes the s-th share of the group's entries: the
// concatenation of its heads' lists (heads h = k g .. k g + g - 1, i.e. q_to_kv[h] = h / g; head
// h's list: t < c_h = min(counts[h], cap), j = idx[h, t] clamped to [0, n)).  A head is *shared*
// when counts[h] <= cap: its list is then exactly zcompact's set {j < n : bin(z[h, j]) >= cut[h]}
// (mr_bin over [m[h] - z_range, m[h]], n_bins bins), so membership is a test on z.  Otherwise (its
// top bin alone held more than cap tokens: the list is any cap of them) it sums its own entries
// alone.  An entry (h, j) of a shared head is skipped when a lower shared head of the group
// selects j; else row j is read once and weighted for every shared head at or above h that selects
// it (w = exp(z[h', j] - m[h'])).  Each head's partial lands at o_part[s, h], m_part, l_part as
// gather_value_sum's do (the same merged sums over other splits).  Only for 0 < tau < 1 selections.
// Launch: block MR_GATHER_THREADS, grid (nsplit, Hkv), 1 <= g <= G (the kernel's group size: 3, 4 or
// MR_GATHER_MAX_GROUP; arrays of G in registers), d even, 2 <= d <= MR_GATHER_THREADS, V's rows
// aligned to two elements, no dynamic shared memory.  Per entry the g scores z[h', j] are loaded
// once; a bit mask of the heads that take the row keeps a row a head did not select out of its sum
// (0 * inf would be NaN), and MR_GATHER_ILP owned rows are read at a time.
// ---------------------------------------------------------------------------
template <typename Tag, int G>
__device__ __forceinline__ void gather_value_sum_grouped_impl(
    const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z, long long z_s0,
    const int* __restrict__ counts, int cap, int n, const float* __restrict__ m, const int* __restrict__ cut,
    float z_range, int n_bins, int g, const typename Tag::S* __restrict__ V, long long v_s0, long long v_s1,
    int d, float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    __shared__ int js[MR_GROUP_TILE];
    __shared__ unsigned char takes[MR_GROUP_TILE];   // bit gi: head h0 + gi sums this row
    __shared__ float ws[G][MR_GROUP_TILE];
    __shared__ float red[2 * MR_GATHER_THREADS];   // one head's group partials at a time
    __shared__ float scratch[64];
    const int tid = threadIdx.x, h0 = blockIdx.y * g, Hq = gridDim.y * g;
    const float inv_w = (float)n_bins / z_range;    // (as zhist / zcompact compute them)
    int c[G], cb[G];
    float M[G], lo[G], acc0[G], acc1[G], lsum[G];
    unsigned shared_mask = 0;   // bit gi: head h0 + gi's list is its threshold set
    long long C = 0;
#pragma unroll
    for (int gi = 0; gi < G; ++gi) {
        const int h = h0 + (gi < g ? gi : 0);
        c[gi] = gi < g ? (counts[h] < cap ? counts[h] : cap) : 0;
        if (gi < g && counts[h] <= cap) shared_mask |= 1u << gi;
        cb[gi] = cut[h];
        M[gi] = m[h];
        lo[gi] = M[gi] - z_range;
        acc0[gi] = acc1[gi] = lsum[gi] = 0.f;
        C += c[gi];
    }
    const long long share = (C + gridDim.x - 1) / gridDim.x;
    const long long start = (long long)blockIdx.x * share;
    const long long end = mr_min_ll(start + share, C);
    const typename Tag::S* Vh = V + (long long)blockIdx.y * v_s0;
    const int half = d >> 1;
    const int ngroups = blockDim.x / half;
    const int grp = tid / half, e = 2 * (tid - grp * half);
    const bool active = grp < ngroups;
    for (long long t0 = start; t0 < end; t0 += MR_GROUP_TILE) {
        const int cnt = (int)mr_min_ll(MR_GROUP_TILE, end - t0);
        for (int i = tid; i < cnt; i += blockDim.x) {
            long long t = t0 + i;   // < C: its head is the first whose list it does not pass
            int hi = 0;
#pragma unroll
            for (int gi = 0; gi < G - 1; ++gi)
                if (hi == gi && t >= c[gi]) {
                    t -= c[gi];
                    hi = gi + 1;
                }
            long long j = (long long)idx[(long long)(h0 + hi) * idx_s0 + t];
            j = j < 0 ? 0 : (j >= n ? n - 1 : j);
            float zv[G];
            unsigned member = 0;   // shared heads whose threshold set holds j
#pragma unroll
            for (int gi = 0; gi < G; ++gi) {
                zv[gi] = gi < g ? z[(long long)(h0 + gi) * z_s0 + j] : 0.f;
                if ((shared_mask >> gi & 1u) && cb[gi] < n_bins && mr_bin(zv[gi], lo[gi], inv_w, n_bins) >= cb[gi])
                    member |= 1u << gi;
            }
            const unsigned self = 1u << hi, below = self - 1u;
            unsigned take;
            if (!(shared_mask & self)) take = self;                 // its own list alone
            else if (member & below) take = 0u;                      // a lower shared head reads it
            else take = (member & ~below) | self;                    // every shared head from hi up
            js[i] = take ? (int)j : -1;
            unsigned live = 0;
#pragma unroll
            for (int gi = 0; gi < G; ++gi) {
                float w = 0.f;
                if ((take >> gi & 1u) && M[gi] > mr_neg_inf()) {
                    w = expf(zv[gi] - M[gi]);
                    live |= 1u << gi;
                }
                ws[gi][i] = w;
                lsum[gi] += w;
            }
            takes[i] = (unsigned char)live;
        }
        __syncthreads();
        if (active) {
            int i = grp;
            for (; i < cnt; i += MR_GATHER_ILP * ngroups) {
                float a[MR_GATHER_ILP], b[MR_GATHER_ILP];
#pragma unroll
                for (int u = 0; u < MR_GATHER_ILP; ++u) {   // (a row's threads agree on every branch)
                    const int iu = i + u * ngroups;
                    a[u] = b[u] = 0.f;
                    if (iu < cnt && js[iu] >= 0) Tag::load2(Vh + (long long)js[iu] * v_s1 + e, a[u], b[u]);
                }
#pragma unroll
                for (int u = 0; u < MR_GATHER_ILP; ++u) {
                    const int iu = i + u * ngroups;
                    const unsigned tk = iu < cnt ? takes[iu] : 0u;
#pragma unroll
                    for (int gi = 0; gi < G; ++gi)
                        if (tk >> gi & 1u) {
                            acc0[gi] = fmaf(ws[gi][iu], a[u], acc0[gi]);
                            acc1[gi] = fmaf(ws[gi][iu], b[u], acc1[gi]);
                        }
                }
            }
        }
        __syncthreads();   // js / takes / ws are overwritten by the next tile
    }
#pragma unroll
    for (int gi = 0; gi < G; ++gi) {
        if (gi < g) {   // (g is uniform: every thread runs the barriers below)
            const float L = mr_block_sum(lsum[gi], scratch);
            if (active) {
                red[grp * d + e] = acc0[gi];
                red[grp * d + e + 1] = acc1[gi];
            }
            __syncthreads();
            mr_write_partial(red, ngroups, d, M[gi], L, (long long)blockIdx.x * Hq + h0 + gi, o_part, m_part, l_part);
            __syncthreads();   // red is rewritten for the next head
        }
    }
}

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_grouped_f32_g3(const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z,
    long long z_s0, const int* __restrict__ counts, int cap, int n, const float* __restrict__ m,
    const int* __restrict__ cut, float z_range, int n_bins, int g, const float* __restrict__ V, long long v_s0,
    long long v_s1, int d, float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_grouped_impl<MrF32, 3>(idx, idx_s0, z, z_s0, counts, cap, n, m, cut, z_range, n_bins, g, V,
        v_s0, v_s1, d, o_part, m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_grouped_f32_g4(const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z,
    long long z_s0, const int* __restrict__ counts, int cap, int n, const float* __restrict__ m,
    const int* __restrict__ cut, float z_range, int n_bins, int g, const float* __restrict__ V, long long v_s0,
    long long v_s1, int d, float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_grouped_impl<MrF32, 4>(idx, idx_s0, z, z_s0, counts, cap, n, m, cut, z_range, n_bins, g, V,
        v_s0, v_s1, d, o_part, m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_grouped_f32_g8(const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z,
    long long z_s0, const int* __restrict__ counts, int cap, int n, const float* __restrict__ m,
    const int* __restrict__ cut, float z_range, int n_bins, int g, const float* __restrict__ V, long long v_s0,
    long long v_s1, int d, float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_grouped_impl<MrF32, MR_GATHER_MAX_GROUP>(idx, idx_s0, z, z_s0, counts, cap, n, m, cut, z_range, n_bins, g, V,
        v_s0, v_s1, d, o_part, m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_grouped_f16_g3(const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z,
    long long z_s0, const int* __restrict__ counts, int cap, int n, const float* __restrict__ m,
    const int* __restrict__ cut, float z_range, int n_bins, int g, const unsigned short* __restrict__ V, long long v_s0,
    long long v_s1, int d, float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_grouped_impl<MrF16, 3>(idx, idx_s0, z, z_s0, counts, cap, n, m, cut, z_range, n_bins, g, V,
        v_s0, v_s1, d, o_part, m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_grouped_f16_g4(const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z,
    long long z_s0, const int* __restrict__ counts, int cap, int n, const float* __restrict__ m,
    const int* __restrict__ cut, float z_range, int n_bins, int g, const unsigned short* __restrict__ V, long long v_s0,
    long long v_s1, int d, float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_grouped_impl<MrF16, 4>(idx, idx_s0, z, z_s0, counts, cap, n, m, cut, z_range, n_bins, g, V,
        v_s0, v_s1, d, o_part, m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_grouped_f16_g8(const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z,
    long long z_s0, const int* __restrict__ counts, int cap, int n, const float* __restrict__ m,
    const int* __restrict__ cut, float z_range, int n_bins, int g, const unsigned short* __restrict__ V, long long v_s0,
    long long v_s1, int d, float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_grouped_impl<MrF16, MR_GATHER_MAX_GROUP>(idx, idx_s0, z, z_s0, counts, cap, n, m, cut, z_range, n_bins, g, V,
        v_s0, v_s1, d, o_part, m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_grouped_bf16_g3(const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z,
    long long z_s0, const int* __restrict__ counts, int cap, int n, const float* __restrict__ m,
    const int* __restrict__ cut, float z_range, int n_bins, int g, const unsigned short* __restrict__ V, long long v_s0,
    long long v_s1, int d, float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_grouped_impl<MrBF16, 3>(idx, idx_s0, z, z_s0, counts, cap, n, m, cut, z_range, n_bins, g, V,
        v_s0, v_s1, d, o_part, m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_grouped_bf16_g4(const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z,
    long long z_s0, const int* __restrict__ counts, int cap, int n, const float* __restrict__ m,
    const int* __restrict__ cut, float z_range, int n_bins, int g, const unsigned short* __restrict__ V, long long v_s0,
    long long v_s1, int d, float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_grouped_impl<MrBF16, 4>(idx, idx_s0, z, z_s0, counts, cap, n, m, cut, z_range, n_bins, g, V,
        v_s0, v_s1, d, o_part, m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_grouped_bf16_g8(const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z,
    long long z_s0, const int* __restrict__ counts, int cap, int n, const float* __restrict__ m,
    const int* __restrict__ cut, float z_range, int n_bins, int g, const unsigned short* __restrict__ V, long long v_s0,
    long long v_s1, int d, float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_grouped_impl<MrBF16, MR_GATHER_MAX_GROUP>(idx, idx_s0, z, z_s0, counts, cap, n, m, cut, z_range, n_bins, g, V,
        v_s0, v_s1, d, o_part, m_part, l_part);
}
