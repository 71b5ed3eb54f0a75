// quant.cu -- GGUF block-quantized weights on the GPU: the decode GEMV with the weights
// dequantized in registers, and dequantization of rows (prefill slabs for torch's GEMM, embedding
// lookups).  The weights are kernels_cpu.quant's row tiles, as the CPU holds them: scales and mins
// stored [n_tiles, k, MR_QTILE] with the row index innermost, codes [n_tiles, bytes / 4, MR_QTILE, 4]
// (four bytes of a row side by side), so the 64 threads of a tile that read one element of 64 rows
// read one contiguous run of 64 (codes: 256) bytes.
// Formats and code layouts: kernels_cpu/quant.py's docstring.  Float16 scales travel as their bits.
//
//   qgemv_<fmt>    out[r] += sum_{i in the block's K range} W[r, i] * x[i]   (out zeroed first)
//                  grid (n_tiles, n_split), block MR_QGEMV_THREADS = MR_QTILE rows x 4 column groups,
//                  K range kchunk columns (a multiple of 32), dynamic shared memory
//                  (kchunk + kchunk / 32) floats: the range of x and its 32-column sums. Each column
//                  group takes every 4th 32-column block of the range: a block's scales are read
//                  once and each code byte once (two 4-bit codes), its dot with x is d * sum(q x)
//                  (+ m * sum(x)); the 4 partial sums of a row are added in shared memory, then into
//                  out with one atomicAdd per row.
//   qrows_<fmt>    out[k, i] = W[ids[k], i] (float32), grid-stride over n * I elements.
//
// Compiled without --use_fast_math.

#include "common.cuh"

#define MR_QTILE 64
#define MR_QGEMV_THREADS 256

__device__ __forceinline__ long long mr_qidx(long long t, int k, int i, int r) {
    // element (t, i, r) of a part [n_tiles, k, MR_QTILE]
    return (t * k + i) * MR_QTILE + r;
}

__device__ __forceinline__ long long mr_qbyte(long long t, int nbytes, int k, int r) {
    // byte k of row r of tile t in a code part [n_tiles, nbytes / 4, MR_QTILE, 4]
    return mr_qidx(t, nbytes / 4, k / 4, r) * 4 + (k & 3);
}

// Each format: W(t, i, r), the weight of column i of row r of tile t, from its parts.
// ... and dot(t, b, r, xb, xsum): sum over the 32 columns of block b of W(t, i, r) * xb[i - 32 b]
// (xsum: the sum of those xb).
struct MrQ8_0 {   // codes [n_tiles, I/4, MR_QTILE, 4]: four columns of a row side by side
    const unsigned char* qs; const unsigned short* d; int I;
    __device__ __forceinline__ float code(long long t, int i, int r) const {
        return (float)(signed char)qs[mr_qbyte(t, I, i, r)];
    }
    __device__ __forceinline__ float w(long long t, int i, int r) const {
        return mr_half_to_float(d[mr_qidx(t, I / 32, i / 32, r)]) * code(t, i, r);
    }
    __device__ __forceinline__ float dot(long long t, int b, int r, const float* xb, float) const {
        float s = 0.f;
#pragma unroll 8
        for (int e = 0; e < 32; ++e) s = fmaf(code(t, b * 32 + e, r), xb[e], s);
        return mr_half_to_float(d[mr_qidx(t, I / 32, b, r)]) * s;
    }
};

// sum over a 4-bit block's 16 bytes (byte k: element k low, k + 16 high) of q * x
__device__ __forceinline__ float mr_q4_dot16(const unsigned char* qs, int I, long long t, int k0, int r,
                                             const float* xb) {
    float s = 0.f;
#pragma unroll 8
    for (int k = 0; k < 16; ++k) {
        const int byte = qs[mr_qbyte(t, I / 2, k0 + k, r)];
        s = fmaf((float)(byte & 15), xb[k], s);
        s = fmaf((float)(byte >> 4), xb[k + 16], s);
    }
    return s;
}

__device__ __forceinline__ int mr_q4_code(const unsigned char* qs, int I, long long t, int i, int r) {
    const int b = i / 32, e = i % 32;
    const unsigned char byte = qs[mr_qbyte(t, I / 2, b * 16 + (e & 15), r)];
    return e < 16 ? (byte & 15) : (byte >> 4);
}

struct MrQ4_0 {
    const unsigned char* qs; const unsigned short* d; int I;
    __device__ __forceinline__ float w(long long t, int i, int r) const {
        return mr_half_to_float(d[mr_qidx(t, I / 32, i / 32, r)]) * (float)(mr_q4_code(qs, I, t, i, r) - 8);
    }
    __device__ __forceinline__ float dot(long long t, int b, int r, const float* xb, float xsum) const {
        return mr_half_to_float(d[mr_qidx(t, I / 32, b, r)]) * (mr_q4_dot16(qs, I, t, b * 16, r, xb) - 8.f * xsum);
    }
};

struct MrQ4_1 {
    const unsigned char* qs; const unsigned short* d; const unsigned short* m; int I;
    __device__ __forceinline__ float w(long long t, int i, int r) const {
        const long long s = mr_qidx(t, I / 32, i / 32, r);
        return mr_half_to_float(d[s]) * (float)mr_q4_code(qs, I, t, i, r) + mr_half_to_float(m[s]);
    }
    __device__ __forceinline__ float dot(long long t, int b, int r, const float* xb, float xsum) const {
        const long long s = mr_qidx(t, I / 32, b, r);
        return mr_half_to_float(d[s]) * mr_q4_dot16(qs, I, t, b * 16, r, xb) + mr_half_to_float(m[s]) * xsum;
    }
};

struct MrQ4_K {
    const unsigned char* qs; const unsigned short* d; const unsigned short* dmin;
    const unsigned char* sc; const unsigned char* mn; int I;
    __device__ __forceinline__ float w(long long t, int i, int r) const {
        const int sb = i / 256, e = i % 256, c = e / 64, l = e % 64;
        const unsigned char byte = qs[mr_qbyte(t, I / 2, sb * 128 + c * 32 + (l & 31), r)];
        const int q = l < 32 ? (byte & 15) : (byte >> 4);
        const long long j = mr_qidx(t, I / 32, i / 32, r), s = mr_qidx(t, I / 256, sb, r);
        return mr_half_to_float(d[s]) * (float)sc[j] * (float)q - mr_half_to_float(dmin[s]) * (float)mn[j];
    }
    // block b = sub-block j = b % 8 of super-block b / 8: bytes 32 (j / 2) + l, low nibble for even j
    __device__ __forceinline__ float dot(long long t, int b, int r, const float* xb, float xsum) const {
        const int sb = b / 8, j = b % 8, shift = (j & 1) * 4;
        float q = 0.f;
#pragma unroll 8
        for (int l = 0; l < 32; ++l)
            q = fmaf((float)((qs[mr_qbyte(t, I / 2, sb * 128 + (j / 2) * 32 + l, r)] >> shift) & 15), xb[l], q);
        const long long jj = mr_qidx(t, I / 32, b, r), s = mr_qidx(t, I / 256, sb, r);
        return mr_half_to_float(d[s]) * (float)sc[jj] * q - mr_half_to_float(dmin[s]) * (float)mn[jj] * xsum;
    }
};

struct MrQ6_K {
    const unsigned char* ql; const unsigned char* qh; const unsigned char* sc; const unsigned short* d; int I;
    __device__ __forceinline__ float w(long long t, int i, int r) const {
        const int sb = i / 256, e = i % 256, h = e / 128, s = (e % 128) / 32, l = e % 32;
        const unsigned char lo = ql[mr_qbyte(t, I / 2, sb * 128 + h * 64 + 32 * (s & 1) + l, r)];
        const unsigned char hb = qh[mr_qbyte(t, I / 4, sb * 64 + h * 32 + l, r)];
        const int q = ((s < 2 ? (lo & 15) : (lo >> 4)) | (((hb >> (2 * s)) & 3) << 4)) - 32;
        return mr_half_to_float(d[mr_qidx(t, I / 256, sb, r)]) * (float)(signed char)sc[mr_qidx(t, I / 16, i / 16, r)]
               * (float)q;
    }
    __device__ __forceinline__ float dot(long long t, int b, int r, const float* xb, float) const {
        float s = 0.f;
        for (int e = 0; e < 32; ++e) s = fmaf(w(t, b * 32 + e, r), xb[e], s);
        return s;
    }
};

template <typename F>
__device__ __forceinline__ void qgemv_impl(const F& f, int I, int rows, const float* __restrict__ x, int kchunk,
                                           float* __restrict__ out) {
    __shared__ float part[MR_QGEMV_THREADS];
    MR_DYN_SMEM(xs);                   // [kchunk] x of the range, then [kchunk / 32] its block sums
    const int groups = MR_QGEMV_THREADS / MR_QTILE;
    const int r = threadIdx.x % MR_QTILE, g = threadIdx.x / MR_QTILE;
    const long long t = blockIdx.x;
    const int i0 = blockIdx.y * kchunk, i1 = i0 + kchunk < I ? i0 + kchunk : I;
    const int nb = (i1 - i0) / 32;     // (I and kchunk are multiples of 32)
    float* xsum = xs + kchunk;
    for (int i = threadIdx.x; i < i1 - i0; i += blockDim.x) xs[i] = x[i0 + i];
    __syncthreads();
    for (int b = threadIdx.x; b < nb; b += blockDim.x) {
        float s = 0.f;
        for (int e = 0; e < 32; ++e) s += xs[b * 32 + e];
        xsum[b] = s;
    }
    __syncthreads();
    float acc = 0.f;
    for (int b = g; b < nb; b += groups) acc += f.dot(t, i0 / 32 + b, r, xs + b * 32, xsum[b]);
    part[threadIdx.x] = acc;
    __syncthreads();
    if (g == 0) {
        for (int k = 1; k < groups; ++k) acc += part[k * MR_QTILE + r];
        const long long row = t * MR_QTILE + r;
        if (row < rows) atomicAdd(out + row, acc);
    }
}

template <typename F>
__device__ __forceinline__ void qrows_impl(const F& f, int I, const long long* __restrict__ ids, int n,
                                           float* __restrict__ out) {
    const long long total = (long long)n * I;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += stride) {
        const long long row = ids[k / I];
        const int i = (int)(k % I);
        out[k] = f.w(row / MR_QTILE, i, (int)(row % MR_QTILE));
    }
}

// (the parameter lists are written out: the tests' emulator reads the kernels' signatures from this text)
extern "C" __global__ void __launch_bounds__(MR_QGEMV_THREADS)
qgemv_q8_0(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ d, int I, int rows,
           const float* __restrict__ x, int kchunk, float* __restrict__ out) {
    qgemv_impl(MrQ8_0{qs, d, I}, I, rows, x, kchunk, out);
}
extern "C" __global__ void __launch_bounds__(MR_QGEMV_THREADS)
qgemv_q4_0(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ d, int I, int rows,
           const float* __restrict__ x, int kchunk, float* __restrict__ out) {
    qgemv_impl(MrQ4_0{qs, d, I}, I, rows, x, kchunk, out);
}
extern "C" __global__ void __launch_bounds__(MR_QGEMV_THREADS)
qgemv_q4_1(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ d,
           const unsigned short* __restrict__ m, int I, int rows, const float* __restrict__ x, int kchunk,
           float* __restrict__ out) {
    qgemv_impl(MrQ4_1{qs, d, m, I}, I, rows, x, kchunk, out);
}
extern "C" __global__ void __launch_bounds__(MR_QGEMV_THREADS)
qgemv_q4_k(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ d,
           const unsigned short* __restrict__ dmin, const unsigned char* __restrict__ sc,
           const unsigned char* __restrict__ mn, int I, int rows, const float* __restrict__ x, int kchunk,
           float* __restrict__ out) {
    qgemv_impl(MrQ4_K{qs, d, dmin, sc, mn, I}, I, rows, x, kchunk, out);
}
extern "C" __global__ void __launch_bounds__(MR_QGEMV_THREADS)
qgemv_q6_k(const unsigned char* __restrict__ ql, const unsigned char* __restrict__ qh,
           const unsigned char* __restrict__ sc, const unsigned short* __restrict__ d, int I, int rows,
           const float* __restrict__ x, int kchunk, float* __restrict__ out) {
    qgemv_impl(MrQ6_K{ql, qh, sc, d, I}, I, rows, x, kchunk, out);
}
extern "C" __global__ void 
qrows_q8_0(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ d, int I,
           const long long* __restrict__ ids, int n, float* __restrict__ out) {
    qrows_impl(MrQ8_0{qs, d, I}, I, ids, n, out);
}
extern "C" __global__ void 
qrows_q4_0(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ d, int I,
           const long long* __restrict__ ids, int n, float* __restrict__ out) {
    qrows_impl(MrQ4_0{qs, d, I}, I, ids, n, out);
}
extern "C" __global__ void 
qrows_q4_1(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ d,
           const unsigned short* __restrict__ m, int I, const long long* __restrict__ ids, int n,
           float* __restrict__ out) {
    qrows_impl(MrQ4_1{qs, d, m, I}, I, ids, n, out);
}
extern "C" __global__ void 
qrows_q4_k(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ d,
           const unsigned short* __restrict__ dmin, const unsigned char* __restrict__ sc,
           const unsigned char* __restrict__ mn, int I, const long long* __restrict__ ids, int n,
           float* __restrict__ out) {
    qrows_impl(MrQ4_K{qs, d, dmin, sc, mn, I}, I, ids, n, out);
}
extern "C" __global__ void 
qrows_q6_k(const unsigned char* __restrict__ ql, const unsigned char* __restrict__ qh,
           const unsigned char* __restrict__ sc, const unsigned short* __restrict__ d, int I,
           const long long* __restrict__ ids, int n, float* __restrict__ out) {
    qrows_impl(MrQ6_K{ql, qh, sc, d, I}, I, ids, n, out);
}
