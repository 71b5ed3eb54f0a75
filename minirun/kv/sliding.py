"""The sliding-window layers' cache: each keeps its last tokens' keys and values, a few windows'
worth whatever the context (Gemma 3's local layers, Mistral v0.1's, Qwen's past max_window_layers).

A layer with a window of W tokens attends, at position p, to the positions after p - W; its older
keys are never read again, so holding them would only cost memory: at 128K tokens a Gemma 3
model's 5 local layers of every 6 hold 3 x 512 or 1024 tokens each instead of 128K.

The buffer holds 3W slots, positions base.. in order (position p in slot p - base). When a write
would pass its end, the last 2W positions move down to its start (2W rows a layer every W tokens).
A decode step reads the slots of its window as one slice; a prompt chunk of T tokens attends over
the window before it and its own tokens under the window mask.

Going back (truncate to n) needs the W positions before n: the buffer keeps W to 2W more than the
window for that (a new question after an answer comes back to the end of the document), and a
rewind point (`checkpoint`: a copy of the buffer; the engine names two, as for the HCA cache's
ring, kv/ring_checkpoint.py) goes back further.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

import kernels_cpu

from .. import hugepages
from ..model.ops import as_numpy, from_numpy_bits
from .base import KVCache
from .dense import dense_attention


class SlidingWindowCache(KVCache):
    """k, v [L, Hkv, 3W, hd]: the last tokens of each of n_layers sliding layers with a window of W,
    in the compute dtype on the compute device; positions base.. in slots 0.."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, window: int, capacity: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(n_layers, capacity)
        self.window = window
        shape = (n_layers, n_kv_heads, ring_slots(window, capacity), head_dim)
        self.k = hugepages.zeros(*shape, dtype=dtype, device=device)
        self.v = hugepages.zeros(*shape, dtype=dtype, device=device)
        self.base = 0                # the position in slot 0
        self._moved_at = -1          # the offset of the last move (all layers move at one offset)
        numpy_steps = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
        self._k_np, self._v_np = (as_numpy(self.k), as_numpy(self.v)) if numpy_steps else (None, None)
        self._scale = 1.0 / math.sqrt(head_dim)
        self._o_np = None
        self.copies: dict = {}       # name -> RingCopy: rewind points

    def _make_room(self, layer: int, T: int) -> None:
        """Before `layer` writes T tokens at offset: where they pass the buffer's end, its positions
        from offset + T - 2W on move to the start (the first layer of a step decides, for all)."""
        pos0 = self.offset
        if self._moved_at != pos0:
            if pos0 + T - self.base <= self.k.shape[2]:
                return
            self._new_base = max(self.base, pos0 + T - 2 * self.window)
            self._moved_at = pos0
        new = self._new_base
        keep = pos0 - new
        if keep > 0 and new != self.base:
            for t in (self.k, self.v):
                t[layer, :, :keep] = t[layer, :, new - self.base:pos0 - self.base].clone()
        if layer == self.n_layers - 1:
            self.base = new

    def attend_np(self, layer, q, k, v):
        if self._k_np is None or q.dtype != self._k_np.dtype:
            return super().attend_np(layer, q, k, v)
        self._make_room(layer, 1)
        K, V = self._k_np[layer], self._v_np[layer]
        base = self._new_base if self._moved_at == self.offset else self.base
        end = self.offset + 1 - base
        K[:, end - 1], V[:, end - 1] = k, v
        if self._o_np is None:
            self._o_np = np.empty(q.shape, K.dtype)
        lo = max(0, end - self.window)
        return kernels_cpu.dense_attend(q, K[:, lo:], V[:, lo:], end - lo, self._scale, out=self._o_np)

    def attend(self, layer, q, k, v):
        T, pos0, W = q.shape[0], self.offset, self.window
        if T == 1 and self._k_np is not None and q.dtype is self.k.dtype:
            o = self.attend_np(layer, as_numpy(q[0]), as_numpy(k[0]), as_numpy(v[0]))
            return from_numpy_bits(o.copy())[None]
        K, V = self.k[layer], self.v[layer]                                       # [Hkv, slots, hd]
        lo = max(0, pos0 - W)        # the window before the chunk, then the chunk's own tokens
        Ka = torch.cat([K[:, lo - self.base:pos0 - self.base], k.transpose(0, 1).to(K.dtype)], 1)
        Va = torch.cat([V[:, lo - self.base:pos0 - self.base], v.transpose(0, 1).to(V.dtype)], 1)
        self._make_room(layer, T)
        base = self._new_base if self._moved_at == pos0 else self.base
        start = max(pos0, base)      # the chunk's tokens that stay
        K[:, start - base:pos0 + T - base] = Ka[:, start - pos0 - T:] if start > pos0 else Ka[:, pos0 - lo:]
        V[:, start - base:pos0 + T - base] = Va[:, start - pos0 - T:] if start > pos0 else Va[:, pos0 - lo:]
        if pos0 + T <= W:            # (within its first W tokens a sliding layer reads them all)
            return dense_attention(q, Ka, Va, pos0)
        return windowed_attention(q, Ka, Va, pos0, lo, W)

    def _holds_window_before(self, n: int, base: int) -> bool:
        return base == 0 or n - self.window >= base

    def truncate(self, n: int) -> bool:
        """Back to n tokens where the W positions before n are still held, or through a rewind point."""
        ok = n >= self.offset or self._holds_window_before(n, self.base)
        if not ok:
            point = next((p for p in self.copies.values()
                          if n <= min(p.at, p.valid_to) and self._holds_window_before(n, p.base)), None)
            if point is not None:
                self.k.copy_(point.k)
                self.v.copy_(point.v)
                self.base, ok = point.base, True
        if ok:
            self.offset = min(self.offset, n)
            self._moved_at = -1
            for p in self.copies.values():
                p.valid_to = min(p.valid_to, self.offset)
        return ok

    def checkpoint(self, name: str = "prompt") -> None:
        """A copy of the buffer to come back to positions up to this offset."""
        point = self.copies.get(name) or RingCopy(torch.empty_like(self.k), torch.empty_like(self.v))
        point.k.copy_(self.k)
        point.v.copy_(self.v)
        point.base, point.at, point.valid_to = self.base, self.offset, self.offset
        self.copies[name] = point

    def reset(self) -> None:
        super().reset()
        self.base, self._moved_at = 0, -1
        self.copies.clear()

    def stats(self) -> dict:
        ring = self.k.numel() * self.k.element_size() * 2
        copies = sum(p.k.numel() * p.k.element_size() * 2 for p in self.copies.values())
        return {"tokens": self.offset, "sliding_kv_bytes": ring, "sliding_copy_bytes": copies,
                "total_bytes": ring + copies}

    def state_signature(self) -> dict:
        return {"kind": "sliding", "shape": list(self.k.shape), "dtype": str(self.k.dtype)}

    def state_dict(self) -> tuple[dict, list]:
        """The window before the offset (no copies)."""
        n = self.offset
        lo = max(0, n - self.window)
        return {"offset": n}, [(f"{kv}.{layer}", t[layer, :, lo - self.base:n - self.base])
                               for layer in range(self.n_layers) for kv, t in (("k", self.k), ("v", self.v))]

    def load_state_dict(self, scalars: dict, get) -> None:
        n = scalars["offset"]
        self.base = max(0, n - self.window)
        for layer in range(self.n_layers):
            self.k[layer, :, :n - self.base] = get(f"k.{layer}").to(self.k.device)
            self.v[layer, :, :n - self.base] = get(f"v.{layer}").to(self.v.device)
        self.offset = n


def ring_slots(window: int, capacity: int) -> int:
    """The slots a sliding layer holds: three windows, or the whole context where it is shorter."""
    return min(3 * window, max(1, capacity))


class RingCopy:
    """The buffer at a checkpoint: k, v as the cache's, its base, taken at offset `at`; it may
    restore positions up to valid_to (every truncate since lowers it: later tokens there are not
    the copy's)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v
        self.base = self.at = 0
        self.valid_to = -1


def windowed_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, pos0: int, lo: int, window: int):
    """Sliding-window GQA attention: q [T, Hq, hd] at positions pos0.., K, V [Hkv, n, hd] of positions
    lo.. -> [T, Hq, hd]; the query at p reads the keys at j with p - window < j <= p."""
    T, Hq, hd = q.shape
    Hkv, n = K.shape[0], K.shape[1]
    rep = Hq // Hkv
    p = torch.arange(pos0, pos0 + T, device=q.device)[:, None]
    j = torch.arange(lo, lo + n, device=q.device)[None, :]
    mask = ((j <= p) & (j > p - window)).repeat(rep, 1)                        # [rep * T, n]
    qg = q.view(T, Hkv, rep, hd).permute(1, 2, 0, 3).reshape(1, Hkv, rep * T, hd)
    o = F.scaled_dot_product_attention(qg, K[None], V[None], attn_mask=mask)
    return o.view(Hkv, rep, T, hd).permute(2, 0, 1, 3).reshape(T, Hq, hd)
