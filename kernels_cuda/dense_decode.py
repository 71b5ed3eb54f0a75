"""Exact attention of one query over a long K, V on the GPU: the dense cache's decode step.

attend_gqa (attend_partial where the shape is not GQA's) split over the keys (flash-decoding: a few
blocks per SM at any length, so a long context is read by the whole GPU) and lse_merge_staged with an empty staged part. torch's SDPA gives
one query one block per head (fmha_cutlassF: 0.7 ms a layer at 8K on an H100, 95% of a token).
Every buffer is allocated once for the cache's capacity, so a step can be captured in a CUDA graph:
there the key count is fixed per graph and the live keys (those at or before the token's position,
a device tensor) are a device mask.
"""

from __future__ import annotations

import math

from .decode import _OUT_SUFFIX, _launch_merge
from .launch import _attend_split, _attend_split_max, _backend, _torch, launch_attend_partial


class DenseDecodeAttention:
    """o = softmax(q K^T / sqrt(d)) V for one query, GQA (query head h reads kv head h // (Hq / Hkv)).

    Hq, Hkv, d: heads and head dim; capacity: the most keys; out_dtype: the output's dtype
    (float32 / bfloat16 written by the merge, others cast)."""

    def __init__(self, device, Hq: int, Hkv: int, d: int, capacity: int, out_dtype):
        torch = _torch()
        if Hq % Hkv:
            raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
        self.device, self.Hq, self.Hkv, self.d = device, Hq, Hkv, d
        self.num_sms, _ = _backend().device_info(device)
        p_max = _attend_split_max(capacity, Hq, self.num_sms, Hkv, d)
        f32 = torch.float32
        self.qs = torch.zeros(Hq, d, dtype=f32, device=device)
        self.os = torch.zeros(p_max, Hq, d, dtype=f32, device=device)
        self.ms, self.ls = torch.zeros(p_max, Hq, dtype=f32, device=device), torch.zeros(p_max, Hq, dtype=f32, device=device)
        self.no_stage = torch.zeros(Hq, d + 2, dtype=f32, device=device)        # l = 0: an empty part
        self.o = torch.zeros(Hq, d, dtype=out_dtype if str(out_dtype) in _OUT_SUFFIX else f32, device=device)
        self.q2k = (torch.arange(Hq) // (Hq // Hkv)).to(device=device, dtype=torch.int32)
        self.positions = torch.arange(capacity, device=device)
        self.live = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.scale = 1.0 / math.sqrt(d)

    def __call__(self, q, K, V, n: int, pos=None):
        """q [Hq, d] (any float dtype), K, V [Hkv, >= n, d] (rows contiguous, float32 / float16 /
        bfloat16) -> o [Hq, d] in q's dtype (a view of a persistent buffer when the dtypes agree).
        pos: int64 [1] on the device: only the keys at or before pos[0] count (a captured step);
        None: all n."""
        torch = _torch()
        torch.mul(q, self.scale, out=self.qs)
        if pos is None:
            mask, has_mask = self.q2k.view(torch.uint8)[:1], 0                  # (unread)
        else:
            torch.le(self.positions[:n], pos, out=self.live[:n])
            mask, has_mask = self.live.view(torch.uint8), 1
        tps, nsplit = _attend_split(n, self.Hq, self.num_sms, self.Hkv, self.d)
        if nsplit > self.os.shape[0] or n > self.positions.numel():
            raise ValueError(f"{n} keys: more than the capacity of {self.positions.numel()}")
        with _backend().session(self.device) as L:
            launch_attend_partial(L, self.qs, K, V, self.q2k, mask, has_mask, n, tps, nsplit, self.os, self.ms,
                                  self.ls, grouped=True)
            _launch_merge(L, self.os, self.ms, self.ls, nsplit, self.no_stage, self.o)
        return self.o if self.o.dtype == q.dtype else self.o.to(q.dtype)

    def step_unrotated(self, q, k, v, cs, K, V, n: int, pos, first: bool):
        """A captured token whose RoPE is not applied yet: q [Hq, d], k, v [Hkv, d] (rows contiguous,
        K's dtype), cs [d] its position's cos | sin, pos int64 [1] on the device. rope(k) and v are
        written into K, V [Hkv, cap, d] at pos, then attention over the first n slots, those past pos
        masked -> o [Hq, d] in q's dtype. Three launches (layer.rope_store, attend, merge) where
        RoPE, the cache writes, the scale and the mask took five; first: write the live mask (the
        same for every layer of a token: the first layer's launch writes it)."""
        from .layer import rope_store
        tps, nsplit = _attend_split(n, self.Hq, self.num_sms, self.Hkv, self.d)
        if nsplit > self.os.shape[0] or n > self.positions.numel():
            raise ValueError(f"{n} keys: more than the capacity of {self.positions.numel()}")
        live = self.live.view(_torch().uint8)
        rope_store(q, k, v, cs, pos, self.scale, self.qs, K, V, live, n if first else 0)
        with _backend().session(self.device) as L:
            launch_attend_partial(L, self.qs, K, V, self.q2k, live, 1, n, tps, nsplit,
                                  self.os, self.ms, self.ls, grouped=True)
            _launch_merge(L, self.os, self.ms, self.ls, nsplit, self.no_stage, self.o)
        return self.o if self.o.dtype == q.dtype else self.o.to(q.dtype)
