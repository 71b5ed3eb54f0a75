"""config.json and generation_config.json of a converted GGUF, from its header: the architecture's
hyper-parameters (read under llama's key names: as_llama_keys), its RoPE scaling (the header's
keys, or a llama3 `rope_freqs` tensor matched to its parameters) and its end-of-turn tokens.

A gemma3 GGUF leaves out what llama.cpp hard-codes for the architecture (llama-model.cpp's hparams
for LLM_ARCH_GEMMA3), and config.json states it: every sixth layer global, the others over the
sliding window (when the header gives one); the local layers' RoPE base 10000, unscaled; attention
logits scaled by head_dim^-1/2, hidden_size / heads for the 27B (62 layers); GELU (tanh).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import CheckpointError

# general.architecture -> the HF class named in config.json (model_type is the same word but where
# MODEL_TYPES says)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM"}
MODEL_TYPES = {"gemma3": "gemma3_text"}
GEMMA3_SWA_PATTERN = 6           # layer i global when (i + 1) % 6 == 0
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62           # llama.cpp's test for the 27B's attention scale
# tokens that end a turn though the header names no eot id (llama.cpp finds them by their text)
END_OF_TURN_TOKENS = ("<end_of_turn>",)


def _need(meta: dict, key: str, path) -> Any:
    if key not in meta:
        raise CheckpointError(f"{path}: GGUF metadata key {key!r} is missing")
    return meta[key]


def _llama3_factors(head_dim, theta, factor, low, high, orig) -> np.ndarray:
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def _rope_scaling(meta: dict, rope_freqs: np.ndarray | None, head_dim: int, theta: float, path):
    """HF `rope_scaling` from llama.rope.scaling.* keys or a llama3 `rope_freqs` tensor."""
    kind = meta.get("llama.rope.scaling.type")
    factor = meta.get("llama.rope.scaling.factor", meta.get("llama.rope.scale_linear"))
    if kind is None and factor is not None:
        kind = "linear"
    if kind in ("linear", "yarn") and factor not in (None, 1.0):
        out: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        orig = meta.get("llama.rope.scaling.original_context_length")
        if kind == "yarn" and orig:
            out["original_max_position_embeddings"] = int(orig)
        return out
    if kind not in (None, "none", "linear", "yarn"):
        raise CheckpointError(f"{path}: unsupported rope scaling type {kind!r}")
    if rope_freqs is None:
        return None
    rope_freqs = rope_freqs.reshape(-1).astype(np.float64)
    factor = float(rope_freqs.max())
    for orig in (8192, 4096, 2048, 16384, 32768):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
            want = _llama3_factors(head_dim, theta, factor, low, high, orig)
            if want.shape == rope_freqs.shape and np.allclose(want, rope_freqs, rtol=1e-3):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": orig}
    raise CheckpointError(f"{path}: rope_freqs tensor matches no known llama3 rope scaling")


def as_llama_keys(meta: dict, arch: str) -> dict:
    """The header with the architecture's own keys ("qwen2.embedding_length") under llama's names:
    the architectures minirun converts name the same hyper-parameters the same way after the prefix."""
    cut = len(arch) + 1
    return {("llama." + k[cut:] if k.startswith(arch + ".") else k): v for k, v in meta.items()}


def build_config(meta: dict, n_vocab: int, tied: bool, dtype: str, rope_freqs, has_bias, path,
                 arch: str = "llama") -> dict:
    hidden = int(_need(meta, "llama.embedding_length", path))
    n_head = int(_need(meta, "llama.attention.head_count", path))
    n_kv = int(meta.get("llama.attention.head_count_kv", n_head))
    head_dim = int(meta.get("llama.attention.key_length", hidden // n_head))
    theta = float(meta.get("llama.rope.freq_base", 10000.0))
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": MODEL_TYPES.get(arch, arch),
        "hidden_size": hidden,
        "intermediate_size": int(_need(meta, "llama.feed_forward_length", path)),
        "num_hidden_layers": int(_need(meta, "llama.block_count", path)),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta,
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "vocab_size": n_vocab,
        "tie_word_embeddings": tied,
        "attention_bias": has_bias["attn"],
        "mlp_bias": has_bias["mlp"],
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": dtype,
        "rope_scaling": _rope_scaling(meta, rope_freqs, head_dim, theta, path),
    }
    if config["rope_scaling"] is None:
        del config["rope_scaling"]
    if "tokenizer.ggml.padding_token_id" in meta:
        config["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
    if arch == "gemma3":
        config |= _gemma3_fields(meta, config)
    return config


def _gemma3_fields(meta: dict, config: dict) -> dict:
    """config.json's Gemma 3 keys (transformers' Gemma3TextConfig names) for what a gemma3 GGUF
    header gives and llama.cpp fixes (the module docstring)."""
    n_layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    window = int(meta.get("llama.attention.sliding_window") or 0)
    scalar = hidden // config["num_attention_heads"] if n_layers == GEMMA3_27B_LAYERS else config["head_dim"]
    kinds = ["full_attention" if (i + 1) % GEMMA3_SWA_PATTERN == 0 or not window else "sliding_attention"
             for i in range(n_layers)]
    softcap = meta.get("llama.final_logit_softcapping")
    return {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": scalar, "sliding_window": window or None, "layer_types": kinds,
            "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
            "final_logit_softcapping": float(softcap) if softcap else None, "attn_logit_softcapping": None}


def build_generation_config(meta: dict) -> dict:
    eos = meta.get("tokenizer.ggml.eos_token_id")
    extra = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    tokens = meta.get("tokenizer.ggml.tokens") or []
    extra += [tokens.index(t) for t in END_OF_TURN_TOKENS if t in tokens]
    eos_ids = [i for i in [eos, *extra] if i is not None]
    eos_ids = list(dict.fromkeys(eos_ids))
    gen = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
           "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None)}
    if "tokenizer.ggml.padding_token_id" in meta:
        gen["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
    return gen
