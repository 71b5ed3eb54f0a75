"""Fused one-token (decode) kernels for a Llama layer on the CPU, float32 or bfloat16 weights.

Why fused: a decode step is 4 weight GEMVs per layer plus ~60 small element-wise torch ops, and
on a 2-core CPU the dispatch of those small ops costs as much as a third of the step
(docs/PROFILE.md). Two calls per layer replace them; the attention itself stays outside (it is
the KV cache's business):

  attn_in:   xn = rms_norm(x) * w_norm;  qkv = W_qkv @ xn;  RoPE on the q and k heads
  attn_out:  x = x + W_o @ o;  xn = rms_norm(x) * w_norm;  g, u = W_gate_up @ xn;
             x = x + W_down @ (silu(g) * u)

Weights are float32 arrays or bfloat16 bit patterns (uint16 arrays; NumPy has no bfloat16).
Activations stay float32 inside a kernel; what leaves it (q, k, v, the residual x) is stored in
the weights' dtype, as the torch layer loop would hold it. Each kernel has a NumPy reference in
kernels_cpu.reference (`attn_in_ref`, `attn_out_ref`).
"""

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._common import _prefetch
from .bf16 import bf16_to_f32, f32_to_bf16

_FASTMATH = {"reassoc", "contract"}   # vectorized reductions; NaN/inf still propagate
_ROWS_PER_TASK = 16
_PREFETCH_ROWS = 4


def _wf(x):  # pragma: no cover - replaced by the overload inside njit code
    raise NotImplementedError


@overload(_wf)
def _wf_impl(x):
    """Weight/activation element as float32: bfloat16 bits (uint16) widened, floats cast."""
    if isinstance(x, types.Integer) and x.bitwidth == 16 and not x.signed:
        return lambda x: bf16_to_f32(x)
    if isinstance(x, types.Float):
        return lambda x: np.float32(x)
    return None


def _st(out, i, v):  # pragma: no cover - replaced by the overload inside njit code
    raise NotImplementedError


@overload(_st)
def _st_impl(out, i, v):
    """out[i] = v in out's dtype (bfloat16 bits: round to nearest even)."""
    if isinstance(out.dtype, types.Integer):
        def impl(out, i, v):
            out[i] = f32_to_bf16(v)
        return impl

    def impl_f(out, i, v):
        out[i] = v
    return impl_f


@njit(fastmath=_FASTMATH, inline="always")
def _rms_norm(x, w, eps, out):
    """out = x / sqrt(mean(x^2) + eps) * w, float32 (x, w: weights' dtype)."""
    n = x.shape[0]
    ss = np.float32(0.0)
    for i in range(n):
        v = _wf(x[i])
        ss += v * v
    r = np.float32(1.0 / np.sqrt(ss / n + eps))
    for i in range(n):
        out[i] = _wf(x[i]) * r * _wf(w[i])


@njit(parallel=True, fastmath=_FASTMATH, cache=True)
def _gemv_f32(w, x, out):
    """out [O] (float32) = w [O, I] @ x [I] (float32); w float32 or bfloat16 bits.

    Each row's cache lines are prefetched _PREFETCH_ROWS rows ahead: +15-20% of memory bandwidth
    on the 2-core VM (16 -> 19 GB/s in bfloat16), where the hardware prefetcher alone falls short.
    """
    O, I = w.shape
    line = 64 // w.itemsize
    for b in prange((O + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        for r in range(b * _ROWS_PER_TASK, min(O, (b + 1) * _ROWS_PER_TASK)):
            if r + _PREFETCH_ROWS < O:
                ahead = (r + _PREFETCH_ROWS) * I
                for c in range(0, I, line):
                    _prefetch(w, ahead + c)
            acc = np.float32(0.0)
            for i in range(I):
                acc += _wf(w[r, i]) * x[i]
            out[r] = acc


@njit(cache=True, fastmath=_FASTMATH)
def _k_attn_in(x, w_norm, eps, w_qkv, pos, inv_freq, n_rot, head_dim, out):
    """x [D], w_norm [D], w_qkv [(Hq+2Hkv)*hd, D], inv_freq [hd/2] f64 -> out [(Hq+2Hkv)*hd]."""
    D = x.shape[0]
    xn = np.empty(D, np.float32)
    _rms_norm(x, w_norm, eps, xn)
    y = np.empty(w_qkv.shape[0], np.float32)
    _gemv_f32(w_qkv, xn, y)
    half = head_dim // 2
    cos = np.empty(half, np.float32)
    sin = np.empty(half, np.float32)
    for j in range(half):                      # angles in float64: positions in the millions keep their phase
        ang = np.float64(pos) * inv_freq[j]
        cos[j] = np.cos(ang)
        sin[j] = np.sin(ang)
    for h in range(n_rot):                     # q heads then k heads: the rotated ones
        b = h * head_dim
        for j in range(half):
            x1, x2 = y[b + j], y[b + half + j]
            y[b + j] = x1 * cos[j] - x2 * sin[j]
            y[b + half + j] = x2 * cos[j] + x1 * sin[j]
    for i in range(y.shape[0]):
        _st(out, i, y[i])


@njit(cache=True, fastmath=_FASTMATH)
def _k_attn_out(x, o, w_o, w_norm, eps, w_gate_up, w_down, out):
    """x [D], o [Hq*hd], w_o [D, Hq*hd], w_norm [D], w_gate_up [2F, D], w_down [D, F] -> out [D]."""
    D = x.shape[0]
    of = np.empty(o.shape[0], np.float32)
    for i in range(o.shape[0]):
        of[i] = _wf(o[i])
    h = np.empty(D, np.float32)
    _gemv_f32(w_o, of, h)
    x1 = np.empty(D, x.dtype)                  # the residual after attention, in the model dtype
    for i in range(D):
        _st(x1, i, _wf(x[i]) + h[i])
    xn = np.empty(D, np.float32)
    _rms_norm(x1, w_norm, eps, xn)
    F = w_gate_up.shape[0] // 2
    gu = np.empty(2 * F, np.float32)
    _gemv_f32(w_gate_up, xn, gu)
    a = np.empty(F, np.float32)
    for i in range(F):
        g = gu[i]
        a[i] = g / (np.float32(1.0) + np.exp(-g)) * gu[F + i]
    _gemv_f32(w_down, a, h)
    for i in range(D):
        _st(out, i, _wf(x1[i]) + h[i])


@njit(cache=True, fastmath=_FASTMATH)
def _k_norm_gemv(x, w_norm, eps, w, out):
    """out [O] (float32) = w [O, D] @ (rms_norm(x) * w_norm): the final norm and the LM head."""
    xn = np.empty(x.shape[0], np.float32)
    _rms_norm(x, w_norm, eps, xn)
    _gemv_f32(w, xn, out)


def _check(name, w, *acts):
    if w.dtype not in (np.float32, np.uint16) or any(a.dtype != w.dtype for a in acts):
        raise ValueError(f"{name}: weights and activations must all be float32 or all bfloat16 bits (uint16), "
                         f"got {w.dtype} and {[str(a.dtype) for a in acts]}")


def attn_in(x, w_norm, eps, w_qkv, pos, inv_freq, n_rot, head_dim, out=None):
    """rms_norm -> fused QKV GEMV -> RoPE (half-split) at position `pos` on the first n_rot heads.

    x, w_norm [D]; w_qkv [(Hq+2Hkv)*hd, D] (C-contiguous), all in one dtype (float32, or uint16
    bfloat16 bits); inv_freq [hd/2] float64 (RoPE angles pos * inv_freq in float64).
    Returns out [(Hq+2Hkv)*hd] in the weights' dtype: q heads, k heads (rotated), v heads.
    """
    _check("attn_in", w_qkv, x, w_norm)
    if out is None:
        out = np.empty(w_qkv.shape[0], w_qkv.dtype)
    _k_attn_in(x, w_norm, np.float32(eps), w_qkv, int(pos), np.ascontiguousarray(inv_freq, np.float64),
               n_rot, head_dim, out)
    return out


def attn_out(x, o, w_o, w_norm, eps, w_gate_up, w_down, out=None):
    """x + W_o @ o, then + W_down @ swiglu(W_gate_up @ rms_norm(.)): the rest of the layer.

    x [D], o [Hq*hd], w_o [D, Hq*hd], w_norm [D], w_gate_up [2F, D] (gate rows then up rows),
    w_down [D, F]; one dtype (float32 or bfloat16 bits). Returns the new residual out [D].
    """
    _check("attn_out", w_o, x, o, w_norm, w_gate_up, w_down)
    if out is None:
        out = np.empty(x.shape[0], x.dtype)
    _k_attn_out(x, o, w_o, w_norm, np.float32(eps), w_gate_up, w_down, out)
    return out


def norm_gemv(x, w_norm, eps, w, out=None):
    """(rms_norm(x) * w_norm) @ w^T as float32 [O]: the final norm and LM head of a decode step."""
    _check("norm_gemv", w, x, w_norm)
    if out is None:
        out = np.empty(w.shape[0], np.float32)
    _k_norm_gemv(x, w_norm, np.float32(eps), w, out)
    return out

