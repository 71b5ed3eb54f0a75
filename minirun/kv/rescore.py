"""The HCA cache's rescoring step: what weights the selected store tokens' values.

HCABase picks one when it is made (`rescoring`) and calls it where the step differs: as keys leave
the ring, and in a GPU's host value sum. NoRescore, the default, keeps the key store's scores (its
methods do nothing); HostKeyRescore (config.rescore, a store of codes) keeps the store's keys in a
host pool beside the values (the "host keys" tier, hca_layout.hca_tiers) and replaces the selected
tokens' scores by exact ones from them. The CPU's one-call steps read that pool in their kernel
(hca.HCACache._views_of passes it); a GPU sums on the host then (value_sum "host",
hca_cuda.value_sum_choice), where `rescore` runs before the value sum.
"""
from __future__ import annotations

import numpy as np
import torch

import kernels_cpu as kc


class NoRescore:
    """The key store's scores weight the selected values."""

    on = False    # exact scores from host keys (a GPU then sums values on the host)
    keys = None   # the host pool of the store's keys [L, Hkv, cap, hd], or None

    def keys_left_ring(self, j0: int, K: torch.Tensor) -> None:
        """K [L, Hkv, m, hd]: the keys of store rows j0.. as the store holds them (nothing kept)."""

    def hold_query(self, q: torch.Tensor, gpu: bool) -> None:
        """A GPU step's query [Hq, hd] f32 that read the store, for `rescore` (none kept)."""

    def rescore(self, layer: int, idx: np.ndarray, counts: np.ndarray, q_to_kv: np.ndarray, z: np.ndarray) -> None:
        """The selected tokens' scores z [Hq, w] (of store rows idx [Hq, w], counts [Hq]), in place (kept)."""

    def wait(self) -> None:
        """Block until the pool's writes in flight have landed (none)."""


class HostKeyRescore(NoRescore):
    """Exact scores of the selected tokens from the store's keys kept on the host."""

    on = True

    def __init__(self, keys):
        self.keys = keys          # the host pool (a GPU's: page-locked, written by async copies)
        self._query = None        # the query the host rescores with [Hq, hd] f32 (pinned on a GPU)

    def keys_left_ring(self, j0: int, K: torch.Tensor) -> None:
        self.keys.reserve(j0 + K.shape[2])
        self.keys.write_all(j0, K)

    def hold_query(self, q: torch.Tensor, gpu: bool) -> None:
        if self._query is None:
            self._query = torch.empty(q.shape, dtype=torch.float32, pin_memory=gpu)
        self._query.copy_(q, non_blocking=gpu)

    def rescore(self, layer, idx, counts, q_to_kv, z) -> None:
        self.wait()
        kc.selected_scores(self._query.numpy(), self.keys.data[layer].numpy(), idx, counts, q_to_kv, z, compact=True)

    def wait(self) -> None:
        if hasattr(self.keys, "wait"):   # (a GPU's pool; the CPU's writes are synchronous)
            self.keys.wait()
