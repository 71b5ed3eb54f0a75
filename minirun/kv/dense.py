"""Full-precision K and V for every token: the exact baseline."""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import kernels_cpu

from .. import hugepages
from ..model.ops import as_numpy, from_numpy_bits
from .base import KVCache, causal_mask


class DenseCache(KVCache):
    """k, v [L, Hkv, capacity, hd] preallocated in the compute dtype on the compute device (on huge
    pages on the CPU: minirun.hugepages)."""
    truncates_anywhere = True

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(n_layers, capacity)
        shape = (n_layers, n_kv_heads, capacity, head_dim)
        self.k = hugepages.zeros(*shape, dtype=dtype, device=device)
        self.v = hugepages.zeros(*shape, dtype=dtype, device=device)
        # one-token steps on the CPU go to kernels_cpu.dense_attend over numpy views of the cache
        if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            self._k_np, self._v_np = as_numpy(self.k), as_numpy(self.v)
            self._scale = 1.0 / math.sqrt(head_dim)
        else:
            self._k_np = self._v_np = None
        self._o_np = None         # attend_np's output rows, made on its first call
        self._gpu_attn = None     # kernels_cuda's split-K decode attention, made on the first GPU step

    def _gpu_decode(self, Hq: int, dtype: torch.dtype):
        """The GPU's one-query attention (kernels_cuda.dense_decode) for Hq query heads and output
        dtype, or None (CPU, or no cupy)."""
        if self._gpu_attn is None and self.k.is_cuda:
            import kernels_cuda
            if not kernels_cuda.available():
                self._gpu_attn = False
            else:
                from kernels_cuda.dense_decode import DenseDecodeAttention
                L, Hkv, cap, hd = self.k.shape
                self._gpu_attn = DenseDecodeAttention(self.k.device, Hq, Hkv, hd, cap, dtype)
        return self._gpu_attn or None

    def attend_np(self, layer, q, k, v):
        if self._k_np is None or q.dtype != self._k_np.dtype:
            return super().attend_np(layer, q, k, v)
        pos0 = self.offset
        K, V = self._k_np[layer], self._v_np[layer]
        K[:, pos0], V[:, pos0] = k, v
        if self._o_np is None:
            self._o_np = np.empty(q.shape, K.dtype)
        return kernels_cpu.dense_attend(q, K, V, pos0 + 1, self._scale, out=self._o_np)

    def attend(self, layer, q, k, v):
        T, pos0 = q.shape[0], self.offset
        end = pos0 + T
        if T == 1 and self._k_np is not None and q.dtype is self.k.dtype:
            # numpy views only: torch's per-op dispatch cost ~50 us per layer of a one-token step
            o = self.attend_np(layer, as_numpy(q[0]), as_numpy(k[0]), as_numpy(v[0]))
            return from_numpy_bits(o.copy())[None]
        self.k[layer, :, pos0:end] = k.transpose(0, 1)
        self.v[layer, :, pos0:end] = v.transpose(0, 1)
        if T == 1 and self._gpu_decode(q.shape[1], q.dtype) is not None:
            return self._gpu_attn(q[0], self.k[layer], self.v[layer], end)[None]
        return dense_attention(q, self.k[layer, :, :end], self.v[layer, :, :end], pos0)

    # ---- the capture protocol of minirun/cuda_graph.GraphedDecode (kv/hca_graph.py has the HCA one) ----
    def graph_capturable(self) -> bool:
        return True

    def graph_key(self, bucket: int):
        """(key, n_keys): the slots the next step attends over, its position + 1 rounded up to the bucket."""
        nk = min(self.capacity, (self.offset // bucket + 1) * bucket)
        return ("dense", nk), nk

    def graph_prepare(self) -> None:
        """(Nothing: the position comes with the token.)"""

    def commit_at(self, pos) -> None:
        """(Nothing: attend_at wrote each layer's k, v.)"""

    def graph_advance(self) -> None:
        self.advance(1)

    def graph_snapshot(self):
        """(Nothing to undo after a warm-up: writing k, v at the position again is the same write.)"""

    def graph_restore(self, snap) -> None:
        pass

    def rotates_at(self, n_heads: int, dtype: torch.dtype) -> bool:
        """Whether attend_at takes q, k before RoPE (with rope=, their position's cos | sin) and
        turns them in its own first launch: the GPU's step, where the cache's dtype is the model's."""
        return dtype == self.k.dtype and self._gpu_decode(n_heads, dtype) is not None

    def attend_at(self, layer, q, k, v, pos, n_keys, rope=None):
        """attend for one token whose position is a device tensor pos [1] int64 (a CUDA graph's step,
        Model.decode_at): k, v [1, Hkv, hd] written at pos, then attention over the first n_keys
        slots (n_keys > pos, fixed per graph: fixed shapes) with those past pos masked.
        q [1, Hq, hd] -> [1, Hq, hd]. rope: [hd] cos | sin of pos where q, k are not turned yet
        (rotates_at)."""
        K, V = self.k[layer], self.v[layer]                                       # [Hkv, capacity, hd]
        if rope is not None:
            return self._gpu_attn.step_unrotated(q[0], k[0], v[0], rope, K, V, n_keys, pos, layer == 0)[None]
        K.index_copy_(1, pos, k.transpose(0, 1).to(K.dtype))
        V.index_copy_(1, pos, v.transpose(0, 1).to(V.dtype))
        if self._gpu_decode(q.shape[1], q.dtype) is not None:
            return self._gpu_attn(q[0], K, V, n_keys, pos)[None]
        live = (torch.arange(n_keys, device=pos.device) <= pos).view(1, 1, 1, n_keys)   # bool
        _, Hq, hd = q.shape
        qg = q.view(1, K.shape[0], Hq // K.shape[0], hd)
        # on a GPU not cuDNN's masked attention: its few-query shapes have a history of failing under capture
        backends = sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]) if q.is_cuda else contextlib.nullcontext()
        with backends:
            o = F.scaled_dot_product_attention(qg, K[None, :, :n_keys], V[None, :, :n_keys], attn_mask=live)
        return o.reshape(1, Hq, hd)

    def truncate(self, n: int) -> bool:
        self.offset = min(self.offset, n)
        return True

    def state_signature(self) -> dict:
        return {"kind": "dense", "capacity": self.capacity, "shape": list(self.k.shape), "dtype": str(self.k.dtype)}

    def state_dict(self) -> tuple[dict, list]:
        n = self.offset
        return {"offset": n}, [(f"{kv}.{layer}", t[layer, :, :n]) for layer in range(self.n_layers)
                               for kv, t in (("k", self.k), ("v", self.v))]

    def load_state_dict(self, scalars: dict, get) -> None:
        n = scalars["offset"]
        for layer in range(self.n_layers):
            self.k[layer, :, :n] = get(f"k.{layer}")
            self.v[layer, :, :n] = get(f"v.{layer}")
        self.offset = n

    def stats(self) -> dict:
        nbytes = self.k.numel() * self.k.element_size() * 2
        return {"tokens": self.offset, "capacity": self.capacity,
                "device_kv_bytes": nbytes, "total_bytes": nbytes}


def dense_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, pos0: int) -> torch.Tensor:
    """Causal GQA attention. q [T, Hq, hd] at positions pos0..; K, V [Hkv, n, hd] -> [T, Hq, hd]."""
    T, Hq, hd = q.shape
    Hkv = K.shape[0]
    if T == 1:
        # decode on the GPU or in float16 (the CPU's float32/bfloat16 steps take dense_attend): the
        # n_rep query heads of a kv-head act as n_rep queries of one head, no mask, no K copy; 4-D
        # inputs take torch's fused CPU kernel, 3-D ones its math path (measured on a 2-core
        # Zen 4: 3x slower at 512 keys and 9x at 16K in bfloat16, 1.5x at 16K in float32)
        qg = q.view(1, Hkv, Hq // Hkv, hd)
        return F.scaled_dot_product_attention(qg, K[None], V[None]).reshape(1, Hq, hd)
    if pos0 > 0:
        # a prompt after cached tokens (a chunk of a long one, a question after a reused document):
        # as in decode, the n_rep query heads of a kv-head act as n_rep * T queries of one head, under
        # the causal mask repeated per head, so K and V are not copied per query head; at 16K keys
        # the copies cost more than a short suffix's attention (2-core CPU, 2026-11-26, under load:
        # 11 queries 72 against 183 ms a layer, 512 queries 770 against 853 ms)
        rep = Hq // Hkv
        qg = q.view(T, Hkv, rep, hd).permute(1, 2, 0, 3).reshape(1, Hkv, rep * T, hd)
        mask = causal_mask(pos0, T, q.device).repeat(rep, 1)                  # [rep * T, pos0 + T]
        o = F.scaled_dot_product_attention(qg, K[None], V[None], attn_mask=mask)
        return o.view(Hkv, rep, T, hd).permute(2, 0, 1, 3).reshape(T, Hq, hd)
    # a fresh prompt: 4-D inputs with K/V repeated per query head take torch's fused CPU kernel
    # with is_causal; 3-D inputs or enable_gqa fall back to the unfused math path (~5x slower here)
    if Hq != Hkv:
        K, V = K.repeat_interleave(Hq // Hkv, 0), V.repeat_interleave(Hq // Hkv, 0)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], K[None], V[None], is_causal=True)
    return o[0].transpose(0, 1)
