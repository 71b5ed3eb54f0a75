"""The Llama model: immutable weights and one layer loop. Caches are passed in, never owned."""
from __future__ import annotations

import torch

from .config import ModelArgs
from .cpu_token import CPUToken
from .ops import (Residual, attention_input, attention_output_and_mlp, embed, output_logits, prepare_cuda_decode,
                  prepare_fused_decode, rope_cos_sin, rope_cos_sin_at, rope_inv_freq, rope_table)


class Model:
    """Llama decoder. `forward` reads the position from the cache and advances it once at the end.

    weights: see loader.load_weights (fused wqkv [(Hq+2Hkv)*hd, D] and w_gate_up [2F, D]).
    """

    def __init__(self, args: ModelArgs, weights: dict, device: torch.device, dtype: torch.dtype):
        self.args, self.w, self.device, self.dtype = args, weights, device, dtype
        self.inv_freq = rope_inv_freq(args)
        self.inv_freq64 = self.inv_freq.to(device=device, dtype=torch.float64)   # (decode_at's angles)
        # one-token steps on the CPU: each half of a layer in one fused kernel (ops.py)
        self.fused_decode = prepare_fused_decode(weights, args, self.inv_freq, device, dtype)
        # ... and the whole token through numpy arrays where every layer has them (cpu_token.py)
        self.cpu_token = CPUToken.of(weights, args, dtype) if self.fused_decode else None
        # one-token steps on a GPU: the small ops of a layer in 4 kernels (ops.py)
        self.cuda_decode = device.type == "cuda" and prepare_cuda_decode(weights, args, device, dtype)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache, all_logits: bool = False, hidden: bool = False) -> torch.Tensor:
        """tokens [T] (int64) at positions cache.offset.. -> logits [T, V] or [1, V] (float32); hidden:
        the last token's hidden state [1, D] instead (a prompt chunk whose logits nobody reads: the LM
        head is a large share of a one-token step; `logits` makes them later)."""
        a = self.args
        T = tokens.shape[0]
        if T == 1 and self.cpu_token is not None and not self.cuda_decode:
            return self.cpu_token.forward(tokens, cache, hidden)
        cos, sin = rope_cos_sin(self.inv_freq, cache.offset, T, self.dtype, self.device)
        cs = rope_table(cos, sin) if T == 1 and self.cuda_decode else None        # once per token
        x = embed(tokens, self.w["embed"])                                        # [T, D]
        for il, lw in enumerate(self.w["layers"]):
            q, k, v = attention_input(x, lw, cos, sin, cache.offset, a, cs)  # rms_norm, QKV, RoPE
            o = cache.attend(il, q, k, v)                        # [T, Hq, hd]
            x = attention_output_and_mlp(x, o, lw, a)            # x + o_proj(o); x + mlp(rms_norm(x))
        cache.advance(T)
        if isinstance(x, Residual):   # (a GPU token: the last MLP output not added yet)
            return x.value().clone() if hidden else output_logits(x, self.w, a)
        if hidden:   # (a copy: on the CPU x may be a buffer the next step reuses)
            return x[-1:].clone()
        return output_logits(x if all_logits else x[-1:], self.w, a)   # [T or 1, V] float32

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """forward(hidden=True)'s state [1, D] -> its logits [1, V] (float32)."""
        return output_logits(x, self.w, self.args)

    @torch.inference_mode()
    def decode_at(self, token: torch.Tensor, pos: torch.Tensor, cache, n_keys: int) -> torch.Tensor:
        """One decode token with no host value in it, what minirun/cuda_graph.py captures: token, pos
        [1] int64 on the device; the cache attends with attend_at (n_keys: the size its graph_key
        chose), then commit_at. -> logits [1, V] float32. The host's bookkeeping (graph_advance)
        is the caller's."""
        a = self.args
        cos, sin = rope_cos_sin_at(self.inv_freq64, pos, self.dtype)
        cs = rope_table(cos, sin) if self.cuda_decode else None
        turned = cs is not None and cache.rotates_at(a.num_attention_heads, self.dtype)   # (RoPE in its first launch)
        x = embed(token, self.w["embed"])                                         # [1, D]
        for il, lw in enumerate(self.w["layers"]):
            q, k, v = attention_input(x, lw, cos, sin, None, a, cs, rotate=not turned)
            o = cache.attend_at(il, q, k, v, pos, n_keys, rope=cs[0] if turned else None)
            x = attention_output_and_mlp(x, o, lw, a)
        cache.commit_at(pos)                         # (HCA: the ring's oldest token into the store)
        return output_logits(x, self.w, a)
