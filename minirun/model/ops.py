"""The math of one Llama layer as small functions over torch tensors (no state)."""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

from kernels_cpu.decode import ACTIVATIONS

from .. import hugepages
from ..config import ModelArgs
from ..errors import CheckpointError
from ..quant import RowStack


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> [..., D]; statistics in float32 as the reference implementation does."""
    if x.dtype == torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_inv_freq(args: ModelArgs, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (float32), with llama3 or linear rope_scaling applied; local:
    the sliding layers' (base rope_local_theta, no scaling)."""
    dim = args.head_dim
    theta = args.rope_local_theta if local else args.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = None if local else args.rope_scaling
    kind = (rs or {}).get("rope_type", (rs or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rs["factor"])
    if kind == "llama3":
        factor = float(rs["factor"])
        low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise CheckpointError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear)")


def rope_cos_sin_at(inv_freq64: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype) -> tuple:
    """cos, sin [n, head_dim/2] for the positions in pos [n] (int64 or float64, on inv_freq64's device: a
    captured CUDA graph computes each token's angles itself from a device position); inv_freq64
    [hd/2] float64. Angles in float64, so that positions in the millions keep their phase."""
    ang = pos.to(torch.float64)[:, None] * inv_freq64[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, hd] rotated by position (half-split convention of HF Llama); cos, sin [T, hd/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ w[out, in]^T (+ b); w a float tensor or quantized (minirun.quant: its own linear).
    One-row bfloat16 on the CPU goes through torch.mv, whose kernel is ~2x faster there than
    addmm's (measured: 68 vs 130 us for a 3072x576 GEMV)."""
    if not isinstance(w, torch.Tensor):
        return w.linear(x, b)
    if x.dtype == torch.bfloat16 and x.shape[0] > 1 and x.device.type == "cpu" and not cpu_bf16_gemm():
        return F.linear(x.float(), w.float(), None if b is None else b.float()).to(torch.bfloat16)
    if x.shape[0] == 1 and w.dtype == torch.bfloat16 and x.device.type == "cpu":
        y = torch.mv(w, x[0])[None]
        return y if b is None else y + b
    return F.linear(x, w, b)


@functools.cache
def cpu_bf16_gemm() -> bool:
    """Whether torch's bfloat16 GEMM is native here: the CPU has AVX-512 BF16 or AMX and neither
    ATen nor oneDNN is limited below them (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA). Without it
    oneDNN converts element by element: a bfloat16 prefill ran at 0.22x llama.cpp's on an AVX2
    EPYC, so there a chunk's GEMMs widen to float32 (weights included: a few % of a 512-token
    GEMM's time) and round back."""
    import os
    try:
        caps = torch.cpu.get_capabilities()
        aten = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return False
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    onednn = isa == "ALL" or "BF16" in isa or "AMX" in isa
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16")) and aten.startswith("AVX512") and onednn


def embed(tokens: torch.Tensor, w) -> torch.Tensor:
    """tokens [T] int64 -> their rows of the embedding w [V, D] (float, or quantized: dequantized rows)."""
    return F.embedding(tokens, w) if isinstance(w, torch.Tensor) else w.embedding(tokens)


def swiglu_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """x [T, D] -> [T, D]; w_gate_up [2F, D] holds gate then up."""
    return gated_mlp(x, w_gate_up, w_down, "silu")


def gated_mlp(x: torch.Tensor, w_gate_up, w_down, act: str) -> torch.Tensor:
    """x [T, D] -> [T, D]: down(act(gate) * up), act "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU,
    GELU's tanh form); w_gate_up [2F, D] holds gate then up."""
    gate, up = linear(x, w_gate_up).chunk(2, dim=-1)
    g = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    return linear(g * up, w_down)


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap) (Gemma's final soft-cap), or the logits where cap is None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


# ---- the fused one-token kernels' weights (runners.NumpyTokenRunner) ----------------------------------
# A one-token step is 4 weight GEMVs per layer plus ~60 small ops whose dispatch costs a third of
# the step on a 2-core CPU; kernels_cpu.decode does each half of the layer in one call instead.
_FUSED_WEIGHTS = ("attn_norm", "wqkv", "wo", "ffn_norm", "w_gate_up", "w_down")


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """CPU tensor -> zero-copy numpy array (bfloat16 as uint16 bits); a quantized matrix -> its tiles."""
    if not isinstance(t, torch.Tensor):
        return t.kernel_view()
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def from_numpy_bits(a: np.ndarray) -> torch.Tensor:
    """numpy array from as_numpy (or a kernel) -> zero-copy tensor (uint16 bits back to bfloat16)."""
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if a.dtype == np.uint16 else t


def llama_layer(args: ModelArgs) -> bool:
    """Whether a layer is Llama's own (SwiGLU; no projection biases, heads' norms, norms after the
    attention and MLP, scaled embeddings or queries, soft-capped logits or second RoPE base): what
    the GPU's one-token layer kernels compute. Other layers decode through the torch runner there."""
    return not (args.attention_bias or args.qk_norm or args.post_norms or args.hidden_act != "silu"
                or args.embed_scale or args.query_pre_attn_scalar or args.final_logit_softcapping
                or args.rope_local_theta)


def fused_cpu_layer(args: ModelArgs) -> bool:
    """Whether the CPU's fused one-token kernels compute this architecture's layer: Llama's, with
    Qwen2's QKV bias, the heads' norms (Qwen3, Gemma 3), Gemma 3's norms after attention and MLP
    and GeGLU (kernels_cpu.decode); Gemma's query scale folded into q's head norm (so only where
    there is one: RoPE is linear) and its sliding layers' RoPE base given per layer
    (prepare_fused_decode). Its embeddings' scale and logits' soft-cap are NumpyTokenRunner's,
    outside the kernels."""
    return args.hidden_act in ACTIVATIONS and (args.qk_norm or not args.query_pre_attn_scalar)


def prepare_fused_decode(weights: dict, args: ModelArgs, inv_freq: torch.Tensor, device: torch.device,
                         dtype: torch.dtype) -> bool:
    """Attach numpy views ("np") of the weights where the fused one-token kernels apply: CPU,
    float32 or bfloat16, no output-projection bias (a QKV bias and the norms of heads and after
    attention and MLP are the kernels'), and each matrix a float tensor or one quantized matrix
    (not a minirun.quant.RowStack of formats: that layer's steps go through linear); each layer
    with its RoPE's inv_freq (a sliding layer's own base where it has one). Returns whether they
    do. Those weights (each step streams all of them) are moved to huge pages first
    (minirun.hugepages)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not fused_cpu_layer(args):
        return False
    if any(lw.get("bo") is not None for lw in weights["layers"]):
        return False      # (an output projection's bias: Llama's attention_bias, not in the kernels)
    inv = inv_freq.double().numpy()
    local = rope_inv_freq(args, local=True).double().numpy() if args.rope_local_theta else inv
    for i, lw in enumerate(weights["layers"]):
        for k in _FUSED_WEIGHTS:
            lw[k] = _on_hugepages(lw[k])
        if not any(isinstance(lw[k], RowStack) for k in _FUSED_WEIGHTS):
            lw["np"] = {k: as_numpy(lw[k]) for k in _FUSED_WEIGHTS} | _attn_in_extras(lw, args) | {
                "inv_freq": local if args.layer_window(i) is not None else inv, "post_norms": _post_norms(lw, args)}
    tied = weights["lm_head"] is weights["embed"]
    weights["lm_head"] = _on_hugepages(weights["lm_head"])
    if tied:
        weights["embed"] = weights["lm_head"]
    if not isinstance(weights["lm_head"], RowStack):
        weights["np"] = {"norm": as_numpy(weights["norm"]), "lm_head": as_numpy(weights["lm_head"])}
    return True


def _attn_in_extras(lw: dict, args: ModelArgs) -> dict:
    """The QKV bias f32 [(Hq+2Hkv)*hd] and the heads' norms f32 [2, hd] (q's, k's) as the fused
    kernel takes them: empty where the architecture has none. q's carries the query scale
    (head_dim / query_pre_attn_scalar)^1/2 (the caches scale by head_dim^-1/2; RoPE is linear, so
    scaling before it is the torch runner's scaling after it); lw["q_norm"] stays unscaled."""
    bias = lw.get("bqkv")
    norms = np.zeros((0, args.head_dim), np.float32)
    if args.qk_norm:
        norms = torch.stack([lw["q_norm"], lw["k_norm"]]).float().numpy()        # (a copy)
        if args.query_pre_attn_scalar:
            norms[0] *= np.float32((args.head_dim / args.query_pre_attn_scalar) ** 0.5)
    return {"bqkv": np.zeros(0, np.float32) if bias is None else bias.float().numpy(), "head_norms": norms}


def _post_norms(lw: dict, args: ModelArgs) -> np.ndarray:
    """The norms after the attention and after the MLP f32 [2, D] (Gemma 3's), or [0, D]."""
    if not args.post_norms:
        return np.zeros((0, args.hidden_size), np.float32)
    return torch.stack([lw["post_attn_norm"], lw["post_ffn_norm"]]).float().numpy()


def _on_hugepages(w):
    return hugepages.clone(w) if isinstance(w, torch.Tensor) else w.on_hugepages()


# ---- the same for one GPU token: kernels_cuda.layer (rms_norm, rope, add + rms_norm, silu * up) ------
# A one-token step on an H100 was bound by ~40 torch ops per layer, not by the GPU (docs/PROFILE.md);
# these 4 kernels replace ~30 of them. False: torch's ops instead (the GPU test's reference).
CUDA_LAYER_KERNELS = True


def prepare_cuda_decode(weights: dict, args: ModelArgs, device: torch.device, dtype: torch.dtype,
                        force: bool = False) -> bool:
    """Whether the kernels_cuda.layer one-token path (runners.CudaTokenRunner) applies: a CUDA
    device with kernels_cuda available, float32 or bfloat16, a Llama layer (force: any device, for the
    emulator tests)."""
    import kernels_cuda
    ok = dtype in (torch.float32, torch.bfloat16) and llama_layer(args)
    return ok and (force or (device.type == "cuda" and CUDA_LAYER_KERNELS and kernels_cuda.available()))


def rope_table(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """cos, sin [T, hd/2] -> [T, hd] = cos | sin (what kernels_cuda.layer.rope_ reads)."""
    return torch.cat([cos, sin], dim=-1)
