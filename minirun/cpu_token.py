"""One decode token on the CPU through numpy arrays end to end.

Each layer is three calls (kernels_cpu.decode: norm + QKV + RoPE, the cache's attention, then
output projection + norm + MLP) on buffers allocated once, with the weights' dtypes checked once
here. Going through torch tensors instead (attention_input, cache.attend,
attention_output_and_mlp) adds ~15 tensor <-> array conversions, views and checks a layer: on
SmolLM2 (30 layers, 2 cores) ~1.8 ms of a 7.6 ms token.

Caches take part through `attend_np(layer, q, k, v)` (numpy rows; KVCache's default goes through
`attend`).
"""
from __future__ import annotations

import numpy as np
import torch

import kernels_cpu
from kernels_cpu.decode import attn_in_into, attn_out_into, norm_gemv_into

from .config import ModelArgs
from .ops import as_numpy, embed, from_numpy_bits


class CPUToken:
    """The one-token step of a model whose every layer has the fused kernels' numpy weights ("np",
    ops.prepare_fused_decode) and whose LM head has them too; `of` says whether one applies."""

    def __init__(self, weights: dict, args: ModelArgs, dtype: torch.dtype):
        self.w = weights
        self.layers = [lw["np"] for lw in weights["layers"]]
        self.head = weights["np"]
        self.eps = np.float32(args.rms_norm_eps)
        self.Hq, self.Hkv, self.hd = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        act = np.uint16 if dtype == torch.bfloat16 else np.float32    # (bfloat16 as its bits)
        kernels_cpu.decode.check_fused_weights(self.layers, self.head, act)
        self.x = [np.empty(args.hidden_size, act) for _ in range(2)]      # the residual, in turns
        self.act = act
        self.vocab = kernels_cpu.decode.rows_of(self.head["lm_head"])

    @staticmethod
    def of(weights: dict, args: ModelArgs, dtype: torch.dtype) -> "CPUToken | None":
        if "np" not in weights or not all("np" in lw for lw in weights["layers"]):
            return None
        return CPUToken(weights, args, dtype)

    def forward(self, token: torch.Tensor, cache, hidden: bool = False) -> torch.Tensor:
        """token [1] int64 at position cache.offset -> logits [1, V] float32 (hidden: the hidden
        state [1, D] instead, a copy)."""
        Hq, Hkv, hd, pos = self.Hq, self.Hkv, self.hd, cache.offset
        x, spare = self.x
        x[:] = as_numpy(embed(token, self.w["embed"]))[0]
        for il, w in enumerate(self.layers):
            # (a fresh qkv each layer: a cache may keep k and v as they are)
            qkv = np.empty((Hq + 2 * Hkv) * hd, self.act)
            attn_in_into(x, w["attn_norm"], self.eps, w["wqkv"], pos, w["inv_freq"], Hq + Hkv, hd, qkv)
            q = qkv[:Hq * hd].reshape(Hq, hd)
            k = qkv[Hq * hd:(Hq + Hkv) * hd].reshape(Hkv, hd)
            o = cache.attend_np(il, q, k, qkv[(Hq + Hkv) * hd:].reshape(Hkv, hd))
            attn_out_into(x, o.reshape(-1), w["wo"], w["ffn_norm"], self.eps, w["w_gate_up"], w["w_down"], spare)
            x, spare = spare, x
        cache.advance(1)
        if hidden:
            return from_numpy_bits(x.copy())[None]
        logits = np.empty(self.vocab, np.float32)
        norm_gemv_into(x, self.head["norm"], self.eps, self.head["lm_head"], logits)
        return torch.from_numpy(logits)[None]
