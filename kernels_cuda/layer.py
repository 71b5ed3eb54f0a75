"""Wrappers of layer.cu: the small ops around a Llama layer's GEMMs for a decode token on the GPU.

minirun/model/ops.py calls them once per layer and token instead of ~30 torch ops (docs/PROFILE.md:
a decode token of SmolLM2 on an H100 was bound by op launches), so the checks
here are few: dtype (float32 or bfloat16, the same for every tensor) and contiguous rows. Outputs
are allocated with torch; launches go to torch's current stream. References: the torch functions
they replace (minirun.model.ops.rms_norm, apply_rope, swiglu's silu * up), compared in
tests/kernels/test_kernels_cuda_layer.py.
"""

from __future__ import annotations

import numpy as np

from . import _sources
from .launch import _backend, _cdiv, _i32, _i64, _torch

__all__ = ["rms_norm", "add_rms_norm", "rope_", "silu_mul", "rope_store"]

_THREADS = _sources.constant("layer.cu", "MR_LAYER_THREADS")
_ROPE_THREADS = _sources.constant("layer.cu", "MR_ROPE_THREADS")
_SUFFIX = {"torch.float32": "f32", "torch.bfloat16": "bf16"}


def _suffix(*ts) -> str:
    dt = ts[0].dtype
    s = _SUFFIX.get(str(dt))
    if s is None or any(t.dtype != dt for t in ts):
        raise TypeError(f"layer kernels take float32 or bfloat16 tensors of one dtype, got {[t.dtype for t in ts]}")
    return s


def rms_norm(x, w, eps):
    """x [rows, D] (contiguous rows), w [D] -> w * (x * rsqrt(mean(x^2) + eps)) [rows, D]."""
    sfx = _suffix(x, w)
    rows, D = x.shape
    y = _torch().empty((rows, D), dtype=x.dtype, device=x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    with _backend().session(x.device) as L:
        L.launch("layer.cu", "rms_norm_" + sfx, (rows,), (_THREADS,),
                 (x, _i64(x.stride(0)), w, np.float32(eps), _i32(D), y, _i64(D)), shared_mem=D * 4)
    return y


def add_rms_norm(x, r, w, eps):
    """x, r [rows, D] contiguous, w [D] -> (s = x + r, rms_norm(s, w, eps)), both [rows, D]."""
    sfx = _suffix(x, r, w)
    rows, D = x.shape
    x, r = x.contiguous(), r.contiguous()
    s = _torch().empty_like(x)
    y = _torch().empty_like(x)
    with _backend().session(x.device) as L:
        L.launch("layer.cu", "add_rms_norm_" + sfx, (rows,), (_THREADS,), (x, r, w, np.float32(eps), _i32(D), s, y),
                 shared_mem=D * 4)
    return s, y


def rope_(x, n_rot, d, cs):
    """x [rows, >= n_rot * d] (contiguous rows; heads of d elements), cs [d] = cos | sin of one
    position, x's dtype -> x, its first n_rot heads rotated in place (HF Llama's half split)."""
    sfx = _suffix(x, cs)
    if x.stride(-1) != 1 or x.shape[-1] < n_rot * d or d % 2 or cs.shape[-1] != d:
        raise ValueError(f"rope_: x {tuple(x.shape)}, n_rot {n_rot}, d {d}, cs {tuple(cs.shape)}")
    with _backend().session(x.device) as L:
        L.launch("layer.cu", "rope_" + sfx, (x.shape[0],), (_THREADS,),
                 (x, _i64(x.stride(0)), _i32(n_rot), _i32(d), cs.contiguous()))
    return x


def silu_mul(gu):
    """gu [rows, 2F] (gate | up, contiguous) -> silu(gate) * up [rows, F]."""
    sfx = _suffix(gu)
    rows, F2 = gu.shape
    F = F2 // 2
    gu = gu.contiguous()
    y = _torch().empty((rows, F), dtype=gu.dtype, device=gu.device)
    with _backend().session(gu.device) as L:
        L.launch("layer.cu", "silu_mul_" + sfx, (rows, _cdiv(F, _THREADS)), (_THREADS,), (gu, _i32(F), y))
    return y


def rope_store(q, k, v, cs, pos, scale, qs, K, V, live, n_live):
    """One token's input to dense attention, unrotated: q [Hq, d], k, v [Hkv, d] (rows contiguous),
    cs [d] = cos | sin of its position, pos int64 [1] on the device (the position), K, V [Hkv, cap, d]
    (rows contiguous), all of one dtype. Writes qs [Hq, d] float32 = rope(q) * scale, rope(k) and v
    into K, V at row pos[0], and live (uint8) [:n_live] = arange(n_live) <= pos[0] (n_live 0: nothing). -> qs"""
    sfx = _suffix(q, k, v, cs, K, V)
    Hq, d = q.shape
    Hkv = k.shape[0]
    if K.stride(1) != d or V.stride(1) != d or K.stride(0) != V.stride(0) or d % 2 or cs.shape[-1] != d:
        raise ValueError(f"rope_store: K {tuple(K.shape)} strides {K.stride()}, V strides {V.stride()}, d {d}")
    with _backend().session(q.device) as L:
        L.launch("layer.cu", "rope_store_" + sfx, (Hq + 2 * Hkv,), (_ROPE_THREADS,),
                 (q, _i64(q.stride(0)), k, _i64(k.stride(0)), v, _i64(v.stride(0)), _i32(Hq), _i32(Hkv), _i32(d), cs,
                  pos, np.float32(scale), qs, K, V, _i64(K.stride(0)), live, _i32(n_live)))
    return qs
