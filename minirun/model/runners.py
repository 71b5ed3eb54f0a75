"""Layer runners: what a layer's two halves and the head are made of, per device, chosen at load.

`Model.run` is the one layer loop of the code base: embed, then per layer attn_in -> attend ->
attn_out, then finish (the caches advance) and the head. A runner supplies those steps:
- TorchRunner: torch ops on any device, for any batch (prompt chunks, several sequences' decode
  tokens together); the reference the others are tested against.
- NumpyTokenRunner: one CPU token of each of B sequences through numpy arrays and the fused
  kernels (kernels_cpu.decode: norm + QKV + RoPE in one call, output projection + norm + MLP in
  another; their GEMVs read the weights once for the B tokens). Going through torch
  tensors instead adds ~15 tensor <-> array conversions and checks a layer, ~1.8 ms of a 7.6 ms
  SmolLM2 token on 2 cores. A layer the kernels cannot take (a minirun.quant.RowStack of formats)
  runs torch's ops on the same buffers.
- CudaTokenRunner: one GPU token through kernels_cuda.layer (rms_norm, RoPE, add + rms_norm,
  silu * up: ~30 fewer launches a layer), the residual kept as s + r so that the next norm adds r.

A Step is what one call of the loop knows: the batch, each sequence's cache, the RoPE angles, and
for a captured step (cuda_graph.py) the device position and the graph's key count.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import kernels_cpu
from kernels_cpu.decode import ACTIVATIONS, attn_in_into, attn_out_into, norm_gemv_into

from ..config import ModelArgs
from .ops import apply_rope, as_numpy, embed, from_numpy_bits, gated_mlp, linear, rms_norm, soft_cap


@dataclass(frozen=True)
class Batch:
    """One or more sequences' tokens laid end to end: tokens [N] int64 (on the model's device),
    lengths: tokens per sequence (sum N), starts: each sequence's first position. A prompt chunk is
    one sequence of T tokens; a batched decode step is B sequences of one token."""
    tokens: torch.Tensor
    lengths: tuple
    starts: tuple

    @staticmethod
    def of(tokens: list[torch.Tensor], starts) -> "Batch":
        return Batch(torch.cat(tokens) if len(tokens) > 1 else tokens[0], tuple(int(t.shape[0]) for t in tokens),
                     tuple(int(s) for s in starts))

    def positions(self, device) -> torch.Tensor:
        """[N] float64: each token's position."""
        return torch.cat([torch.arange(s, s + n, dtype=torch.float64, device=device)
                          for s, n in zip(self.starts, self.lengths)])

    def spans(self):
        """(first row, end row) per sequence."""
        r = 0
        for n in self.lengths:
            yield r, r + n
            r += n


@dataclass
class Step:
    """One call of the layer loop: cos, sin [N, hd/2] of each token's position where the runner
    needs them (cs: cos | sin [N, hd] where it reads one table); at: (pos [1] int64 on the device, n_keys) for a captured
    one-token step (attend_at, commit_at); turned: that step's RoPE is left to the cache's attend_at."""
    batch: Batch
    caches: list
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    cs: torch.Tensor | None = None
    at: tuple | None = None
    turned: bool = False
    local: tuple | None = None      # (cos, sin) of the sliding layers' RoPE base, where it has its own
    sliding: tuple = ()             # per layer: whether it takes `local`

    def angles(self, layer: int) -> tuple:
        """(cos, sin) of the layer's RoPE."""
        return self.local if self.local is not None and self.sliding[layer] else (self.cos, self.sin)

    def attend(self, layer: int, q, k, v, cache):
        """One sequence's attention through its cache: the captured step's attend_at or attend."""
        if self.at is None:
            return cache.attend(layer, q, k, v)
        pos, n_keys = self.at
        return cache.attend_at(layer, q, k, v, pos, n_keys, rope=self.cs[0] if self.turned else None)

    def finish(self) -> None:
        """After the last layer: the captured step commits on the device (its host bookkeeping is
        the caller's), every other step advances each cache by its tokens."""
        if self.at is not None:
            self.caches[0].commit_at(self.at[0])
            return
        for cache, n in zip(self.caches, self.batch.lengths):
            cache.advance(n)


class TorchRunner:
    """torch ops: any device, any batch."""
    needs_angles = True   # (Step.cos, sin: RoPE's angles; cs: as one table)
    needs_table = False

    def __init__(self, weights: dict, args: ModelArgs):
        self.w, self.a = weights, args

    def embed(self, st: Step):
        x = embed(st.batch.tokens, self.w["embed"])                                # [N, D]
        if self.a.embed_scale:   # (the scale rounded to the weights' dtype first, as transformers does)
            x = x * torch.tensor(self.a.hidden_size ** 0.5, dtype=x.dtype)
        return x

    def attn_in(self, layer: int, x, st: Step):
        """x [N, D] -> q [N, Hq, hd], k, v [N, Hkv, hd]: rms_norm, the fused QKV projection (+ its
        bias), the heads' norms where the architecture has them, RoPE."""
        a, lw = self.a, self.w["layers"][layer]
        N, hd, Hq, Hkv = x.shape[0], a.head_dim, a.num_attention_heads, a.num_key_value_heads
        qkv = linear(rms_norm(x, lw["attn_norm"], a.rms_norm_eps), lw["wqkv"], lw.get("bqkv")).view(N, Hq + 2 * Hkv, hd)
        q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]     # (slices: split costs 10 us)
        if a.qk_norm:     # each head of q and k normalized before RoPE (qwen3, gemma3)
            q, k = rms_norm(q, lw["q_norm"], a.rms_norm_eps), rms_norm(k, lw["k_norm"], a.rms_norm_eps)
        cos, sin = st.angles(layer)
        q = apply_rope(q, cos, sin)
        if a.query_pre_attn_scalar:   # (the caches scale by head_dim^-1/2)
            q = q * (a.head_dim / a.query_pre_attn_scalar) ** 0.5
        return q, apply_rope(k, cos, sin), v

    def attend(self, layer: int, q, k, v, st: Step):
        """Each sequence's rows through its own cache -> o [N, Hq, hd]."""
        if len(st.caches) == 1:
            return st.attend(layer, q, k, v, st.caches[0])
        return torch.cat([st.attend(layer, q[r0:r1], k[r0:r1], v[r0:r1], c)
                          for c, (r0, r1) in zip(st.caches, st.batch.spans())])

    def attn_out(self, layer: int, x, o):
        """x + o_proj(o), then + mlp(rms_norm(.)): x [N, D], o [N, Hq, hd] -> [N, D]."""
        a, lw = self.a, self.w["layers"][layer]
        h = linear(o.reshape(x.shape[0], -1), lw["wo"], lw.get("bo"))
        if a.post_norms:
            h = rms_norm(h, lw["post_attn_norm"], a.rms_norm_eps)
        x = x + h
        h = gated_mlp(rms_norm(x, lw["ffn_norm"], a.rms_norm_eps), lw["w_gate_up"], lw["w_down"], a.hidden_act)
        if a.post_norms:
            h = rms_norm(h, lw["post_ffn_norm"], a.rms_norm_eps)
        return x + h

    def head(self, x, st: Step, all_logits: bool, hidden: bool):
        """-> logits float32 of each sequence's last token [B, V] (all_logits: every token's [N, V]);
        hidden: those tokens' hidden states instead (copies)."""
        if not all_logits:
            x = x[[r1 - 1 for _, r1 in st.batch.spans()]] if len(st.caches) > 1 else x[-1:]
        return x.clone() if hidden else self.logits(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden states x [n, D] -> logits [n, V] float32."""
        return soft_cap(linear(rms_norm(x, self.w["norm"], self.a.rms_norm_eps), self.w["lm_head"]).float(),
                        self.a.final_logit_softcapping)


class NumpyTokenRunner(TorchRunner):
    """One token of each of B sequences (a decode step, B >= 1) on the CPU through numpy arrays and
    the fused kernels, whose GEMVs read the weights once for the B tokens; the residual [B, D] in
    two buffers, in turns. Applies where ops.prepare_fused_decode gave the weights numpy views ("np")."""

    def __init__(self, weights: dict, args: ModelArgs, dtype: torch.dtype):
        super().__init__(weights, args)
        self.np = [lw.get("np") for lw in weights["layers"]]
        self.head_np = weights.get("np")
        self.eps = np.float32(args.rms_norm_eps)
        self.act = np.uint16 if dtype == torch.bfloat16 else np.float32    # (bfloat16 as its bits)
        self.gate = ACTIVATIONS[args.hidden_act]                           # (the MLP's, as attn_out_into takes it)
        kernels_cpu.decode.check_fused_weights([w for w in self.np if w is not None], self.head_np, self.act)
        self.needs_angles = any(w is None for w in self.np)   # (the fused kernel turns its own q, k)
        self.x = {}                                           # B -> the two residual buffers [B, D]

    def embed(self, st: Step):
        B = len(st.batch.lengths)
        if B not in self.x:
            self.x[B] = [np.empty((B, self.a.hidden_size), self.act) for _ in range(2)]
        self.pos = np.asarray(st.batch.starts, np.int64)
        x = self.x[B][0]
        x[:] = as_numpy(super().embed(st))
        return x

    def attn_in(self, layer: int, x, st: Step):
        """x [B, D] -> q [B, Hq, hd], k, v [B, Hkv, hd] (numpy; a fresh qkv each layer: a cache may keep k, v)."""
        a, w = self.a, self.np[layer]
        B, Hq, Hkv, hd = x.shape[0], a.num_attention_heads, a.num_key_value_heads, a.head_dim
        if w is None:
            return tuple(as_numpy(t) for t in super().attn_in(layer, from_numpy_bits(x), st))
        qkv = np.empty((B, (Hq + 2 * Hkv) * hd), self.act)
        attn_in_into(x, w["attn_norm"], self.eps, w["wqkv"], w["bqkv"], w["head_norms"], Hq, self.pos, w["inv_freq"],
                     Hq + Hkv, hd, qkv)
        return qkv[:, :Hq * hd].reshape(B, Hq, hd), qkv[:, Hq * hd:(Hq + Hkv) * hd].reshape(B, Hkv, hd), \
            qkv[:, (Hq + Hkv) * hd:].reshape(B, Hkv, hd)

    def attend(self, layer: int, q, k, v, st: Step):
        """Each sequence's token through its cache's attend_np -> o [B, Hq*hd]."""
        if len(st.caches) == 1:
            return st.caches[0].attend_np(layer, q[0], k[0], v[0]).reshape(1, -1)
        o = np.empty((q.shape[0], q.shape[1] * q.shape[2]), q.dtype)
        for b, cache in enumerate(st.caches):
            o[b] = cache.attend_np(layer, q[b], k[b], v[b]).reshape(-1)
        return o

    def attn_out(self, layer: int, x, o):
        pair = self.x[x.shape[0]]
        spare = pair[1] if x is pair[0] else pair[0]
        w = self.np[layer]
        if w is None:
            spare[:] = as_numpy(super().attn_out(layer, from_numpy_bits(x), from_numpy_bits(o)))
        else:
            attn_out_into(x, o, w["wo"], w["ffn_norm"], self.eps, w["w_gate_up"], w["w_down"], w["post_norms"],
                          self.gate, spare)
        return spare

    def head(self, x, st: Step, all_logits: bool, hidden: bool):
        if hidden or self.head_np is None:
            return super().head(from_numpy_bits(x.copy()), st, all_logits, hidden)
        return self._norm_gemv(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.head_np is None:
            return super().logits(x)
        return self._norm_gemv(np.ascontiguousarray(as_numpy(x)))

    def _norm_gemv(self, x: np.ndarray) -> torch.Tensor:
        """x [B, D] -> logits [B, V] float32 (the fused final norm and LM head, then the soft-cap
        where the architecture has one)."""
        logits = np.empty((x.shape[0], kernels_cpu.decode.rows_of(self.head_np["lm_head"])), np.float32)
        norm_gemv_into(x, self.head_np["norm"], self.eps, self.head_np["lm_head"], logits)
        return soft_cap(torch.from_numpy(logits), self.a.final_logit_softcapping)


class Residual:
    """A GPU token's residual stream s + r, the MLP's output r not added yet: the next rms_norm
    adds it in its own launch (layer.add_rms_norm), one launch less a layer. s, r [1, D]."""
    __slots__ = ("s", "r")

    def __init__(self, s: torch.Tensor, r: torch.Tensor | None = None):
        self.s, self.r = s, r

    def norm(self, w: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm(s + r, w, eps); s becomes the sum."""
        from kernels_cuda import layer as kl
        if self.r is None:
            return kl.rms_norm(self.s, w, eps)
        self.s, h = kl.add_rms_norm(self.s, self.r, w, eps)
        self.r = None
        return h

    def value(self) -> torch.Tensor:
        return self.s if self.r is None else self.s + self.r


class CudaTokenRunner(TorchRunner):
    """One GPU token of one sequence through kernels_cuda.layer (ops.prepare_cuda_decode says where
    it applies); RoPE from the step's cos | sin table, or left to the cache (Step.turned)."""
    needs_table = True

    def embed(self, st: Step):
        return Residual(super().embed(st))

    def attn_in(self, layer: int, x, st: Step):
        from kernels_cuda import layer as kl
        a, lw = self.a, self.w["layers"][layer]
        Hq, Hkv, hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        qkv = linear(x.norm(lw["attn_norm"], a.rms_norm_eps), lw["wqkv"])
        if not st.turned:
            kl.rope_(qkv, Hq + Hkv, hd, st.cs[0])
        qkv = qkv.view(1, Hq + 2 * Hkv, hd)
        return qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]

    def attn_out(self, layer: int, x, o):
        from kernels_cuda import layer as kl
        a, lw = self.a, self.w["layers"][layer]
        s, h = kl.add_rms_norm(x.value(), linear(o.reshape(1, -1), lw["wo"]), lw["ffn_norm"], a.rms_norm_eps)
        return Residual(s, linear(kl.silu_mul(linear(h, lw["w_gate_up"])), lw["w_down"]))

    def head(self, x, st: Step, all_logits: bool, hidden: bool):
        if hidden:
            return x.value().clone()
        return linear(x.norm(self.w["norm"], self.a.rms_norm_eps), self.w["lm_head"]).float()

