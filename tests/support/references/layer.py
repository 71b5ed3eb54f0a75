"""Plain NumPy references for one decode layer's kernels (kernels_cpu.decode, kernels_cpu.dense,
and turn_rows) and the bfloat16 conversions they share: norm + QKV + RoPE, output projection + MLP,
the final norm and LM head, dense attention. Activations and weights are float32 or bfloat16 bits
(uint16); the references compute in float64 and round as the kernels store (``_narrow``).
"""
from __future__ import annotations

import numpy as np


def bf16_bits_to_float_ref(h):
    """bfloat16 bits uint16 [...] -> float32 [...] (exact: the bits are the float32's top half)."""
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float_to_bf16_bits_ref(f):
    """float32 [...] -> bfloat16 bits uint16 [...], round to nearest even; NaN stays a (quiet) NaN."""
    u = np.asarray(f, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return r


def _wide(a):
    """float32 array or bfloat16 bits (uint16) -> float64."""
    a = np.asarray(a)
    return (bf16_bits_to_float_ref(a) if a.dtype == np.uint16 else a).astype(np.float64)


def _narrow(y, like):
    """float64 -> float32, then to bfloat16 bits when `like` holds bfloat16 bits."""
    y = np.asarray(y, dtype=np.float32)
    return float_to_bf16_bits_ref(y) if np.asarray(like).dtype == np.uint16 else y


def _rms_norm_ref(x, w, eps):
    x = _wide(x)
    return x / np.sqrt(np.mean(x * x) + eps) * _wide(w)


def attn_in_ref(x, w_norm, eps, w_qkv, pos, inv_freq, n_rot, head_dim, bias=None, head_norms=None, n_q=0):
    """x [D], w_norm [D], w_qkv [(Hq+2Hkv)*hd, D], inv_freq [hd/2] -> qkv [(Hq+2Hkv)*hd] in the
    weights' dtype: + bias [(Hq+2Hkv)*hd] where given, each of the first n_q heads RMS-normalized
    with head_norms[0] and the other rotated ones with head_norms[1] where given, then RoPE
    (half-split) at position pos applied to the first n_rot heads (q, then k)."""
    y = _wide(w_qkv) @ _rms_norm_ref(x, w_norm, eps)
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    heads = y[:n_rot * head_dim].reshape(n_rot, head_dim)
    if head_norms is not None:
        for h in range(n_rot):
            heads[h] = _rms_norm_ref(heads[h], head_norms[0 if h < n_q else 1], eps)
    ang = float(pos) * np.asarray(inv_freq, np.float64)
    c, s_ = np.cos(ang), np.sin(ang)
    half = head_dim // 2
    x1, x2 = heads[:, :half].copy(), heads[:, half:].copy()
    heads[:, :half] = x1 * c - x2 * s_
    heads[:, half:] = x2 * c + x1 * s_
    return _narrow(y, w_qkv)


def attn_out_ref(x, o, w_o, w_norm, eps, w_gate_up, w_down, post_norms=None, act="silu"):
    """x + W_o @ o (stored in the weights' dtype), then + W_down @ (act(g) * u) with
    g, u = W_gate_up @ rms_norm(.): the new residual [D] in the weights' dtype. post_norms [2, D]:
    W_o @ o and the MLP's output each RMS-normalized (with its row) before it is added; act "silu"
    or "gelu_pytorch_tanh" (GELU, tanh form)."""
    h = _wide(w_o) @ _wide(o)
    if post_norms is not None:
        h = _rms_norm_ref(h, post_norms[0], eps)
    x1 = _wide(_narrow(_wide(x) + h, w_o))
    gu = _wide(w_gate_up) @ _rms_norm_ref(x1, w_norm, eps)
    F = gu.shape[0] // 2
    g, u = gu[:F], gu[F:]
    if act == "silu":
        a = g / (1.0 + np.exp(-g))
    else:
        a = 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))
    h = _wide(w_down) @ (a * u)
    if post_norms is not None:
        h = _rms_norm_ref(h, post_norms[1], eps)
    return _narrow(x1 + h, w_o)


def norm_gemv_ref(x, w_norm, eps, w):
    """(rms_norm(x) * w_norm) @ w^T -> float32 [O]."""
    return (_wide(w) @ _rms_norm_ref(x, w_norm, eps)).astype(np.float32)



def dense_attend_ref(q, K, V, n, scale=1.0):
    """q [Hq, d], K, V [Hkv, >=n, d] float32 or bfloat16 bits -> softmax(scale q K^T) V over the
    first n keys, float32 [Hq, d]; query head h reads kv-head h // (Hq / Hkv)."""
    q = _wide(q) * scale
    rep = q.shape[0] // K.shape[0]
    Kf, Vf = _wide(K)[:, :n].repeat(rep, 0), _wide(V)[:, :n].repeat(rep, 0)   # [Hq, n, d]
    s = np.einsum("hd,hnd->hn", q, Kf)
    w = np.exp(s - s.max(1, keepdims=True))
    return (np.einsum("hn,hnd->hd", w, Vf) / w.sum(1, keepdims=True)).astype(np.float32)


def turn_rows_ref(EK, start, cos, sin):
    """EK [Hkv, n, d] -> rows [0, start) as they are, rows [start, n) rotated by (cos, sin) [d/2]
    (half split: [x1 c - x2 s, x2 c + x1 s]), computed in float64 -> float32."""
    EK = np.asarray(EK, np.float64)
    out = EK.copy()
    h = EK.shape[2] // 2
    c, s = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
    x1, x2 = EK[:, start:, :h], EK[:, start:, h:]
    out[:, start:, :h] = x1 * c - x2 * s
    out[:, start:, h:] = x2 * c + x1 * s
    return out.astype(np.float32)
