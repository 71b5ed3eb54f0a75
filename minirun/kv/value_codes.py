"""The HCA store's values as the host pool holds them (EngineConfig.kv_values): in float, or as
8 / 4-bit codes per token and group of 32 channels, quantized as they enter the store.

A row of the pool is one token of one kv head, bytes [width] (float: [hd] of the float type):
- q8: hd codes (uint8, the int8 code + 128), then hd/32 float16 scales:       x = (c - 128) * s
- q4: hd/2 bytes of two codes (group k's byte i: channel 32k + i low nibble, 32k + 16 + i high),
  then hd/32 (scale, minimum) float16 pairs:                                  x = c * s + min
(float16 little-endian, as two bytes). One byte buffer per row keeps every path that moves rows as
it was: the pinned pool's strided copies, the graph's store_rows, prompt-cache files. The value
sums dequantize in registers (kernels_cpu/value_rows.py, kernels_cuda/gather.cu); a NumPy
reference is tests/support/references/values.py. Symmetric 8 bits and scale + minimum at 4 bits, per
group of 32, are llama.cpp's Q8_0 and Q4_1 (`--cache-type-v q8_0 / q4_1`), KIVI's per-token values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import MiniRunError

GROUP = 32
KINDS = ("float", "q8", "q4")


@dataclass(frozen=True)
class ValueCodes:
    """How the pool holds a value row of head_dim channels: kind "float" (float_dtype), "q8", "q4"."""
    kind: str
    head_dim: int
    float_dtype: torch.dtype = torch.float16

    def __post_init__(self):
        if self.kind not in KINDS:
            raise MiniRunError(f"unknown kv_values {self.kind!r}: use float, q8 or q4")
        if self.kind != "float" and self.head_dim % GROUP:
            raise MiniRunError(f"kv_values {self.kind}: head_dim {self.head_dim} is not a multiple of {GROUP}")

    @property
    def quantized(self) -> bool:
        return self.kind != "float"

    @property
    def groups(self) -> int:
        return self.head_dim // GROUP

    @property
    def dtype(self) -> torch.dtype:
        """The pool's element type."""
        return torch.uint8 if self.quantized else self.float_dtype

    @property
    def width(self) -> int:
        """Elements of the pool's dtype per row."""
        hd = self.head_dim
        return {"float": hd, "q8": hd + 2 * self.groups, "q4": hd // 2 + 4 * self.groups}[self.kind]

    @property
    def row_bytes(self) -> int:
        return self.width * self.dtype.itemsize

    def encode(self, V: torch.Tensor) -> torch.Tensor:
        """V [..., hd] (any float type, any device) -> rows [..., width] of the pool's dtype."""
        if not self.quantized:
            return V.to(self.float_dtype)
        x = V.float().reshape(*V.shape[:-1], self.groups, GROUP)
        if self.kind == "q8":
            s = (x.abs().amax(-1) / 127).to(torch.float16)
            codes = (x * _inverse(s)[..., None]).round().clamp_(-128, 127).add_(128).to(torch.uint8)
            meta = s[..., None]
        else:
            lo16 = x.amin(-1).to(torch.float16)
            s = ((x.amax(-1) - x.amin(-1)) / 15).to(torch.float16)
            c = ((x - lo16.float()[..., None]) * _inverse(s)[..., None]).round().clamp_(0, 15).to(torch.uint8)
            codes = c[..., :GROUP // 2] | (c[..., GROUP // 2:] << 4)
            meta = torch.stack([s, lo16], -1)
        lead = V.shape[:-1]
        meta = meta.contiguous().view(torch.uint8).reshape(*lead, -1)
        return torch.cat([codes.reshape(*lead, -1), meta], -1)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [..., width] -> V [..., hd] float32 (what the value sums read; for prefill paths
        that attend to the store with torch)."""
        if not self.quantized:
            return rows.float()
        G, lead = self.groups, rows.shape[:-1]
        nc = self.head_dim if self.kind == "q8" else self.head_dim // 2
        meta = rows[..., nc:].contiguous().view(torch.float16).float()
        codes = rows[..., :nc].reshape(*lead, G, -1)
        if self.kind == "q8":
            x = (codes.float() - 128) * meta[..., None]
        else:
            meta = meta.reshape(*lead, G, 2)
            c = torch.cat([codes & 15, codes >> 4], -1).float()
            x = c * meta[..., 0:1] + meta[..., 1:2]
        return x.reshape(*lead, self.head_dim)


def _inverse(s: torch.Tensor) -> torch.Tensor:
    """1 / s in float32 where s (float16) > 0, else 0 (a constant group: every code 0)."""
    s = s.float()
    return torch.where(s > 0, 1.0 / s.clamp(min=1e-30), torch.zeros_like(s))


def value_codes(kind: str, head_dim: int, dtype: torch.dtype, device_type: str = "cpu") -> ValueCodes:
    """The pool's codes for a run of compute dtype `dtype` on a device of device_type: float is
    float32 for float32 runs, float16 otherwise; "auto" is q8 on the CPU, where the float pool is
    most of a long document's memory (quality unchanged: docs/QUALITY.md), and float on a GPU (the
    mapped pool's measured path) or where head_dim is not a multiple of GROUP."""
    if kind == "auto":
        kind = "q8" if device_type == "cpu" and head_dim % GROUP == 0 else "float"
    return ValueCodes(kind, head_dim, torch.float32 if dtype == torch.float32 else torch.float16)
