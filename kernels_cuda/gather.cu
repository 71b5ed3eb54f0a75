// gather.cu -- the store's part of an HCA decode step summed by the GPU itself (value_sum "gpu",
// minirun/kv/hca_cuda.py): the selected value rows are read straight from the host value pool
// (page-locked and mapped), so a decode step needs no copy-back, no host sum and no host wait.
// gather_value_sum_grouped_* reads each row once per kv group, weighted for every query head that
// chose it; _q8 / _q4 read quantized rows (codes and scales) and dequantize them on the device.
//
// Their partials are merged by decode.cu's lse_merge_staged.  Compiled without --use_fast_math:
// the grouped kernel recomputes scores.cu's histogram bins (mr_bin) and must agree bit for bit.
// The extern "C" entry points are written out one by one: the CPU emulator (tests/support/cuda_emu.py)
// reads their signatures from this text.

#include "common.cuh"

#define MR_GATHER_THREADS 256
#define MR_GATHER_ILP 4      // value rows in flight per thread (each read crosses the host bus)
#define MR_GATHER_MAX_GROUP 8   // query heads per kv head the grouped gather takes
#define MR_GROUP_TILE 128       // its tile (its shared memory holds a weight per head and token)

// ---------------------------------------------------------------------------
// gather_value_sum_grouped: the selected value rows of every query head summed from the host pool
// V [Hkv, cap, d], each row read once per kv group (the query heads of one kv head select
// overlapping rows: 1.6x on SmolLM2, docs/DESIGN.md). Head h's partial over a split s of its list:
//   o_part[s, h] = sum w V[h / g, j] / sum w,  m_part[s, h] = m[h],  l_part[s, h] = sum w,
// w = exp(z[h, j] - m[h]) (lse_merge_staged's layout [nsplit, Hq, ...]; an empty share, or m[h] =
// -inf: 0, -inf, 0); m[h] is the max of every score z[h, :n], so no weight exceeds 1.
// Block (s, k) of grid (nsplit, Hkv) takes the s-th share of the group's entries: the
// concatenation of its heads' lists (heads h = k g .. k g + g - 1, i.e. q_to_kv[h] = h / g; head
// h's list: t < c_h = min(counts[h], cap), j = idx[h, t] clamped to [0, n)).  A head is *shared*
// when counts[h] <= cap: its list is then exactly zcompact's set {j < n : bin(z[h, j]) >= cut[h]}
// (mr_bin over [m[h] - z_range, m[h]], n_bins bins), so membership is a test on z.  Otherwise (its
// top bin alone held more than cap tokens: the list is any cap of them) it sums its own entries
// alone.  An entry (h, j) of a shared head is skipped when a lower shared head of the group
// selects j; else row j is read once and weighted for every shared head at or above h that selects
// it (w = exp(z[h', j] - m[h'])).  Any selection: tau >= 1 (cut -1: every token is a member, each
// row read by the group's first head) and tau <= 0 (empty lists) too.
// Launch: block MR_GATHER_THREADS, grid (nsplit, Hkv), 1 <= g <= G (the kernel's group size: 3, 4 or
// MR_GATHER_MAX_GROUP; arrays of G in registers), d even, 2 <= d <= MR_GATHER_THREADS, V's rows
// aligned to two elements (q8 / q4 rows: bytes, d a multiple of 32), no dynamic shared memory.  Per entry the g scores z[h', j] are loaded
// once; a bit mask of the heads that take the row keeps a row a head did not select out of its sum
// (0 * inf would be NaN), and MR_GATHER_ILP owned rows are read at a time.
// ---------------------------------------------------------------------------
// A value row's channels e, e + 1 (e even) as floats.  Float rows (MrF32 / MrF16 / MrBF16): two
// elements.  Quantized rows (minirun/kv/value_codes.py: uint8 [width], the codes, then float16
// scales per group of 32 channels) are dequantized here, on the device, from the codes read over
// the bus: q8 (MrQ8) x = (c - 128) s; q4 (MrQ4) x = c s + min, channel 32 k + i in byte 16 k +
// (i mod 16), the low nibble for i < 16.  Rows are 2-byte aligned (even widths), e even.
struct MrQ8 { typedef unsigned char S; };
struct MrQ4 { typedef unsigned char S; };

template <typename Tag>
struct MrRow {
    static __device__ __forceinline__ void load2(const typename Tag::S* row, int e, int d, float& a, float& b) {
        Tag::load2(row + e, a, b);
    }
};
template <>
struct MrRow<MrQ8> {
    static __device__ __forceinline__ void load2(const unsigned char* row, int e, int d, float& a, float& b) {
        const float s = mr_half_to_float(*reinterpret_cast<const unsigned short*>(row + d + 2 * (e >> 5)));
        const unsigned int c = *reinterpret_cast<const unsigned short*>(row + e);
        a = ((float)(int)(c & 0xffu) - 128.f) * s;
        b = ((float)(int)(c >> 8) - 128.f) * s;
    }
};
template <>
struct MrRow<MrQ4> {
    static __device__ __forceinline__ void load2(const unsigned char* row, int e, int d, float& a, float& b) {
        const int g = e >> 5, i = e & 31, shift = (i >> 4) * 4;
        const unsigned short* meta = reinterpret_cast<const unsigned short*>(row + (d >> 1) + 4 * g);
        const float s = mr_half_to_float(meta[0]), lo = mr_half_to_float(meta[1]);
        const unsigned int c = *reinterpret_cast<const unsigned short*>(row + 16 * g + (i & 15));
        a = fmaf((float)((c >> shift) & 15u), s, lo);
        b = fmaf((float)((c >> (8 + shift)) & 15u), s, lo);
    }
};

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
                    if (iu < cnt && js[iu] >= 0) MrRow<Tag>::load2(Vh + (long long)js[iu] * v_s1, e, d, a[u], b[u]);
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

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_grouped_q8_g3(const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z,
    long long z_s0, const int* __restrict__ counts, int cap, int n, const float* __restrict__ m,
    const int* __restrict__ cut, float z_range, int n_bins, int g, const unsigned char* __restrict__ V, long long v_s0,
    long long v_s1, int d, float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_grouped_impl<MrQ8, 3>(idx, idx_s0, z, z_s0, counts, cap, n, m, cut, z_range, n_bins, g, V,
        v_s0, v_s1, d, o_part, m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_grouped_q8_g4(const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z,
    long long z_s0, const int* __restrict__ counts, int cap, int n, const float* __restrict__ m,
    const int* __restrict__ cut, float z_range, int n_bins, int g, const unsigned char* __restrict__ V, long long v_s0,
    long long v_s1, int d, float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_grouped_impl<MrQ8, 4>(idx, idx_s0, z, z_s0, counts, cap, n, m, cut, z_range, n_bins, g, V,
        v_s0, v_s1, d, o_part, m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_grouped_q8_g8(const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z,
    long long z_s0, const int* __restrict__ counts, int cap, int n, const float* __restrict__ m,
    const int* __restrict__ cut, float z_range, int n_bins, int g, const unsigned char* __restrict__ V, long long v_s0,
    long long v_s1, int d, float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_grouped_impl<MrQ8, MR_GATHER_MAX_GROUP>(idx, idx_s0, z, z_s0, counts, cap, n, m, cut, z_range, n_bins, g, V,
        v_s0, v_s1, d, o_part, m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_grouped_q4_g3(const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z,
    long long z_s0, const int* __restrict__ counts, int cap, int n, const float* __restrict__ m,
    const int* __restrict__ cut, float z_range, int n_bins, int g, const unsigned char* __restrict__ V, long long v_s0,
    long long v_s1, int d, float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_grouped_impl<MrQ4, 3>(idx, idx_s0, z, z_s0, counts, cap, n, m, cut, z_range, n_bins, g, V,
        v_s0, v_s1, d, o_part, m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_grouped_q4_g4(const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z,
    long long z_s0, const int* __restrict__ counts, int cap, int n, const float* __restrict__ m,
    const int* __restrict__ cut, float z_range, int n_bins, int g, const unsigned char* __restrict__ V, long long v_s0,
    long long v_s1, int d, float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_grouped_impl<MrQ4, 4>(idx, idx_s0, z, z_s0, counts, cap, n, m, cut, z_range, n_bins, g, V,
        v_s0, v_s1, d, o_part, m_part, l_part);
}

extern "C" __global__ void __launch_bounds__(MR_GATHER_THREADS)
gather_value_sum_grouped_q4_g8(const int* __restrict__ idx, long long idx_s0, const float* __restrict__ z,
    long long z_s0, const int* __restrict__ counts, int cap, int n, const float* __restrict__ m,
    const int* __restrict__ cut, float z_range, int n_bins, int g, const unsigned char* __restrict__ V, long long v_s0,
    long long v_s1, int d, float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part) {
    gather_value_sum_grouped_impl<MrQ4, MR_GATHER_MAX_GROUP>(idx, idx_s0, z, z_s0, counts, cap, n, m, cut, z_range, n_bins, g, V,
        v_s0, v_s1, d, o_part, m_part, l_part);
}
