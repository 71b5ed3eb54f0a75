"""The Llama model: immutable weights and one layer loop. Caches are passed in, never owned."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelArgs
from .ops import apply_rope, linear, rms_norm, rope_cos_sin, rope_inv_freq, swiglu_mlp


class Model:
    """Llama decoder. `forward` reads the position from the cache and advances it once at the end.

    weights: see loader.load_weights (fused wqkv [(Hq+2Hkv)*hd, D] and w_gate_up [2F, D]).
    """

    def __init__(self, args: ModelArgs, weights: dict, device: torch.device, dtype: torch.dtype):
        self.args, self.w, self.device, self.dtype = args, weights, device, dtype
        self.inv_freq = rope_inv_freq(args)
        hd = args.head_dim
        self.q_dim = args.num_attention_heads * hd
        self.kv_dim = args.num_key_value_heads * hd

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache, all_logits: bool = False) -> torch.Tensor:
        """tokens [T] (int64) at positions cache.offset.. -> logits [T, V] or [1, V] (float32)."""
        a = self.args
        T, hd = tokens.shape[0], a.head_dim
        cos, sin = rope_cos_sin(self.inv_freq, cache.offset, T, self.dtype, self.device)
        x = F.embedding(tokens, self.w["embed"])                                  # [T, D]
        for il, lw in enumerate(self.w["layers"]):
            h = rms_norm(x, lw["attn_norm"], a.rms_norm_eps)
            qkv = linear(h, lw["wqkv"], lw.get("bqkv"))                        # [T, (Hq+2Hkv)*hd]
            q, k, v = qkv.split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
            q = apply_rope(q.view(T, -1, hd), cos, sin)                          # [T, Hq, hd]
            k = apply_rope(k.view(T, -1, hd), cos, sin)                          # [T, Hkv, hd]
            o = cache.attend(il, q, k, v.view(T, -1, hd))                        # [T, Hq, hd]
            x = x + linear(o.reshape(T, -1), lw["wo"], lw.get("bo"))
            x = x + swiglu_mlp(rms_norm(x, lw["ffn_norm"], a.rms_norm_eps), lw["w_gate_up"], lw["w_down"])
        cache.advance(T)
        x = rms_norm(x if all_logits else x[-1:], self.w["norm"], a.rms_norm_eps)
        return linear(x, self.w["lm_head"]).float()
