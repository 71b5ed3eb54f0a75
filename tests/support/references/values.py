"""NumPy references of the quantized value rows (minirun/kv/value_codes.py): encode_values_ref
(what the store writes as a value leaves the ring) and decode_values_ref (what the value sums read:
kernels_cpu.value_rows, kernels_cuda/gather.cu). Per token, per group of 32 channels:
q8 codes c = round(x / s) + 128, s = max|x| / 127; q4 c = round((x - min) / s), s = (max - min) / 15,
two codes a byte (channel i low nibble, i + 16 high); s and min float16, after the codes."""
from __future__ import annotations

import numpy as np

GROUP = 32
__all__ = ["encode_values_ref", "decode_values_ref"]


def _inverse(s16):
    s = s16.astype(np.float32)
    with np.errstate(divide="ignore"):
        return np.where(s > 0, np.float32(1) / np.maximum(s, np.float32(1e-30)), np.float32(0)).astype(np.float32)


def encode_values_ref(V, kind):
    """V [..., d] float -> rows [..., width] uint8 (q8: d + d/16, q4: d/2 + d/8 bytes)."""
    x = np.asarray(V, np.float32)
    lead, d = x.shape[:-1], x.shape[-1]
    x = x.reshape(*lead, d // GROUP, GROUP)
    if kind == "q8":
        s = (np.abs(x).max(-1) / np.float32(127)).astype(np.float16)
        c = np.clip(np.round(x * _inverse(s)[..., None]), -128, 127) + 128
        codes, meta = c.astype(np.uint8), s[..., None]
    else:
        lo = x.min(-1).astype(np.float16)
        s = ((x.max(-1) - x.min(-1)) / np.float32(15)).astype(np.float16)
        c = np.clip(np.round((x - lo.astype(np.float32)[..., None]) * _inverse(s)[..., None]), 0, 15).astype(np.uint8)
        codes = c[..., :GROUP // 2] | (c[..., GROUP // 2:] << 4)
        meta = np.stack([s, lo], -1)
    meta = np.ascontiguousarray(meta).view(np.uint8).reshape(*lead, -1)
    return np.concatenate([codes.reshape(*lead, -1), meta], -1)


def decode_values_ref(rows, kind, d):
    """rows [..., width] uint8 -> V [..., d] float32 (float64 products, rounded once)."""
    rows = np.asarray(rows, np.uint8)
    lead, G = rows.shape[:-1], d // GROUP
    nc = d if kind == "q8" else d // 2
    meta = np.ascontiguousarray(rows[..., nc:]).view(np.float16).astype(np.float64)
    codes = rows[..., :nc].reshape(*lead, G, -1)
    if kind == "q8":
        x = (codes.astype(np.float64) - 128) * meta[..., None]
    else:
        meta = meta.reshape(*lead, G, 2)
        c = np.concatenate([codes & 15, codes >> 4], -1).astype(np.float64)
        x = c * meta[..., 0:1] + meta[..., 1:2]
    return x.reshape(*lead, d).astype(np.float32)
