"""Partial attention in torch returning (o, m, l), and the exact log-sum-exp merge of partials.

(o, m, l): o the normalized output, m the max score, l = sum exp(score - m). Two partials over
disjoint key sets merge exactly into attention over their union; an empty part has m = -inf, l = 0.
"""
from __future__ import annotations

import sys

import torch

KEY_BLOCK = 16384   # keys per block at most
SCORE_ELEMS = 1 << 26   # and at most this many scores per block ([Hkv, T*rep, block] f32: 256 MiB): a
# 4096-token GPU prefill chunk over 32K keys otherwise held 2 x 2.4 GB per layer (peak 8.9 GiB on an H100)


def partial_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
                      mask: torch.Tensor | None = None) -> tuple:
    """q [T, Hq, hd] (pre-scaled), K, V [Hkv, n, hd]; mask [T, n] bool (True = attend) or None.

    Returns o [T, Hq, hd], m [T, Hq], l [T, Hq] in float32.
    """
    T, Hq, hd = q.shape
    Hkv, n = K.shape[0], K.shape[1]
    rep = Hq // Hkv
    if n == 0:
        return (q.new_zeros(T, Hq, hd, dtype=torch.float32), q.new_full((T, Hq), float("-inf"), dtype=torch.float32),
                q.new_zeros(T, Hq, dtype=torch.float32))
    if mask is None and T > 1:
        fused = _fused(q, K, V)
        if fused is not None:
            return fused
    qg = q.float().reshape(T, Hkv, rep, hd).permute(1, 0, 2, 3).reshape(Hkv, T * rep, hd)
    parts = []
    block = max(256, min(KEY_BLOCK, SCORE_ELEMS // (T * Hq)))
    for b0 in range(0, n, block):
        Kb, Vb = K[:, b0:b0 + block].float(), V[:, b0:b0 + block].float()
        s = torch.bmm(qg, Kb.transpose(1, 2))                                  # [Hkv, T*rep, nb]
        if mask is not None:
            mb = mask[:, b0:b0 + block]                                         # [T, nb]
            s = s.masked_fill(~mb.repeat_interleave(rep, dim=0)[None], float("-inf"))
        m = s.amax(-1)                                                          # [Hkv, T*rep]
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m_safe[..., None])
        l = p.sum(-1)
        o = torch.bmm(p, Vb) / l.clamp(min=1e-30)[..., None]
        parts.append((o, m, l))
    o, m, l = parts[0] if len(parts) == 1 else merge(*parts)

    def back(x):   # [Hkv, T*rep, ...] -> [T, Hq, ...]
        return x.reshape(Hkv, T, rep, *x.shape[2:]).transpose(0, 1).reshape(T, Hq, *x.shape[2:])
    return back(o), back(m), back(l)


def _flash_partial(q, K, V, causal: bool = False) -> tuple:
    """partial_attention without a mask (causal: the chunk against itself, n == T, query t sees
    keys <= t) through torch's fused attention, which also returns the log-sum-exp: (o, m = lse,
    l = 1) is an equivalent triple for `merge`, and no [Hq, T, n] scores are held. Float32 on the
    CPU (its flash kernel); on a GPU in the values' dtype (the model's: flash for bfloat16 / float16,
    the memory-efficient kernel for float32). Without causal the rep query heads of a kv head act
    as rep * T queries of one head (K, V not copied per query head)."""
    T, Hq, hd = q.shape
    Hkv = K.shape[0]
    rep = Hq // Hkv
    dt = V.dtype if q.is_cuda and V.dtype in (torch.bfloat16, torch.float16) and hd <= 256 else torch.float32
    K, V = K.to(dt), V.to(dt)
    if causal:
        q4 = q.to(dt).transpose(0, 1)[None]                                         # [1, Hq, T, hd]
        K4, V4 = ((t.repeat_interleave(rep, 0) if rep > 1 else t)[None] for t in (K, V))
    else:
        q4 = q.to(dt).reshape(T, Hkv, rep, hd).permute(1, 0, 2, 3).reshape(1, Hkv, T * rep, hd)
        K4, V4 = K[None], V[None]
    if not q.is_cuda:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q4, K4, V4, is_causal=causal, scale=1.0)
    elif dt != torch.float32:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention(q4, K4, V4, is_causal=causal, scale=1.0)[:2]
    else:
        o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q4, K4, V4, None, True, is_causal=causal,
                                                                         scale=1.0)[:2]
    o, lse = o[0].float(), lse[0, :, :q4.shape[2]].float()                         # [H', L, hd], [H', L]
    if causal:
        o, lse = o.transpose(0, 1), lse.transpose(0, 1)
    else:
        o = o.reshape(Hkv, T, rep, hd).transpose(0, 1).reshape(T, Hq, hd)
        lse = lse.reshape(Hkv, T, rep).transpose(0, 1).reshape(T, Hq)
    return o, lse, torch.ones_like(lse)


FUSED_REFUSED = {}   # device type -> why torch's fused attention failed there (then the unfused path)


def _fused(q, K, V, causal: bool = False):
    """_flash_partial, or None where torch's fused attention refused these inputs on this device
    before (a GPU without the kernel, a head size it does not take): said once on stderr, and the
    callers take the unfused path (tests/kv/test_hca_cache.py's GPU test asserts it is not refused)."""
    dev = q.device.type
    if dev in FUSED_REFUSED:
        return None
    try:
        return _flash_partial(q, K, V, causal)
    except RuntimeError as e:
        if dev == "cpu":
            raise
        FUSED_REFUSED[dev] = str(e).splitlines()[0]
        print(f"minirun: torch's fused attention failed on {dev} ({FUSED_REFUSED[dev]}): prompt chunks take the "
              f"unfused attention", file=sys.stderr)
        return None


def exact_tier_partial(qs, qf, ek, ev, live, S: int, k, v, far: bool) -> tuple:
    """A prompt chunk of T > 1 queries against the exact tier: sinks + ring slots `live` (bool
    [S + W], all before the chunk) and the chunk itself (causal), as fused parts merged: the chunk's
    causal part, the live ring (and sinks) slots read with qs, and with far positions the sinks
    (held unrotated) read with the far queries qf. qs, qf [T, Hq, hd] float32 (scaled); ek, ev
    [Hkv, >= S + W, hd]; k, v [T, Hkv, hd] -> (o, m, l)."""
    kc, vc = k.transpose(0, 1), v.transpose(0, 1)
    T = qs.shape[0]
    parts = [_fused(qs, kc, vc, causal=True) or partial_attention(qs, kc, vc, torch.ones(T, T, dtype=torch.bool,
                                                                                          device=qs.device).tril())]
    spans = [(S, live[S:], qs), (0, live[:S], qf)] if far else [(0, live, qs)]
    for start, rows, queries in spans:
        idx = rows.nonzero()[:, 0]
        if idx.numel() == rows.numel() > 0:             # (a full ring: slices, no copy)
            parts.append(partial_attention(queries, ek[:, start:start + rows.numel()], ev[:, start:start + rows.numel()]))
        elif idx.numel():
            idx = (idx + start).to(ek.device)
            parts.append(partial_attention(queries, ek.index_select(1, idx), ev.index_select(1, idx)))
    return merge(*parts)


def merge(*parts) -> tuple:
    """Exact merge of partials (o [..., hd], m [...], l [...]); empty parts contribute nothing."""
    ms = torch.stack([p[1] for p in parts])
    M = ms.amax(0)
    M_safe = torch.where(torch.isinf(M), torch.zeros_like(M), M)
    o_acc, l_acc = 0.0, 0.0
    for o, m, l in parts:
        w = torch.exp(m - M_safe) * l            # m = -inf -> exp(-inf) = 0: no NaN
        o_acc = o_acc + w[..., None] * o
        l_acc = l_acc + w
    o = o_acc / torch.where(l_acc > 0, l_acc, torch.ones_like(l_acc))[..., None]
    return o, M, l_acc
