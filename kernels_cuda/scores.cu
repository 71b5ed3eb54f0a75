// scores.cu -- approximate (PQ) scores with fused softmax statistics, and
// threshold selection by a mass histogram (no sort).
//
// Compiled without --use_fast_math: -inf / NaN handling and the bin
// arithmetic must be IEEE-exact and identical in every kernel.
//
// Layouts (element strides; the last axis is always contiguous):
//   T        [Hq, g, c]      float32, contiguous
//   P        [Hkv, n_cap, g] uint8 / int16, strides (p_s0, g, 1)
//   z        [Hq, n]         float32, strides (z_s0, 1)
//   part_m/l [Hq, nblk]      float32 block partials of (max, sum exp(z - max))
//   hist     [Hq, n_bins]    float32, zeroed by the caller
//   idx      [Hq, >=n]       int32, strides (idx_s0, 1)

#include "common.cuh"

// ---------------------------------------------------------------------------
// approx_scores: z[h, t] = sum_j T[h, j, P[q_to_kv[h], t, j]] for t < n, plus
// per-block online-softmax partials.
//
// Launch: block 256, grid (nblk = ceil(n / tokens_per_block), Hq).
// USE_SMEM: dynamic shared memory g*c floats holding T[h] (the wrapper raises
// the kernel's dynamic-smem limit above 48 KiB when needed); otherwise T is
// read from global memory (L1/L2), shared memory 0.
// vec16: code rows are loaded 16 bytes at a time; the wrapper sets it only if
// g*sizeof(IdxT) % 16 == 0, P's address % 16 == 0 and p_s0*sizeof(IdxT) % 16 == 0.
// ---------------------------------------------------------------------------

template <typename IdxT>
__device__ __forceinline__ float mr_score_row(const IdxT* __restrict__ row, const float* Th, int g, int c,
                                              int vec16) {
    float s = 0.f;
    if (vec16) {
        const int PER = 16 / (int)sizeof(IdxT);
        const MrVec16* r4 = reinterpret_cast<const MrVec16*>(row);
        for (int j0 = 0; j0 < g; j0 += PER) {
            union {
                MrVec16 v;
                IdxT e[16 / sizeof(IdxT)];
            } u;
            u.v = r4[j0 / PER];
#pragma unroll
            for (int q = 0; q < (int)(16 / sizeof(IdxT)); ++q) s += Th[(j0 + q) * c + mr_code(u.e[q])];
        }
    } else {
        for (int j = 0; j < g; ++j) s += Th[j * c + mr_code(row[j])];
    }
    return s;
}

template <typename IdxT, bool USE_SMEM>
__device__ __forceinline__ void approx_scores_impl(const float* __restrict__ T, const IdxT* __restrict__ P,
                                                   long long p_s0, const int* __restrict__ q_to_kv,
                                                   float* __restrict__ z, long long z_s0,
                                                   float* __restrict__ part_m, float* __restrict__ part_l,
                                                   int n, int g, int c, int tokens_per_block, int vec16) {
    MR_DYN_SMEM(smem);
    __shared__ float scratch[64];
    const int h = blockIdx.y;
    const int kv = q_to_kv[h];
    const float* Tg = T + (long long)h * g * c;
    const float* Th = Tg;
    if (USE_SMEM) {
        for (int i = threadIdx.x; i < g * c; i += blockDim.x) smem[i] = Tg[i];
        __syncthreads();
        Th = smem;
    }
    const IdxT* Pk = P + (long long)kv * p_s0;
    float* zh = z + (long long)h * z_s0;
    const long long start = (long long)blockIdx.x * tokens_per_block;
    const long long end = mr_min_ll(start + tokens_per_block, (long long)n);
    float m = mr_neg_inf(), l = 0.f;
    for (long long t = start + threadIdx.x; t < end; t += blockDim.x) {
        const float s = mr_score_row<IdxT>(Pk + t * g, Th, g, c, vec16);
        zh[t] = s;
        if (s > m) {
            l = l * expf(m - s) + 1.f;  // first token: 0 * expf(-inf) + 1
            m = s;
        } else if (s == s) {            // NaN scores are kept out of the statistics
            l += expf(s - m);
        }
    }
    mr_block_ms(m, l, scratch);
    if (threadIdx.x == 0) {
        part_m[(long long)h * gridDim.x + blockIdx.x] = m;
        part_l[(long long)h * gridDim.x + blockIdx.x] = l;
    }
}

extern "C" __global__ void __launch_bounds__(256)
approx_scores_u8(const float* __restrict__ T, const unsigned char* __restrict__ P, long long p_s0,
                 const int* __restrict__ q_to_kv, float* __restrict__ z, long long z_s0,
                 float* __restrict__ part_m, float* __restrict__ part_l,
                 int n, int g, int c, int tokens_per_block, int use_smem, int vec16,
                 const int* __restrict__ n_live, int has_live) {
    if (has_live) n = mr_live_n(n, n_live);
    if (use_smem)
        approx_scores_impl<unsigned char, true>(T, P, p_s0, q_to_kv, z, z_s0, part_m, part_l, n, g, c,
                                                tokens_per_block, vec16);
    else
        approx_scores_impl<unsigned char, false>(T, P, p_s0, q_to_kv, z, z_s0, part_m, part_l, n, g, c,
                                                 tokens_per_block, vec16);
}

extern "C" __global__ void __launch_bounds__(256)
approx_scores_i16(const float* __restrict__ T, const short* __restrict__ P, long long p_s0,
                  const int* __restrict__ q_to_kv, float* __restrict__ z, long long z_s0,
                  float* __restrict__ part_m, float* __restrict__ part_l,
                  int n, int g, int c, int tokens_per_block, int use_smem, int vec16,
                  const int* __restrict__ n_live, int has_live) {
    if (has_live) n = mr_live_n(n, n_live);
    if (use_smem)
        approx_scores_impl<short, true>(T, P, p_s0, q_to_kv, z, z_s0, part_m, part_l, n, g, c,
                                        tokens_per_block, vec16);
    else
        approx_scores_impl<short, false>(T, P, p_s0, q_to_kv, z, z_s0, part_m, part_l, n, g, c,
                                         tokens_per_block, vec16);
}

// ---------------------------------------------------------------------------
// ms_reduce: combine nblk partials per head -> m[h], l[h].  nblk = 0 gives
// (-inf, 0).  Launch: block 256, grid (Hq), no dynamic shared memory.
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(256)
ms_reduce(const float* __restrict__ part_m, const float* __restrict__ part_l, int nblk,
          float* __restrict__ m_out, float* __restrict__ l_out) {
    __shared__ float scratch[64];
    const int h = blockIdx.x;
    float m = mr_neg_inf(), l = 0.f;
    for (int b = threadIdx.x; b < nblk; b += blockDim.x)
        mr_ms_combine(m, l, part_m[(long long)h * nblk + b], part_l[(long long)h * nblk + b]);
    mr_block_ms(m, l, scratch);
    if (threadIdx.x == 0) {
        m_out[h] = m;
        l_out[h] = l;
    }
}

// ---------------------------------------------------------------------------
// Threshold selection.
//
// Bins: with lo = m - z_range and inv_w = n_bins / z_range, token value v goes
// to bin floor((v - lo) * inv_w) clamped to [0, n_bins - 1] (so bin 0 also
// collects everything below lo, bin n_bins-1 holds the max); NaN -> -1 (never
// in the histogram, selected only by "select all").  The same inline function
// is used by the histogram and the compaction kernels, so a token is selected
// iff its bin >= cut_bin[h], and l_sel is exactly the histogram mass of the
// selected bins (up to float atomics order).
//
// cut_bin encoding: -1 selects all n tokens (tau >= 1), n_bins selects none
// (tau <= 0, or m = -inf / NaN), otherwise the bin where the cumulative mass
// from the top first reaches tau * S.
//
// Bound: selected = minimal set (top tokens whose mass reaches tau*S) plus the
// other tokens of the cut bin, i.e. every extra token has
// z >= (lowest minimal-set z) - z_range / n_bins; count <= minimal + (tokens
// in the cut bin) - 1, extra mass <= mass of the cut bin.  (Up to float32
// rounding of the bin masses at a bin edge.)
// ---------------------------------------------------------------------------

// (mr_bin, the bin of a score: common.cuh, shared with decode.cu's grouped gather)
//
// n_live (approx_scores_*, zhist, zcompact): with has_live, the kernel reads min(n, *n_live) tokens:
// a captured decode token (minirun/cuda_graph.py) sizes its grid for a bucket of n and reads the
// store's length from device memory.  Without it the pointer is not read.

// zhist: per-head mass histogram and, when with_count, token-count histogram
// (hcount, for zcut's cap).  Launch: block 256, grid (nblk, Hq), dynamic shared
// memory n_bins floats (2 n_bins with_count).  hist (and hcount) must be zeroed
// beforehand.
// Each lane adds its own score's mass to its bin, except in the clamped bin 0, where scores crowd
// when attention is peaked: each thread sums those in a register and adds them once. (Adding once
// per bin and warp through __match_any_sync, the leader summing its peers' masses, took 1.7-1.9x as
// long on an H100 with 9 x 1M scores, spread or peaked.)
extern "C" __global__ void __launch_bounds__(256)
zhist(const float* __restrict__ z, long long z_s0, int n, int tokens_per_block,
      const float* __restrict__ m_in, float z_range, int n_bins, float* __restrict__ hist,
      int* __restrict__ hcount, int with_count, const int* __restrict__ n_live, int has_live) {
    MR_DYN_SMEM(sh);
    if (has_live) n = mr_live_n(n, n_live);
    int* shc = reinterpret_cast<int*>(sh + n_bins);   // [n_bins] counts (with_count only)
    const int h = blockIdx.y;
    for (int i = threadIdx.x; i < n_bins; i += blockDim.x) {
        sh[i] = 0.f;
        if (with_count) shc[i] = 0;
    }
    __syncthreads();
    const float m = m_in[h];
    const bool live = (m > mr_neg_inf());  // false for -inf and NaN: nothing to histogram
    const float lo = m - z_range;
    const float inv_w = (float)n_bins / z_range;
    const float* zh = z + (long long)h * z_s0;
    const long long start = (long long)blockIdx.x * tokens_per_block;
    const long long end = live ? mr_min_ll(start + tokens_per_block, (long long)n) : start;
    float low = 0.f;   // bin 0's mass and count from this thread
    int low_n = 0;
    for (long long t = start + threadIdx.x; t < end; t += blockDim.x) {
        const float v = zh[t];
        const int b = mr_bin(v, lo, inv_w, n_bins);   // (-1: NaN, never in the histogram)
        if (b == 0) {
            low += expf(v - m);
            ++low_n;
        } else if (b > 0) {
            atomicAdd(&sh[b], expf(v - m));
            if (with_count) atomicAdd(&shc[b], 1);
        }
    }
    if (low_n) {
        atomicAdd(&sh[0], low);
        if (with_count) atomicAdd(&shc[0], low_n);
    }
    __syncthreads();
    float* hh = hist + (long long)h * n_bins;
    int* hc = hcount + (long long)h * n_bins;
    for (int i = threadIdx.x; i < n_bins; i += blockDim.x) {
        const float x = sh[i];
        if (x != 0.f) atomicAdd(&hh[i], x);
        if (with_count && shc[i] != 0) atomicAdd(&hc[i], shc[i]);
    }
}

// zcut: per head, scan the histogram from the top bin.  Writes cut_bin[h],
// l_sel[h] and zeroes counts[h] (zcompact adds to it).
// mode: 0 = use the histogram (0 < tau < 1), 1 = select all (tau >= 1,
// l_sel = l_all[h]), 2 = select none (tau <= 0).
// cap > 0 (mode 0, hcount from zhist with_count): the cut also keeps the
// selection to at most cap tokens, whole bins from the top: the cut bin is the
// lower of the tau cut and the lowest bin whose cumulative count from the top
// is <= cap -- except that the top non-empty bin is always kept (it alone may
// hold more than cap: the caller then takes any cap of them, all within one
// bin width of each other).  So the selection is a top set of at most cap
// tokens (or the top bin), possibly fewer than cap (the bin that would cross
// cap is left out whole).
// has_caps: head h's cap is caps[h] instead of cap (per-head budgets), and caps[h] < 0 selects
// none (the head skips the store).
// Launch: block 256, grid (Hq), no dynamic shared memory.  hist and hcount
// are only read in mode 0 (any valid pointers otherwise); caps only with has_caps.
extern "C" __global__ void __launch_bounds__(256)
zcut(const float* __restrict__ hist, int n_bins, float tau, int mode, const float* __restrict__ m_in,
     const float* __restrict__ l_all, int* __restrict__ cut_bin, float* __restrict__ l_sel,
     int* __restrict__ counts, const int* __restrict__ hcount, int cap, const int* __restrict__ caps,
     int has_caps) {
    __shared__ float fscratch[64];
    __shared__ int iscratch[64];
    __shared__ int found;
    __shared__ int over, first;
    const int h = blockIdx.x;
    const float m = m_in[h];
    const bool live = (m > mr_neg_inf());
    if (has_caps) cap = caps[h];
    if (cap < 0) mode = 2;     // (per head, so uniform over the block)
    if (mode != 0 || !live) {  // uniform over the block: no barrier below is skipped by part of it
        if (threadIdx.x == 0) {
            const bool all = (mode == 1) && live;
            cut_bin[h] = all ? -1 : n_bins;
            l_sel[h] = all ? l_all[h] : 0.f;
            counts[h] = 0;
        }
        return;
    }
    const float* hh = hist + (long long)h * n_bins;
    // Thread i owns reversed positions r in [i*per, (i+1)*per), r = n_bins-1-bin.
    const int per = (n_bins + blockDim.x - 1) / blockDim.x;
    const int r0 = threadIdx.x * per;
    float local = 0.f;
    for (int q = 0; q < per; ++q) {
        const int r = r0 + q;
        if (r < n_bins) local += hh[n_bins - 1 - r];
    }
    float total;
    const float before = mr_block_excl_scan(local, &total, fscratch);
    if (threadIdx.x == 0) found = n_bins;
    __syncthreads();
    const float target = tau * total;
    float cum = before;
    for (int q = 0; q < per; ++q) {
        const int r = r0 + q;
        if (r >= n_bins) break;
        cum += hh[n_bins - 1 - r];
        if (cum >= target) {
            atomicMin(&found, r);
            break;
        }
    }
    __syncthreads();
    int rstar = found;  // n_bins if rounding kept the sum below target: take everything
    if (cap > 0) {      // uniform over the block
        const int* hc = hcount + (long long)h * n_bins;
        int lc = 0;
        for (int q = 0; q < per; ++q) {
            const int r = r0 + q;
            if (r < n_bins) lc += hc[n_bins - 1 - r];
        }
        int ctotal;
        int ccum = mr_block_excl_scan(lc, &ctotal, iscratch);
        if (threadIdx.x == 0) {
            over = n_bins;
            first = n_bins;
        }
        __syncthreads();
        for (int q = 0; q < per; ++q) {
            const int r = r0 + q;
            if (r >= n_bins) break;
            const int c = hc[n_bins - 1 - r];
            if (c > 0) atomicMin(&first, r);
            ccum += c;
            if (ccum > cap) {
                atomicMin(&over, r);   // the first position whose bin takes the count past cap
                break;
            }
        }
        __syncthreads();
        const int keep = (over == first) ? first : over - 1;   // the top bin stays, whatever its count
        if (keep < rstar) rstar = keep;
    }
    // Selected mass = histogram mass of reversed positions <= rstar.
    float part = 0.f;
    for (int q = 0; q < per; ++q) {
        const int r = r0 + q;
        if (r < n_bins && r <= rstar) part += hh[n_bins - 1 - r];
    }
    const float sel = mr_block_sum(part, fscratch);
    if (threadIdx.x == 0) {
        cut_bin[h] = (rstar >= n_bins) ? 0 : (n_bins - 1 - rstar);
        l_sel[h] = sel;
        counts[h] = 0;
    }
}

// zcompact: write the selected token indices (bin >= cut_bin[h]) of each
// block's token range at idx[h, atomicAdd(counts[h], block count) + ...].
// Order within a row is unspecified.  Launch: block 256, grid (nblk, Hq),
// no dynamic shared memory.  Must run after zcut on the same stream.
extern "C" __global__ void __launch_bounds__(256)
zcompact(const float* __restrict__ z, long long z_s0, int n, int tokens_per_block,
         const float* __restrict__ m_in, float z_range, int n_bins, const int* __restrict__ cut_bin,
         int* __restrict__ idx, long long idx_s0, int* __restrict__ counts, const int* __restrict__ n_live,
         int has_live) {
    __shared__ int iscratch[64];
    __shared__ int base;
    if (has_live) n = mr_live_n(n, n_live);
    const int h = blockIdx.y;
    const float m = m_in[h];
    const float lo = m - z_range;
    const float inv_w = (float)n_bins / z_range;
    const int cb = cut_bin[h];
    const float* zh = z + (long long)h * z_s0;
    const long long start = (long long)blockIdx.x * tokens_per_block;
    const long long end = (cb >= n_bins) ? start : mr_min_ll(start + tokens_per_block, (long long)n);
    int cnt = 0;
    for (long long t = start + threadIdx.x; t < end; t += blockDim.x)
        cnt += (cb < 0 || mr_bin(zh[t], lo, inv_w, n_bins) >= cb) ? 1 : 0;
    int total;
    const int excl = mr_block_excl_scan(cnt, &total, iscratch);
    if (threadIdx.x == 0) base = (total > 0) ? atomicAdd(&counts[h], total) : 0;
    __syncthreads();
    int off = base + excl;
    int* ih = idx + (long long)h * idx_s0;
    for (long long t = start + threadIdx.x; t < end; t += blockDim.x)
        if (cb < 0 || mr_bin(zh[t], lo, inv_w, n_bins) >= cb) ih[off++] = (int)t;
}
