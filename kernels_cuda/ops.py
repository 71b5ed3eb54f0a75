"""The checked CuPy wrapper of kernels_cuda's key encoder (the runtime's one launch outside the decode
steps: minirun/kv/hca_cuda.py encodes the keys leaving the ring with it).

It takes and returns torch CUDA tensors (zero-copy through DLPack: ``cupy.from_dlpack(t)``),
allocates its output with torch (stream-ordered caching allocator) and launches on torch's current
CUDA stream of the input's device (``cupy.cuda.ExternalStream``). Nothing synchronizes the device
or copies to the host; argument checks use shapes, dtypes, strides and devices only.

Launch geometry: pq.cu; backends and the other kernels' launches: kernels_cuda.launch.
"""
from __future__ import annotations

from .launch import (_ENC_THREADS, _ENC_TOK, _KV_SUFFIX, _MAX_GRID_YZ, _SMEM_MARGIN, _backend, _cdiv, _check, _f32c,
                     _i32, _i64, _rows, _torch)

__all__ = ["encode_keys"]


def encode_keys(K, codebooks):
    """K [Hkv, n, d] f32 / f16 / bf16 (any strides with a contiguous last axis),
    codebooks [Hkv, g, c, ds] f32 -> P [Hkv, n, g], uint8 if c <= 256 else int16 (c <= 32768):
    nearest centroid per group by squared L2, evaluated as argmax(x.c - |c|^2/2) in
    float32, ties -> lowest index."""
    torch = _torch()
    be = _backend()
    _check(be, K, "K", 3)
    _check(be, codebooks, "codebooks", 4, K.device)
    Hkv, n, d = K.shape
    Hkv2, g, c, ds = codebooks.shape
    if Hkv2 != Hkv or g * ds != d:
        raise ValueError(f"codebooks {tuple(codebooks.shape)} do not match K {tuple(K.shape)}")
    if str(K.dtype) not in _KV_SUFFIX:
        raise TypeError(f"K must be float32, float16 or bfloat16, got {K.dtype}")
    if not 1 <= c <= 32768:
        raise ValueError(f"c={c} outside [1, 32768]")
    if g > _MAX_GRID_YZ or Hkv > _MAX_GRID_YZ:
        raise ValueError("g and Hkv must be <= 65535")
    dev = K.device
    res = be.empty((Hkv, n, g), torch.uint8 if c <= 256 else torch.int16, dev)
    if res.numel() == 0:
        return res
    _, optin = be.device_info(dev)
    smem = c * (ds + 1) * 4
    if smem > optin - _SMEM_MARGIN:
        raise ValueError(f"codebook of {c} x {ds} floats does not fit in shared memory")
    Kr = _rows(K)
    cb = _f32c(codebooks)
    kname = f"encode_keys_{_KV_SUFFIX[str(K.dtype)]}_{'u8' if c <= 256 else 'i16'}"
    # a decode step's eviction encodes one token a row: a warp a block then, not 256 threads of
    # which 255 idle while one walks the codebook (2880 such blocks took ~200 us on an H100)
    threads = 32 if n <= 32 * _ENC_TOK else _ENC_THREADS
    grid = (_cdiv(n, threads * _ENC_TOK), g, Hkv)
    with be.session(dev) as L:
        L.launch("pq.cu", kname, grid, (threads,),
                 (Kr, _i64(Kr.stride(0)), _i64(Kr.stride(1)), cb, res, _i64(res.stride(0)), _i64(res.stride(1)),
                  _i32(n), _i32(d), _i32(g), _i32(c)),
                 shared_mem=smem)  # fmt: skip
    return res
