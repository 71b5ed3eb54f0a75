"""A per-layer buffer of token rows that grows in large steps (never per token)."""
from __future__ import annotations

import torch

from .. import hugepages

MIN_GROW = 4096


class GrowingBuffer:
    """data [*lead, cap, width] (width 1 is squeezed for scratch rows), grown by doubling up to max_cap.

    lead: leading dims, e.g. (L, Hkv) for per-layer stores or (Hq,) for scratch. Memory is only
    allocated when tokens arrive, and `nbytes` is what is allocated (on huge pages on the CPU:
    minirun.hugepages).
    """

    def __init__(self, lead: tuple, width: int, dtype: torch.dtype, max_cap: int, device="cpu",
                 at_capacity: bool = False):
        self.lead, self.width, self.dtype, self.max_cap, self.device = lead, width, dtype, max_cap, device
        self.at_capacity = at_capacity   # the first token allocates max_cap: no doubling, no copy
        self.data = None
        self.cap = 0

    def reserve(self, n: int) -> None:
        if n <= self.cap:
            return
        grown = self.max_cap if self.at_capacity else max(n, 2 * self.cap, MIN_GROW)
        new_cap = min(self.max_cap, grown)
        if n > new_cap:
            raise ValueError(f"store overflow: {n} tokens > capacity {self.max_cap}")
        new = self._alloc(new_cap)
        if self.data is not None:
            self._copy_into(new)
        self.data, self.cap = new, new_cap

    def _alloc(self, cap: int) -> torch.Tensor:
        return hugepages.empty(*self.lead, cap, self.width, dtype=self.dtype, device=self.device)

    def _copy_into(self, new: torch.Tensor) -> None:
        new[..., :self.cap, :] = self.data

    def write_all(self, j0: int, rows: torch.Tensor) -> None:
        """rows [*lead, m, width] into positions j0..j0+m of every leading index."""
        self.data[..., j0:j0 + rows.shape[-2], :] = rows

    def view(self, layer: int, n: int) -> torch.Tensor:
        """[Hkv, n, width] of `layer` (a view)."""
        return self.data[layer, :, :n]

    def token_rows(self, layer: int, n: int) -> torch.Tensor:
        """The first n rows of `layer`, token-major [Hkv, n, width] (a view: also written through)."""
        return self.view(layer, n)

    def free(self) -> None:
        self.data, self.cap = None, 0

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()


class ColumnBuffer(GrowingBuffer):
    """Like GrowingBuffer, but data [*lead, width, cap]: each of a row's `width` fields is contiguous
    over tokens. The CPU key store uses it for codebook indices ([L, Hkv, g, cap]), so the scoring
    kernel reads one group of a block of tokens at unit stride (kernels_cpu.packed)."""

    def _alloc(self, cap: int) -> torch.Tensor:
        return hugepages.empty(*self.lead, self.width, cap, dtype=self.dtype, device=self.device)

    def _copy_into(self, new: torch.Tensor) -> None:
        new[..., :self.cap] = self.data

    def write_all(self, j0: int, rows: torch.Tensor) -> None:
        """rows [*lead, m, width] (token-major, as GrowingBuffer takes them) into positions j0..j0+m."""
        self.data[..., j0:j0 + rows.shape[-2]] = rows.transpose(-1, -2)

    def view(self, layer: int, n: int) -> torch.Tensor:
        """[Hkv, width, n] of `layer` (a view)."""
        return self.data[layer, ..., :n]

    def token_rows(self, layer: int, n: int) -> torch.Tensor:
        return self.view(layer, n).transpose(-1, -2)
