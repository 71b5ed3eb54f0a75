// layer.cu -- the small ops around a Llama layer's GEMMs for one decode token on the GPU
// (minirun/ops.py), each in one launch where torch takes several: on an H100 a decode token of
// SmolLM2 was bound by ~40 torch ops per layer (docs/PROFILE.md).
//
//   rms_norm_*      y = w * (x * rsqrt(mean(x^2) + eps))                      (HF LlamaRMSNorm)
//   add_rms_norm_*  s = x + r; y = rms_norm(s)                               (residual + next norm)
//   rope_*          the first n_rot heads of a row rotated in place by (cos, sin)   (HF half split)
//   silu_mul_*      y = silu(gate) * up, gate | up = the two halves of a row
//   rope_store_*    the dense cache's step input: q turned and scaled (float32), k turned and v
//                   copied into the cache at the token's position (read from device memory)
//
// Rows are independent (grid = rows).  Element types: float32 or bfloat16 bits; bfloat16 results
// are rounded where torch rounds them (after the norm, after each product and sum) so that the
// outputs match the torch ops they replace up to float32 summation order.
// Compiled without --use_fast_math.

#include "common.cuh"

#define MR_LAYER_THREADS 256

struct MrLayerF32 : MrRoundF32 {
    typedef float S;
    static __device__ __forceinline__ float ld(float x) { return x; }
    static __device__ __forceinline__ float st(float x) { return x; }
};
struct MrLayerBF16 : MrRoundBF16 {
    typedef unsigned short S;
    static __device__ __forceinline__ float ld(unsigned short x) { return mr_bf16_to_float(x); }
    static __device__ __forceinline__ unsigned short st(float x) {
        return (unsigned short)(__float_as_uint(mr_bf16_round(x)) >> 16);
    }
};

// One row: y = w * rnd(x * rsqrt(mean(x^2) + eps)) (statistics in float32; for bfloat16 the
// normalized row is rounded before the weight, as HF casts it back to the input dtype first).
template <typename Tag>
__device__ __forceinline__ void rms_row(const float* xs, const typename Tag::S* __restrict__ w, float eps, int D,
                                        typename Tag::S* __restrict__ y, float* scratch) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) ss += xs[i] * xs[i];
    // IEEE 1/sqrt: as torch.rsqrt on a CPU; torch's GPU rsqrt (rsqrtf, <= 2 ulp) may differ in the last bit
    const float inv = 1.f / sqrtf(mr_block_sum(ss, scratch) / (float)D + eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x) y[i] = Tag::st(Tag::ld(w[i]) * Tag::rnd(xs[i] * inv));
}

// ---------------------------------------------------------------------------
// rms_norm: x, y [rows, D] (row strides x_s0, y_s0).  Launch: block MR_LAYER_THREADS, grid (rows),
// dynamic shared memory D floats.
// ---------------------------------------------------------------------------
template <typename Tag>
__device__ __forceinline__ void rms_norm_impl(const typename Tag::S* __restrict__ x, long long x_s0,
                                              const typename Tag::S* __restrict__ w, float eps, int D,
                                              typename Tag::S* __restrict__ y, long long y_s0) {
    MR_DYN_SMEM(xs);
    __shared__ float scratch[64];
    const typename Tag::S* xr = x + (long long)blockIdx.x * x_s0;
    for (int i = threadIdx.x; i < D; i += blockDim.x) xs[i] = Tag::ld(xr[i]);
    __syncthreads();
    rms_row<Tag>(xs, w, eps, D, y + (long long)blockIdx.x * y_s0, scratch);
}

extern "C" __global__ void __launch_bounds__(MR_LAYER_THREADS)
rms_norm_f32(const float* __restrict__ x, long long x_s0, const float* __restrict__ w, float eps, int D,
             float* __restrict__ y, long long y_s0) {
    rms_norm_impl<MrLayerF32>(x, x_s0, w, eps, D, y, y_s0);
}

extern "C" __global__ void __launch_bounds__(MR_LAYER_THREADS)
rms_norm_bf16(const unsigned short* __restrict__ x, long long x_s0, const unsigned short* __restrict__ w, float eps,
              int D, unsigned short* __restrict__ y, long long y_s0) {
    rms_norm_impl<MrLayerBF16>(x, x_s0, w, eps, D, y, y_s0);
}

// ---------------------------------------------------------------------------
// add_rms_norm: s = rnd(x + r) -> s_out, y = rms_norm(s).  x, r, s_out, y [rows, D] contiguous.
// Launch: block MR_LAYER_THREADS, grid (rows), dynamic shared memory D floats.
// ---------------------------------------------------------------------------
template <typename Tag>
__device__ __forceinline__ void add_rms_norm_impl(const typename Tag::S* __restrict__ x,
                                                  const typename Tag::S* __restrict__ r,
                                                  const typename Tag::S* __restrict__ w, float eps, int D,
                                                  typename Tag::S* __restrict__ s_out, typename Tag::S* __restrict__ y) {
    MR_DYN_SMEM(xs);
    __shared__ float scratch[64];
    const long long off = (long long)blockIdx.x * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float s = Tag::rnd(Tag::ld(x[off + i]) + Tag::ld(r[off + i]));
        xs[i] = s;
        s_out[off + i] = Tag::st(s);
    }
    __syncthreads();
    rms_row<Tag>(xs, w, eps, D, y + off, scratch);
}

extern "C" __global__ void __launch_bounds__(MR_LAYER_THREADS)
add_rms_norm_f32(const float* __restrict__ x, const float* __restrict__ r, const float* __restrict__ w, float eps,
                 int D, float* __restrict__ s_out, float* __restrict__ y) {
    add_rms_norm_impl<MrLayerF32>(x, r, w, eps, D, s_out, y);
}

extern "C" __global__ void __launch_bounds__(MR_LAYER_THREADS)
add_rms_norm_bf16(const unsigned short* __restrict__ x, const unsigned short* __restrict__ r,
                  const unsigned short* __restrict__ w, float eps, int D, unsigned short* __restrict__ s_out,
                  unsigned short* __restrict__ y) {
    add_rms_norm_impl<MrLayerBF16>(x, r, w, eps, D, s_out, y);
}

// ---------------------------------------------------------------------------
// rope: in row blockIdx.x of x (row stride x_s0), heads 0..n_rot-1 of d elements each are turned
// in place: [x1 c - x2 s, x2 c + x1 s] with c, s = cs[0:d/2], cs[d/2:d] of the same dtype (the
// position's cos, sin as the model computes them; one position per launch).  Each product and
// each sum rounded for bfloat16, as torch's ops are.  Launch: block MR_LAYER_THREADS, grid (rows).
// ---------------------------------------------------------------------------
template <typename Tag>
__device__ __forceinline__ void rope_impl(typename Tag::S* __restrict__ x, long long x_s0, int n_rot, int d,
                                          const typename Tag::S* __restrict__ cs) {
    const int half = d / 2;
    typename Tag::S* xr = x + (long long)blockIdx.x * x_s0;
    for (int p = threadIdx.x; p < n_rot * half; p += blockDim.x) {   // one (x1, x2) pair per step
        const int h = p / half, f = p - h * half;
        typename Tag::S* xh = xr + (long long)h * d;
        float r1, r2;
        mr_rope_pair<Tag>(Tag::ld(xh[f]), Tag::ld(xh[f + half]), Tag::ld(cs[f]), Tag::ld(cs[half + f]), r1, r2);
        xh[f] = Tag::st(r1);
        xh[f + half] = Tag::st(r2);
    }
}

extern "C" __global__ void __launch_bounds__(MR_LAYER_THREADS)
rope_f32(float* __restrict__ x, long long x_s0, int n_rot, int d, const float* __restrict__ cs) {
    rope_impl<MrLayerF32>(x, x_s0, n_rot, d, cs);
}

extern "C" __global__ void __launch_bounds__(MR_LAYER_THREADS)
rope_bf16(unsigned short* __restrict__ x, long long x_s0, int n_rot, int d, const unsigned short* __restrict__ cs) {
    rope_impl<MrLayerBF16>(x, x_s0, n_rot, d, cs);
}

// ---------------------------------------------------------------------------
// silu_mul: y[row, i] = rnd(rnd(silu(g)) * u), g = gu[row, i], u = gu[row, F + i]; gu [rows, 2F],
// y [rows, F] contiguous.  Launch: block MR_LAYER_THREADS, grid (rows, cdiv(F, MR_LAYER_THREADS)).
// ---------------------------------------------------------------------------
template <typename Tag>
__device__ __forceinline__ void silu_mul_impl(const typename Tag::S* __restrict__ gu, int F,
                                              typename Tag::S* __restrict__ y) {
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= F) return;
    const long long row = blockIdx.x;
    const float g = Tag::ld(gu[row * 2 * F + i]), u = Tag::ld(gu[row * 2 * F + F + i]);
    y[row * F + i] = Tag::st(Tag::rnd(g / (1.f + expf(-g))) * u);
}

extern "C" __global__ void __launch_bounds__(MR_LAYER_THREADS)
silu_mul_f32(const float* __restrict__ gu, int F, float* __restrict__ y) {
    silu_mul_impl<MrLayerF32>(gu, F, y);
}

extern "C" __global__ void __launch_bounds__(MR_LAYER_THREADS)
silu_mul_bf16(const unsigned short* __restrict__ gu, int F, unsigned short* __restrict__ y) {
    silu_mul_impl<MrLayerBF16>(gu, F, y);
}

// ---------------------------------------------------------------------------
// rope_store: one token's input to the dense cache's attention (kernels_cuda.dense_decode), in one
// launch where RoPE, the query's scale and the two cache writes took four.  Block b < Hq: query
// head b turned as rope_ does (rounded where it rounds), then qs[b] = q_rot * scale in float32;
// block Hq + j: key head j turned into K[j, pos[0]]; block Hq + Hkv + j: value head j copied into
// V[j, pos[0]].  q, k, v rows of d elements (head strides q_s0, k_s0, v_s0); K, V [Hkv, cap, d]
// with rows contiguous (head stride kv_s0); cs [d] = cos | sin of the position.  n_live > 0: every
// block also writes its share of live[i] = (i <= pos[0]), i < n_live (the mask is the same for
// every layer: the first layer's launch writes it).  Launch: block MR_ROPE_THREADS, grid (Hq + 2 Hkv).
// ---------------------------------------------------------------------------
#define MR_ROPE_THREADS 128

template <typename Tag>
__device__ __forceinline__ void rope_store_impl(const typename Tag::S* __restrict__ q, long long q_s0,
                                                const typename Tag::S* __restrict__ k, long long k_s0,
                                                const typename Tag::S* __restrict__ v, long long v_s0, int Hq, int Hkv,
                                                int d, const typename Tag::S* __restrict__ cs,
                                                const long long* __restrict__ pos, float scale, float* __restrict__ qs,
                                                typename Tag::S* __restrict__ K, typename Tag::S* __restrict__ V,
                                                long long kv_s0, unsigned char* __restrict__ live, int n_live) {
    const int b = blockIdx.x, half = d / 2;
    const long long p = pos[0];
    if (b < Hq + Hkv) {
        const bool is_q = b < Hq;
        const typename Tag::S* x = is_q ? q + (long long)b * q_s0 : k + (long long)(b - Hq) * k_s0;
        typename Tag::S* kr = K + (long long)(b - Hq) * kv_s0 + p * d;   // (dereferenced for keys only)
        for (int f = threadIdx.x; f < half; f += blockDim.x) {
            float r1, r2;
            mr_rope_pair<Tag>(Tag::ld(x[f]), Tag::ld(x[f + half]), Tag::ld(cs[f]), Tag::ld(cs[half + f]), r1, r2);
            if (is_q) {
                qs[(long long)b * d + f] = r1 * scale;
                qs[(long long)b * d + f + half] = r2 * scale;
            } else {
                kr[f] = Tag::st(r1);
                kr[f + half] = Tag::st(r2);
            }
        }
    } else if (b < Hq + 2 * Hkv) {
        const int j = b - Hq - Hkv;
        typename Tag::S* vr = V + (long long)j * kv_s0 + p * d;
        for (int i = threadIdx.x; i < d; i += blockDim.x) vr[i] = v[(long long)j * v_s0 + i];
    }
    for (long long i = (long long)b * blockDim.x + threadIdx.x; i < n_live; i += (long long)gridDim.x * blockDim.x)
        live[i] = i <= p ? 1 : 0;
}

extern "C" __global__ void __launch_bounds__(MR_ROPE_THREADS)
rope_store_f32(const float* __restrict__ q, long long q_s0, const float* __restrict__ k, long long k_s0,
               const float* __restrict__ v, long long v_s0, int Hq, int Hkv, int d, const float* __restrict__ cs,
               const long long* __restrict__ pos, float scale, float* __restrict__ qs, float* __restrict__ K,
               float* __restrict__ V, long long kv_s0, unsigned char* __restrict__ live, int n_live) {
    rope_store_impl<MrLayerF32>(q, q_s0, k, k_s0, v, v_s0, Hq, Hkv, d, cs, pos, scale, qs, K, V, kv_s0, live, n_live);
}

extern "C" __global__ void __launch_bounds__(MR_ROPE_THREADS)
rope_store_bf16(const unsigned short* __restrict__ q, long long q_s0, const unsigned short* __restrict__ k,
                long long k_s0, const unsigned short* __restrict__ v, long long v_s0, int Hq, int Hkv, int d,
                const unsigned short* __restrict__ cs, const long long* __restrict__ pos, float scale,
                float* __restrict__ qs, unsigned short* __restrict__ K, unsigned short* __restrict__ V, long long kv_s0,
                unsigned char* __restrict__ live, int n_live) {
    rope_store_impl<MrLayerBF16>(q, q_s0, k, k_s0, v, v_s0, Hq, Hkv, d, cs, pos, scale, qs, K, V, kv_s0, live, n_live);
}
