"""Partial attention in torch returning (o, m, l), and the exact log-sum-exp merge of partials.

(o, m, l): o the normalized output, m the max score, l = sum exp(score - m). Two partials over
disjoint key sets merge exactly into attention over their union; an empty part has m = -inf, l = 0.
"""
from __future__ import annotations

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
    if mask is None and T > 1 and q.device.type == "cpu":
        return _flash_partial(q, K, V)
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


def _flash_partial(q, K, V) -> tuple:
    """Unmasked prefill chunk over many keys with torch's fused CPU flash kernel, which also returns
    the log-sum-exp: (o, m = lse, l = 1) is an equivalent (o, m, l) triple for `merge`."""
    T, Hq, hd = q.shape
    rep = Hq // K.shape[0]
    Kq, Vq = (t.float().repeat_interleave(rep, 0)[None] if rep > 1 else t.float()[None] for t in (K, V))
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.float().transpose(0, 1)[None], Kq, Vq, scale=1.0)                     # q is pre-scaled
    return o[0].transpose(0, 1), lse[0].transpose(0, 1), torch.ones_like(lse[0].transpose(0, 1))


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
