// pq.cu -- product-quantization kernels: query lookup tables and key encoding.
//
// Compiled with --use_fast_math (see _sources.py): only multiply-adds,
// compares and no exp/log/div, so fast math changes nothing but denormal
// flushing.
//
// Layouts (element strides; the last axis is always contiguous):
//   q         [Hq, d]            float32, contiguous (already scaled by 1/sqrt(d))
//   codebooks [Hkv, g, c, ds]    float32, contiguous, ds = d / g
//   q_to_kv   [Hq]               int32
//   T         [Hq, g, c]         float32, contiguous
//   K         [Hkv, n, d]        float32 / float16 bits / bfloat16 bits; strides (k_s0, k_s1, 1)
//   P         [Hkv, n, g]        uint8 (c <= 256) or int16; strides (p_s0, p_s1, 1)

#include "common.cuh"

#define MR_ENC_THREADS 256  // encode_keys block size (32 for a few tokens: kernels_cuda/ops.py)
#define MR_ENC_TOK 4        // tokens per thread in encode_keys -> 1024 tokens per block

// ---------------------------------------------------------------------------
// build_lut: T[h, j, k] = q[h, j*ds:(j+1)*ds] . codebooks[q_to_kv[h], j, k, :]
// One thread per output element, grid-stride loop.  Launch: block 256, grid
// min(ceil(Hq*g*c / 256), 65535).  No shared memory.
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(256) build_lut_f32(
    const float* __restrict__ q, const float* __restrict__ cb, const int* __restrict__ q_to_kv,
    float* __restrict__ T, int Hq, int d, int g, int c) {
    const int ds = d / g;
    const long long total = (long long)Hq * g * c;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int k = (int)(i % c);
        const long long r = i / c;
        const int j = (int)(r % g);
        const int h = (int)(r / g);
        const int kv = q_to_kv[h];
        const float* qv = q + (long long)h * d + (long long)j * ds;
        const float* cv = cb + (((long long)kv * g + j) * c + k) * ds;
        float acc = 0.f;
        for (int e = 0; e < ds; ++e) acc = fmaf(qv[e], cv[e], acc);
        T[i] = acc;
    }
}

// ---------------------------------------------------------------------------
// encode_keys: P[kv, t, j] = argmin_k ||K[kv, t, j*ds:(j+1)*ds] - C[kv, j, k]||^2
//
// Computed as argmax_k (x . c_k - 0.5 ||c_k||^2) in float32 (the ||x||^2 term
// is constant per argmin); strict '>' while k increases -> ties go to the
// lowest index.  NaN keys -> index 0.
//
// Launch: block B = MR_ENC_THREADS (32 for n <= 32*MR_ENC_TOK), grid (ceil(n / (B*MR_ENC_TOK)), g, Hkv),
// dynamic shared memory c*(ds+1) floats (the (kv, j) codebook and its half
// squared norms).  Each thread keeps MR_ENC_TOK sub-vectors in registers and
// streams the codebook from shared memory (broadcast reads).
// ---------------------------------------------------------------------------

template <typename Tag, typename IdxT, int DS>
__device__ __forceinline__ void encode_run(const typename Tag::S* __restrict__ Kh, long long k_s1,
                                           const float* cen, const float* hn, IdxT* __restrict__ Ph,
                                           long long p_s1, long long tile0, int n, int c) {
    float x[MR_ENC_TOK][DS];
    float best[MR_ENC_TOK];
    int bi[MR_ENC_TOK];
#pragma unroll
    for (int i = 0; i < MR_ENC_TOK; ++i) {
        const long long t = tile0 + threadIdx.x + (long long)i * blockDim.x;
        best[i] = mr_neg_inf();
        bi[i] = 0;
#pragma unroll
        for (int e = 0; e < DS; ++e) x[i][e] = (t < n) ? Tag::cvt(Kh[t * k_s1 + e]) : 0.f;
    }
    for (int k = 0; k < c; ++k) {
        float cv[DS];
#pragma unroll
        for (int e = 0; e < DS; ++e) cv[e] = cen[k * DS + e];
        const float h = hn[k];
#pragma unroll
        for (int i = 0; i < MR_ENC_TOK; ++i) {
            float s = -h;
#pragma unroll
            for (int e = 0; e < DS; ++e) s = fmaf(x[i][e], cv[e], s);
            if (s > best[i]) {
                best[i] = s;
                bi[i] = k;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MR_ENC_TOK; ++i) {
        const long long t = tile0 + threadIdx.x + (long long)i * blockDim.x;
        if (t < n) Ph[t * p_s1] = (IdxT)bi[i];
    }
}

// Any other ds: same arithmetic, sub-vector re-read from global (L1) memory.
template <typename Tag, typename IdxT>
__device__ __forceinline__ void encode_run_generic(const typename Tag::S* __restrict__ Kh, long long k_s1,
                                                   const float* cen, const float* hn, IdxT* __restrict__ Ph,
                                                   long long p_s1, long long tile0, int n, int c, int ds) {
    for (int i = 0; i < MR_ENC_TOK; ++i) {
        const long long t = tile0 + threadIdx.x + (long long)i * blockDim.x;
        if (t >= n) continue;
        const typename Tag::S* xr = Kh + t * k_s1;
        float best = mr_neg_inf();
        int bi = 0;
        for (int k = 0; k < c; ++k) {
            float s = -hn[k];
            for (int e = 0; e < ds; ++e) s = fmaf(Tag::cvt(xr[e]), cen[k * ds + e], s);
            if (s > best) {
                best = s;
                bi = k;
            }
        }
        Ph[t * p_s1] = (IdxT)bi;
    }
}

template <typename Tag, typename IdxT>
__device__ __forceinline__ void encode_keys_impl(const typename Tag::S* __restrict__ K, long long k_s0,
                                                 long long k_s1, const float* __restrict__ cb,
                                                 IdxT* __restrict__ P, long long p_s0, long long p_s1,
                                                 int n, int d, int g, int c) {
    MR_DYN_SMEM(smem);
    const int ds = d / g;
    const int j = blockIdx.y;
    const int kv = blockIdx.z;
    float* cen = smem;           // [c, ds]
    float* hn = smem + c * ds;   // [c]   0.5 * ||c_k||^2
    const float* src = cb + ((long long)kv * g + j) * (long long)c * ds;
    for (int i = threadIdx.x; i < c * ds; i += blockDim.x) cen[i] = src[i];
    __syncthreads();
    for (int k = threadIdx.x; k < c; k += blockDim.x) {
        float a = 0.f;
        for (int e = 0; e < ds; ++e) a = fmaf(cen[k * ds + e], cen[k * ds + e], a);
        hn[k] = 0.5f * a;
    }
    __syncthreads();

    const long long tile0 = (long long)blockIdx.x * blockDim.x * MR_ENC_TOK;
    const typename Tag::S* Kh = K + (long long)kv * k_s0 + (long long)j * ds;
    IdxT* Ph = P + (long long)kv * p_s0 + j;
    switch (ds) {
        case 1: encode_run<Tag, IdxT, 1>(Kh, k_s1, cen, hn, Ph, p_s1, tile0, n, c); break;
        case 2: encode_run<Tag, IdxT, 2>(Kh, k_s1, cen, hn, Ph, p_s1, tile0, n, c); break;
        case 4: encode_run<Tag, IdxT, 4>(Kh, k_s1, cen, hn, Ph, p_s1, tile0, n, c); break;
        case 8: encode_run<Tag, IdxT, 8>(Kh, k_s1, cen, hn, Ph, p_s1, tile0, n, c); break;
        case 16: encode_run<Tag, IdxT, 16>(Kh, k_s1, cen, hn, Ph, p_s1, tile0, n, c); break;
        default: encode_run_generic<Tag, IdxT>(Kh, k_s1, cen, hn, Ph, p_s1, tile0, n, c, ds); break;
    }
}

// Entry points: key dtype x code dtype.
extern "C" __global__ void __launch_bounds__(MR_ENC_THREADS)
encode_keys_f32_u8(const float* __restrict__ K, long long k_s0, long long k_s1, const float* __restrict__ cb,
    unsigned char* __restrict__ P, long long p_s0, long long p_s1, int n, int d, int g, int c) {
    encode_keys_impl<MrF32, unsigned char>(K, k_s0, k_s1, cb, P, p_s0, p_s1, n, d, g, c);
}

extern "C" __global__ void __launch_bounds__(MR_ENC_THREADS)
encode_keys_f32_i16(const float* __restrict__ K, long long k_s0, long long k_s1, const float* __restrict__ cb,
    short* __restrict__ P, long long p_s0, long long p_s1, int n, int d, int g, int c) {
    encode_keys_impl<MrF32, short>(K, k_s0, k_s1, cb, P, p_s0, p_s1, n, d, g, c);
}

extern "C" __global__ void __launch_bounds__(MR_ENC_THREADS)
encode_keys_f16_u8(const unsigned short* __restrict__ K, long long k_s0, long long k_s1, const float* __restrict__ cb,
    unsigned char* __restrict__ P, long long p_s0, long long p_s1, int n, int d, int g, int c) {
    encode_keys_impl<MrF16, unsigned char>(K, k_s0, k_s1, cb, P, p_s0, p_s1, n, d, g, c);
}

extern "C" __global__ void __launch_bounds__(MR_ENC_THREADS)
encode_keys_f16_i16(const unsigned short* __restrict__ K, long long k_s0, long long k_s1, const float* __restrict__ cb,
    short* __restrict__ P, long long p_s0, long long p_s1, int n, int d, int g, int c) {
    encode_keys_impl<MrF16, short>(K, k_s0, k_s1, cb, P, p_s0, p_s1, n, d, g, c);
}

extern "C" __global__ void __launch_bounds__(MR_ENC_THREADS)
encode_keys_bf16_u8(const unsigned short* __restrict__ K, long long k_s0, long long k_s1, const float* __restrict__ cb,
    unsigned char* __restrict__ P, long long p_s0, long long p_s1, int n, int d, int g, int c) {
    encode_keys_impl<MrBF16, unsigned char>(K, k_s0, k_s1, cb, P, p_s0, p_s1, n, d, g, c);
}

extern "C" __global__ void __launch_bounds__(MR_ENC_THREADS)
encode_keys_bf16_i16(const unsigned short* __restrict__ K, long long k_s0, long long k_s1, const float* __restrict__ cb,
    short* __restrict__ P, long long p_s0, long long p_s1, int n, int d, int g, int c) {
    encode_keys_impl<MrBF16, short>(K, k_s0, k_s1, cb, P, p_s0, p_s1, n, d, g, c);
}
