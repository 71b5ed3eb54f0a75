"""Where each backend keeps the HCA cache's buffers (the shapes are hca_layout.hca_tiers's, one
declaration that `minirun plan` counts too). A backend passes one of these to HCABase, which makes
every tier through it: the CPU keeps everything in host memory where its Numba kernels read it, a
GPU its exact tier and key store on the device and the store's values in page-locked host pools.
"""
from __future__ import annotations

import torch

from .. import hugepages
from .hca_layout import Buffer
from .pinned import PinnedPool
from .store import ColumnBuffer, GrowingBuffer


class HostBuffers:
    """The CPU backend's: host memory, the store's codes column-major for the scoring kernels."""
    backend = "cpu"   # whose kernels read them (hca_layout.hca_tiers declares each backend's tiers)

    def __init__(self, device: torch.device):
        self.device = device   # where torch computes: the exact tier lives there

    def exact_tier(self, spec: Buffer) -> tuple:
        """-> (ek, ev) [L, Hkv, S + W, hd] of the spec's dtype, zeroed (on huge pages on a CPU)."""
        return tuple(hugepages.zeros(*spec.lead, spec.rows, spec.width, dtype=spec.dtype, device=self.device)
                     for _ in range(2))

    def pool(self, spec: Buffer, read_by_device: bool):
        """The host pool of the store's values (or rescore's keys)."""
        return self.grow(spec)

    def indices(self, spec: Buffer):
        """group-major [L, Hkv, g, cap]: the scoring kernel's layout (kernels_cpu.packed)."""
        return ColumnBuffer(spec.lead, spec.width, spec.dtype, spec.rows)

    def grow(self, spec: Buffer) -> GrowingBuffer:
        """On the host, as the Numba kernels read them (also when torch runs on a GPU)."""
        return GrowingBuffer(spec.lead, spec.width, spec.dtype, spec.rows)


class DeviceBuffers:
    """A GPU backend's: the exact tier (with a spare row) and the key store on the device, the
    store's values in page-locked host pools allocated once at capacity (kv/pinned.py)."""
    backend = "cuda"

    def __init__(self, device: torch.device, copy_stream, values_mapped: bool):
        """values_mapped: the value pool mapped into the GPU's address space (its value sum reads it)."""
        self.device, self.copy_stream, self.values_mapped = device, copy_stream, values_mapped
        self.ekx = self.evx = None   # the exact tier with its spare row, once made

    def exact_tier(self, spec: Buffer) -> tuple:
        """Sinks + ring with one spare row per layer and kv-head (ekx, evx): a decode step's own
        token goes there (decode_prep), so one attend launch covers sinks + ring + the token.
        -> the views without the spare row."""
        self.ekx = torch.zeros(*spec.lead, spec.rows, spec.width, dtype=spec.dtype, device=self.device)
        self.evx = torch.zeros_like(self.ekx)
        return self.ekx[:, :, :spec.rows - 1], self.evx[:, :, :spec.rows - 1]

    def pool(self, spec: Buffer, read_by_device: bool):
        """Values (and rescore's keys) in page-locked host pools, the values mapped for the GPU's value sum."""
        return PinnedPool(spec.lead, spec.width, spec.dtype, spec.rows, self.device, self.copy_stream,
                          mapped=read_by_device and self.values_mapped)

    def indices(self, spec: Buffer):
        """At capacity on the device (doubling an 11 GiB store held old + new + the allocator's
        cache: a 4M prompt peaked at 26.9 GB)."""
        return GrowingBuffer(spec.lead, spec.width, spec.dtype, spec.rows, device=self.device, at_capacity=True)

    def grow(self, spec: Buffer) -> GrowingBuffer:
        """On the device, grown as tokens arrive."""
        return GrowingBuffer(spec.lead, spec.width, spec.dtype, spec.rows, device=self.device)
