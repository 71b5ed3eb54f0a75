"""Fused one-token (decode) kernels for a Llama layer on the CPU, float32 or bfloat16 weights.

Why fused: a decode step is 4 weight GEMVs per layer plus ~60 small element-wise torch ops, and
on a 2-core CPU the dispatch of those small ops costs as much as a third of the step
(docs/PROFILE.md). Two calls per layer replace them; the attention itself stays outside (it is
the KV cache's business):

  attn_in:   xn = rms_norm(x) * w_norm;  qkv = W_qkv @ xn;  RoPE on the q and k heads
  attn_out:  x = x + W_o @ o;  xn = rms_norm(x) * w_norm;  g, u = W_gate_up @ xn;
             x = x + W_down @ (silu(g) * u)

Other architectures add to that layer: a QKV bias and the heads' norms before RoPE in attn_in
(Qwen2, Qwen3, Gemma 3); in attn_out norms of W_o @ o and of the MLP's output before each
residual add, and GELU (tanh form) in silu's place (Gemma 3).

Weights are float32 arrays or bfloat16 bit patterns (uint16 arrays; NumPy has no bfloat16).
Activations stay float32 inside a kernel; what leaves it (q, k, v, the residual x) is stored in
the weights' dtype, as the torch layer loop would hold it. Each kernel has a NumPy reference in
tests/support/references/cpu.py (`attn_in_ref`, `attn_out_ref`).
"""

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._common import _FASTMATH, _u32_as_f32
from .bf16 import bf16_to_f32, f32_to_bf16

_ROWS_PER_TASK = 16

#: the MLP's gate activation (the hidden_act names of config.json) -> attn_out's `act` argument
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


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
def _gemm_rows_f32(w, X, out):
    """out [B, O] = X [B, I] @ w [O, I]^T, all float32: each weight row is read from memory once
    and dotted with the B rows of X while it is in L1. Each row is a contiguous 1-D view: indexing
    w[r, i] instead left LLVM with partly scalar code (~0.88x the time per step this way on a Zen
    4, scripts/bench_decode_kernels.py)."""
    O = w.shape[0]
    for blk in prange((O + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        for r in range(blk * _ROWS_PER_TASK, min(O, (blk + 1) * _ROWS_PER_TASK)):
            row = w[r]
            for b in range(X.shape[0]):
                x = X[b]
                acc = np.float32(0.0)
                for i in range(row.shape[0]):
                    acc += row[i] * x[i]
                out[b, r] = acc


@njit(parallel=True, fastmath=_FASTMATH, cache=True)
def _gemm_rows_bf16_pairs(w2, X_even, X_odd, out):
    """out [B, O] = X @ w^T for bfloat16 weights read as uint32 pairs w2 [O, I/2]: the low half of
    each word is element 2i, the high half element 2i+1 (little endian), so both widen to float32
    with one shift or one mask and every lane stays 32 bits wide, which vectorizes; X_even =
    X[:, 0::2], X_odd = X[:, 1::2]. Element-wise uint16 loads were assembled word by word
    (vpinsrw) and the FMAs stayed scalar: this is ~0.79x the time per step (Zen 4)."""
    O = w2.shape[0]
    for blk in prange((O + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        for r in range(blk * _ROWS_PER_TASK, min(O, (blk + 1) * _ROWS_PER_TASK)):
            row = w2[r]
            for b in range(X_even.shape[0]):
                xe, xo = X_even[b], X_odd[b]
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                for i in range(row.shape[0]):
                    u = row[i]
                    a0 += _u32_as_f32(u << np.uint32(16)) * xe[i]
                    a1 += _u32_as_f32(u & np.uint32(0xFFFF0000)) * xo[i]
                out[b, r] = a0 + a1


def _gemm_f32(w, X, out):  # pragma: no cover - replaced by the overload inside njit code
    raise NotImplementedError


@overload(_gemm_f32)
def _gemm_f32_impl(w, X, out):
    """out [B, O] (float32) = X [B, I] (float32, C-contiguous) @ w [O, I]^T; w float32 or bfloat16
    bits (I even). B rows of X: B sequences' decode tokens, the weights read once for all.

    No software prefetch: on a Zen 4 it cost ~8% with these kernels (it had gained 15-20% on
    an Icelake with the former element-indexed kernel, which the hardware prefetcher fed worse).
    """
    if not isinstance(w, types.Array):
        return None                            # (quantized tiles: kernels_cpu.quant's overload)
    if isinstance(w.dtype, types.Integer):
        def impl_bf16(w, X, out):
            O, I = w.shape
            w2 = w.reshape(-1).view(np.uint32).reshape(O, I // 2)
            _gemm_rows_bf16_pairs(w2, X[:, 0::2].copy(), X[:, 1::2].copy(), out)
        return impl_bf16
    return lambda w, X, out: _gemm_rows_f32(w, X, out)


def _rows(w):  # pragma: no cover - replaced by the overload inside njit code
    raise NotImplementedError


@overload(_rows)
def _rows_impl(w):
    """A weight matrix's rows: a float array's first dimension (kernels_cpu.quant: its tiles' rows)."""
    if isinstance(w, types.Array):
        return lambda w: w.shape[0]
    return None


@njit(cache=True, fastmath=_FASTMATH)
def _k_attn_in(x, w_norm, eps, w_qkv, b_qkv, head_norms, n_q, pos, inv_freq, n_rot, head_dim, out):
    """B tokens, one per sequence: x [B, D], w_norm [D], w_qkv [(Hq+2Hkv)*hd, D], b_qkv f32 [(Hq+2Hkv)*hd]
    or [0] (no bias), head_norms f32 [2, hd] (q's, k's) or [0, hd] (none), n_q = Hq, pos [B] int64,
    inv_freq [hd/2] f64 -> out [B, (Hq+2Hkv)*hd]."""
    B, D = x.shape
    xn = np.empty((B, D), np.float32)
    for b in range(B):
        _rms_norm(x[b], w_norm, eps, xn[b])
    y = np.empty((B, _rows(w_qkv)), np.float32)
    _gemm_f32(w_qkv, xn, y)
    half = head_dim // 2
    cos = np.empty(half, np.float32)
    sin = np.empty(half, np.float32)
    for b in range(B):
        for j in range(half):                  # angles in float64: positions in the millions keep their phase
            ang = np.float64(pos[b]) * inv_freq[j]
            cos[j] = np.cos(ang)
            sin[j] = np.sin(ang)
        yb = y[b]
        if b_qkv.shape[0]:
            for i in range(yb.shape[0]):
                yb[i] += b_qkv[i]
        for h in range(n_rot):                 # q heads then k heads: the rotated ones
            c0 = h * head_dim
            if head_norms.shape[0]:            # each head normalized first (its own norm weights)
                _rms_norm(yb[c0:c0 + head_dim], head_norms[0 if h < n_q else 1], eps, yb[c0:c0 + head_dim])
            for j in range(half):
                x1, x2 = yb[c0 + j], yb[c0 + half + j]
                yb[c0 + j] = x1 * cos[j] - x2 * sin[j]
                yb[c0 + half + j] = x2 * cos[j] + x1 * sin[j]
        for i in range(yb.shape[0]):
            _st(out[b], i, yb[i])


_SQRT_2_OVER_PI = np.float32(np.sqrt(2.0 / np.pi))


@njit(fastmath=_FASTMATH, inline="always")
def _gelu_tanh(g):
    """GELU's tanh form (torch's gelu(approximate="tanh")), float32."""
    inner = _SQRT_2_OVER_PI * (g + np.float32(0.044715) * g * g * g)
    return np.float32(0.5) * g * (np.float32(1.0) + np.tanh(inner))


@njit(cache=True, fastmath=_FASTMATH)
def _k_attn_out(x, o, w_o, w_norm, eps, w_gate_up, w_down, post_norms, act, out):
    """B tokens: x [B, D], o [B, Hq*hd], w_o [D, Hq*hd], w_norm [D], w_gate_up [2F, D],
    w_down [D, F], post_norms f32 [2, D] (after the attention, after the MLP: Gemma 3's) or [0, D]
    (none), act 0 (silu) or 1 (GELU, tanh form) -> out [B, D]."""
    B, D = x.shape
    post = post_norms.shape[0] > 0
    of = np.empty(o.shape, np.float32)
    for b in range(B):
        for i in range(o.shape[1]):
            of[b, i] = _wf(o[b, i])
    h = np.empty((B, D), np.float32)
    _gemm_f32(w_o, of, h)
    x1 = np.empty((B, D), x.dtype)             # the residual after attention, in the model dtype
    xn = np.empty((B, D), np.float32)
    for b in range(B):
        if post:
            _rms_norm(h[b], post_norms[0], eps, h[b])
        for i in range(D):
            _st(x1[b], i, _wf(x[b, i]) + h[b, i])
        _rms_norm(x1[b], w_norm, eps, xn[b])
    F = _rows(w_gate_up) // 2
    gu = np.empty((B, 2 * F), np.float32)
    _gemm_f32(w_gate_up, xn, gu)
    a = np.empty((B, F), np.float32)
    if act == 0:
        for b in range(B):
            for i in range(F):
                g = gu[b, i]
                a[b, i] = g / (np.float32(1.0) + np.exp(-g)) * gu[b, F + i]
    else:
        for b in range(B):
            for i in range(F):
                g = gu[b, i]
                a[b, i] = _gelu_tanh(g) * gu[b, F + i]
    _gemm_f32(w_down, a, h)
    for b in range(B):
        if post:
            _rms_norm(h[b], post_norms[1], eps, h[b])
        for i in range(D):
            _st(out[b], i, _wf(x1[b, i]) + h[b, i])


@njit(cache=True, fastmath=_FASTMATH)
def _k_norm_gemv(x, w_norm, eps, w, out):
    """out [B, O] (float32) = (rms_norm(x) * w_norm) @ w^T, x [B, D]: the final norm and the LM head."""
    xn = np.empty(x.shape, np.float32)
    for b in range(x.shape[0]):
        _rms_norm(x[b], w_norm, eps, xn[b])
    _gemm_f32(w, xn, out)


_FLOAT_OR_BF16 = (np.dtype(np.float32), np.dtype(np.uint16))


def _check(name, mats, *acts):
    """mats: the weight matrices [O, I], float arrays or quantized tiles (kernels_cpu.quant, any
    activation dtype); acts: vectors that must share their dtype. Runs on every layer of every
    decode step, so dtypes are compared as the interned objects they are."""
    floats = tuple(m for m in mats if not isinstance(m, tuple))
    dt = acts[0].dtype
    if dt not in _FLOAT_OR_BF16 or not all(a.dtype is dt for a in floats + acts):
        raise ValueError(f"{name}: weights and activations must all be float32 or all bfloat16 bits (uint16), "
                         f"got {[str(m.dtype) for m in floats]} and {[str(a.dtype) for a in acts]}")
    if dt is _FLOAT_OR_BF16[1] and any(m.shape[1] % 2 for m in floats):
        raise ValueError(f"{name}: bfloat16 weights need an even number of columns (read as pairs)")


def rows_of(w) -> int:
    """Rows of a float matrix or of quantized tiles (their `rows`)."""
    return w.rows if isinstance(w, tuple) else w.shape[0]


# The fused kernels without their wrappers' checks and allocations, for a caller that checked its
# weights once (check_fused_weights) and owns its buffers (minirun/model/runners.py, NumpyTokenRunner): the wrappers'
# ~10 us a layer are a tenth of a small model's token.
attn_in_into, attn_out_into, norm_gemv_into = _k_attn_in, _k_attn_out, _k_norm_gemv


def check_fused_weights(layers, head, act_dtype) -> None:
    """What attn_in, attn_out and norm_gemv check on every call, once: each layer's weights (dicts
    of attn_norm, wqkv, wo, ffn_norm, w_gate_up, w_down) and the head's (norm, lm_head) float in the
    activations' dtype (float32, or bfloat16 bits: uint16) or quantized tiles; each layer's
    post_norms float32 [2 or 0, D]."""
    x = np.empty(0, act_dtype)
    for w in layers:
        _check("attn_in", (w["wqkv"],), x, w["attn_norm"])
        _check("attn_out", (w["wo"], w["w_gate_up"], w["w_down"]), x, w["ffn_norm"])
        _check_post_norms(w["post_norms"], w["ffn_norm"].shape[0])
    if head is not None:
        _check("norm_gemv", (head["lm_head"],), x, head["norm"])


def _as_rows(x):
    """x [D] or [B, D] -> (a C-contiguous [B, D] view or copy, whether x was one token)."""
    return np.ascontiguousarray(x.reshape(1, -1) if x.ndim == 1 else x), x.ndim == 1


def attn_in(x, w_norm, eps, w_qkv, pos, inv_freq, n_rot, head_dim, out=None, bias=None, head_norms=None,
            n_q: int = 0):
    """rms_norm -> fused QKV GEMV (+ bias) -> each head's RMSNorm (where given) -> RoPE (half-split)
    at position `pos` on the first n_rot heads.

    x [D], or [B, D] for B sequences' tokens with pos [B]; w_norm [D]; w_qkv [(Hq+2Hkv)*hd, D]
    (C-contiguous), all in one dtype (float32, or uint16 bfloat16 bits); inv_freq [hd/2] float64
    (RoPE angles pos * inv_freq in float64). bias: float32 [(Hq+2Hkv)*hd] (Qwen2's); head_norms:
    float32 [2, hd], the norms of the n_q query heads and of the key heads (Qwen3's). Returns out
    [(Hq+2Hkv)*hd] ([B, ...] for x [B, D]) in the weights' dtype: q heads, k heads (rotated), v heads.
    """
    _check("attn_in", (w_qkv,), x, w_norm)
    xr, one = _as_rows(x)
    out = np.empty((xr.shape[0], rows_of(w_qkv)), x.dtype) if out is None else out
    bias = _NO_BIAS if bias is None else np.ascontiguousarray(bias, np.float32)
    norms = np.empty((0, head_dim), np.float32) if head_norms is None else np.ascontiguousarray(head_norms, np.float32)
    if bias.shape[0] not in (0, rows_of(w_qkv)) or norms.shape[1] != head_dim or (norms.shape[0] and not n_q):
        raise ValueError(f"attn_in: a bias of {bias.shape[0]} rows for {rows_of(w_qkv)}, heads' norms "
                         f"{norms.shape} for head_dim {head_dim} with n_q {n_q}")
    _k_attn_in(xr, w_norm, np.float32(eps), w_qkv, bias, norms, n_q, np.asarray(pos, np.int64).reshape(xr.shape[0]),
               np.ascontiguousarray(inv_freq, np.float64), n_rot, head_dim, out.reshape(xr.shape[0], -1))
    return out[0] if one and out.ndim == 2 else out


_NO_BIAS = np.empty(0, np.float32)


def _check_post_norms(post_norms, D: int) -> None:
    if post_norms.dtype != np.float32 or post_norms.ndim != 2 or post_norms.shape[0] not in (0, 2) \
            or post_norms.shape[1] != D:
        raise ValueError(f"attn_out: post_norms must be float32 [2, {D}] or [0, {D}], got "
                         f"{post_norms.dtype} {post_norms.shape}")


def attn_out(x, o, w_o, w_norm, eps, w_gate_up, w_down, out=None, post_norms=None, act: str = "silu"):
    """x + W_o @ o, then + W_down @ (act(g) * u) with g, u = W_gate_up @ rms_norm(.): the rest of
    the layer.

    x [D] (or [B, D]), o [Hq*hd] (or [B, Hq*hd]), w_o [D, Hq*hd], w_norm [D], w_gate_up [2F, D]
    (gate rows then up rows), w_down [D, F]; one dtype (float32 or bfloat16 bits). post_norms:
    float32 [2, D], the RMSNorm weights applied to W_o @ o and to the MLP's output before each is
    added (Gemma 3's); act: a key of ACTIVATIONS ("silu": SwiGLU, "gelu_pytorch_tanh": GeGLU).
    Returns the new residual out, shaped as x.
    """
    _check("attn_out", (w_o, w_gate_up, w_down), x, o, w_norm)
    D = w_norm.shape[0]
    post_norms = np.empty((0, D), np.float32) if post_norms is None else np.ascontiguousarray(post_norms)
    _check_post_norms(post_norms, D)
    if act not in ACTIVATIONS:
        raise ValueError(f"attn_out: act must be one of {', '.join(ACTIVATIONS)}, got {act!r}")
    xr, _ = _as_rows(x)
    out = np.empty(x.shape, x.dtype) if out is None else out
    _k_attn_out(xr, np.ascontiguousarray(o.reshape(xr.shape[0], -1)), w_o, w_norm, np.float32(eps), w_gate_up,
                w_down, post_norms, ACTIVATIONS[act], out.reshape(xr.shape))
    return out


def norm_gemv(x, w_norm, eps, w, out=None):
    """(rms_norm(x) * w_norm) @ w^T as float32 [O] ([B, O] for x [B, D]): the final norm and LM head
    of a decode step."""
    _check("norm_gemv", (w,), x, w_norm)
    xr, one = _as_rows(x)
    out = np.empty((xr.shape[0], rows_of(w)), np.float32) if out is None else out
    _k_norm_gemv(xr, w_norm, np.float32(eps), w, out.reshape(xr.shape[0], -1))
    return out[0] if one and out.ndim == 2 else out


@njit(inline="always")
def _turn_row(x, c, s, out):
    h = x.shape[0] // 2
    for i in range(h):
        x1, x2 = x[i], x[i + h]
        out[i] = x1 * c[i] - x2 * s[i]
        out[i + h] = x2 * c[i] + x1 * s[i]


@njit(cache=True)
def _k_turn_rows(EK, start, end, c, s, out):
    Hkv, n, d = EK.shape
    for kv in range(Hkv):
        for j in range(start):
            for i in range(d):
                out[kv, j, i] = EK[kv, j, i]
        for j in range(start, end):
            _turn_row(EK[kv, j], c, s, out[kv, j])


@njit(cache=True)
def _k_turn_step(q, k, EK, start, c, s, qo, ko, EKo):
    for h in range(q.shape[0]):
        _turn_row(q[h], c, s, qo[h])
    for kv in range(k.shape[0]):
        _turn_row(k[kv], c, s, ko[kv])
    _k_turn_rows(EK, start, EK.shape[1], c, s, EKo)


def _check_turn(EK, start, end, cos, sin):
    d, n = EK.shape[2], EK.shape[1]
    if EK.dtype != np.float32 or EK.ndim != 3 or d % 2 or cos.shape != (d // 2,) or sin.shape != (d // 2,) \
            or not 0 <= start <= end <= n:
        raise ValueError(f"turn_rows: EK [Hkv, n, d] f32 with even d, cos/sin [d/2], 0 <= start <= end <= n; "
                         f"got {EK.dtype} {EK.shape}, {cos.shape}, start={start}, end={end}")


def turn_rows(EK, start, cos, sin, out=None, end=None):
    """EK [Hkv, n, d] f32 -> out [Hkv, n, d] f32: rows [0, start) copied, rows [start, end) all
    turned by one rotation (cos, sin [d/2] f32, HF Llama's half split: [x1 c - x2 s, x2 c + x1 s]),
    rows [end, n) of out not written (end: n by default). The far-position decode step's copy of
    sinks + ring (minirun/kv/far_positions.py); ~10 us a layer where the same in torch costs ~80."""
    end = EK.shape[1] if end is None else end
    _check_turn(EK, start, end, cos, sin)
    out = np.empty(EK.shape, np.float32) if out is None else out
    _k_turn_rows(EK, int(start), int(end), np.asarray(cos, np.float32), np.asarray(sin, np.float32), out)
    return out


def turn_step(q, k, EK, start, cos, sin, ek_out=None):
    """One far-position decode step's turns in one call: q [Hq, d], k [Hkv, d] f32 each turned by
    (cos, sin) as turn_rows turns a row, and EK as turn_rows(EK, start, cos, sin, ek_out) does ->
    (q turned, k turned, EK turned), new arrays but for ek_out. (Three torch turns of a layer's
    query, key and ring cost ~40 us; this ~10.)"""
    _check_turn(EK, start, EK.shape[1], cos, sin)
    if q.dtype != np.float32 or k.dtype != np.float32 or q.shape[-1] != EK.shape[2] or k.shape[-1] != EK.shape[2]:
        raise ValueError(f"turn_step: q [Hq, d], k [Hkv, d] f32 with EK's d; got {q.dtype} {q.shape}, {k.dtype} {k.shape}")
    qo, ko = np.empty(q.shape, np.float32), np.empty(k.shape, np.float32)
    ek_out = np.empty(EK.shape, np.float32) if ek_out is None else ek_out
    _k_turn_step(q, k, EK, int(start), np.asarray(cos, np.float32), np.asarray(sin, np.float32), qo, ko, ek_out)
    return qo, ko, ek_out
