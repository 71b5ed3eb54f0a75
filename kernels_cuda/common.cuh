// common.cuh -- device helpers shared by the kernels_cuda sources.
//
// No system or CUDA headers: the sources must compile under nvcc and under
// NVRTC (CuPy RawModule) alike.  kernels_cuda/_sources.py inlines this file
// textually in place of `#include "common.cuh"` before handing a source to
// NVRTC (so CuPy's compile cache keys on the full text); nvcc resolves the
// include relative to the .cu file.
//
// Conventions for every helper below:
//   * blocks are 1-D (threadIdx.x only) and blockDim.x is a multiple of 32,
//     at most 1024;
//   * block-wide helpers (mr_block_*) must be called by every thread of the
//     block (they contain __syncthreads) and return the result in every
//     thread; the scratch array they take is __shared__ with >= 64 entries and
//     may be reused by the next block-wide call (each call starts with a
//     barrier that protects the previous call's reads).
//
// MINIRUN_EMU is defined only by the CPU emulator used in the tests
// (tests/support/cuda_emu.py); it never appears in a real GPU build.

#ifndef MINIRUN_COMMON_CUH
#define MINIRUN_COMMON_CUH

#define MR_FULL_MASK 0xffffffffu

#ifndef MINIRUN_EMU
// Dynamic shared memory.  One name and one element type for all kernels of a
// module (extern __shared__ arrays of different types may not share a name).
#define MR_DYN_SMEM(name) extern __shared__ float name[]
#endif

__device__ __forceinline__ float mr_neg_inf() { return -__int_as_float(0x7f800000); }

__device__ __forceinline__ long long mr_min_ll(long long a, long long b) { return a < b ? a : b; }

// ---------------------------------------------------------------------------
// Element types.  16-bit floats travel as unsigned short bits and are
// converted exactly to float32 (no cuda_fp16.h / cuda_bf16.h needed).
// ---------------------------------------------------------------------------

__device__ __forceinline__ float mr_half_to_float(unsigned short h) {
#ifdef MINIRUN_EMU
    return emu_half_to_float(h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

__device__ __forceinline__ float mr_bf16_to_float(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

// x rounded to the nearest bfloat16 (ties to even), as a float32; NaN stays NaN.
__device__ __forceinline__ float mr_bf16_round(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return x;
    u += 0x7fffu + ((u >> 16) & 1u);
    return __uint_as_float(u & 0xffff0000u);
}

// Where torch's ops round a float32 / bfloat16 result: rnd(x) (as a float32).
struct MrRoundF32 {
    static __device__ __forceinline__ float rnd(float x) { return x; }
};
struct MrRoundBF16 {
    static __device__ __forceinline__ float rnd(float x) { return mr_bf16_round(x); }
};

// RoPE of one (x1, x2) pair by (c, s) in HF Llama's half split, r1 = x1 c - x2 s, r2 = x2 c + x1 s,
// each product and each sum rounded by R::rnd as torch's ops round them.
template <typename R>
__device__ __forceinline__ void mr_rope_pair(float x1, float x2, float c, float s, float& r1, float& r2) {
    r1 = R::rnd(R::rnd(x1 * c) - R::rnd(x2 * s));
    r2 = R::rnd(R::rnd(x2 * c) + R::rnd(x1 * s));
}

// load2: elements p[0], p[1] in one load (p aligned to two elements: an even index into rows of
// even length); the low half of a 32-bit word is the first 16-bit element (little endian).
struct alignas(8) MrF32x2 {
    float a, b;
};
struct MrF32 {
    typedef float S;
    static __device__ __forceinline__ float cvt(float x) { return x; }
    static __device__ __forceinline__ void load2(const float* p, float& a, float& b) {
        const MrF32x2 v = *reinterpret_cast<const MrF32x2*>(p);
        a = v.a;
        b = v.b;
    }
};
struct MrF16 {
    typedef unsigned short S;
    static __device__ __forceinline__ float cvt(unsigned short x) { return mr_half_to_float(x); }
    static __device__ __forceinline__ void load2(const unsigned short* p, float& a, float& b) {
        const unsigned int u = *reinterpret_cast<const unsigned int*>(p);
        a = cvt((unsigned short)(u & 0xffffu));
        b = cvt((unsigned short)(u >> 16));
    }
};
struct MrBF16 {
    typedef unsigned short S;
    static __device__ __forceinline__ float cvt(unsigned short x) { return mr_bf16_to_float(x); }
    static __device__ __forceinline__ void load2(const unsigned short* p, float& a, float& b) {
        const unsigned int u = *reinterpret_cast<const unsigned int*>(p);
        a = __uint_as_float(u << 16);
        b = __uint_as_float(u & 0xffff0000u);
    }
};

// The end of one split of an attention sum: o_part[slot] = (the sum of the ngroups partial rows
// red[g d : g d + d]) / l, m_part[slot] = m, l_part[slot] = l; an empty split (!(l > 0)) writes
// (0, -inf, 0).  Called by every thread of the block after a barrier that published red.
__device__ __forceinline__ void mr_write_partial(const float* red, int ngroups, int d, float m, float l,
                                                 long long slot, float* __restrict__ o_part,
                                                 float* __restrict__ m_part, float* __restrict__ l_part) {
    const bool empty = !(l > 0.f);
    for (int x = threadIdx.x; x < d; x += blockDim.x) {
        float o = 0.f;
        for (int g = 0; g < ngroups; ++g) o += red[g * d + x];
        o_part[slot * d + x] = empty ? 0.f : o / l;
    }
    if (threadIdx.x == 0) {
        m_part[slot] = empty ? mr_neg_inf() : m;
        l_part[slot] = empty ? 0.f : l;
    }
}

// The selection histogram's bin of score v over [lo, lo + n_bins / inv_w] (scores.cu's zhist /
// zcompact and gather.cu's grouped gather must agree bit for bit): NaN -> -1, clamped to the ends.
__device__ __forceinline__ int mr_bin(float v, float lo, float inv_w, int n_bins) {
    if (!(v == v)) return -1;
    float x = (v - lo) * inv_w;
    x = fminf(fmaxf(x, 0.f), (float)(n_bins - 1));
    return (int)x;  // x >= 0: truncation == floor
}

// PQ code -> centroid index.  int16 codes are read as unsigned so that a
// corrupt negative code cannot index below the table.
__device__ __forceinline__ int mr_code(unsigned char x) { return (int)x; }
__device__ __forceinline__ int mr_code(short x) { return (int)(unsigned short)x; }

// 16 bytes, for vectorized loads of PQ code rows.
struct alignas(16) MrVec16 {
    unsigned int a, b, c, d;
};

// ---------------------------------------------------------------------------
// Warp / block reductions.
// ---------------------------------------------------------------------------

__device__ __forceinline__ float mr_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(MR_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float mr_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(MR_FULL_MASK, v, o));
    return v;
}

// Online-softmax pair (m = max, l = sum exp(x - m)).  (-inf, 0) is the empty
// pair; combining two empty pairs gives an empty pair (no NaN).
__device__ __forceinline__ void mr_ms_combine(float& m, float& l, float m2, float l2) {
    const float mn = fmaxf(m, m2);
    if (mn == mr_neg_inf()) {
        m = mn;
        l = 0.f;
        return;
    }
    l = l * expf(m - mn) + l2 * expf(m2 - mn);  // expf(-inf) = 0 for an empty side
    m = mn;
}

// Symmetric butterfly: every lane ends with the same pair (float + and max
// are commutative, so partners compute bit-identical results).
__device__ __forceinline__ void mr_warp_ms(float& m, float& l) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(MR_FULL_MASK, m, o);
        const float l2 = __shfl_xor_sync(MR_FULL_MASK, l, o);
        mr_ms_combine(m, l, m2, l2);
    }
}

__device__ __forceinline__ float mr_block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = mr_warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < nw) ? scratch[lane] : 0.f;
    return mr_warp_sum(v);
}

__device__ __forceinline__ float mr_block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = mr_warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < nw) ? scratch[lane] : mr_neg_inf();
    return mr_warp_max(v);
}

__device__ __forceinline__ void mr_block_ms(float& m, float& l, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    mr_warp_ms(m, l);
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = m;
        scratch[32 + warp] = l;
    }
    __syncthreads();
    m = (lane < nw) ? scratch[lane] : mr_neg_inf();
    l = (lane < nw) ? scratch[32 + lane] : 0.f;
    mr_warp_ms(m, l);
}

// Exclusive prefix sum over the block in thread order (int or float); *total = block sum.
// A lane's prefix is its left neighbour's inclusive sum (x - v would round for floats).
template <typename T>
__device__ __forceinline__ T mr_block_excl_scan(T v, T* total, T* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    T x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T y = __shfl_up_sync(MR_FULL_MASK, x, o);
        if (lane >= o) x += y;
    }
    T ex = __shfl_up_sync(MR_FULL_MASK, x, 1);
    if (lane == 0) ex = 0;
    __syncthreads();
    if (lane == 31) scratch[warp] = x;
    __syncthreads();
    T before = 0, all = 0;
    for (int w = 0; w < nw; ++w) {
        const T s = scratch[w];
        if (w < warp) before += s;
        all += s;
    }
    *total = all;
    return before + ex;
}

// The live token count of a kernel whose grid was sized for n: min(n, *n_live) (scores.cu's n_live).
__device__ __forceinline__ int mr_live_n(int n, const int* __restrict__ n_live) {
    const int x = *n_live;
    return x < n ? (x < 0 ? 0 : x) : n;
}

#endif  // MINIRUN_COMMON_CUH
