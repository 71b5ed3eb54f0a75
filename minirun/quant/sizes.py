"""The bytes a checkpoint's weights take as stored: float tensors at the run's dtype, quantized ones
at their block format's size (the GGUF's bytes; `minirun plan` and `bench` report this)."""
from __future__ import annotations

from .checkpoint import weights_formats
from .formats import FORMATS


def matrix_shapes(args) -> dict:
    """{checkpoint name: (rows, cols)} of every weight matrix (embedding, LM head when untied, layers)."""
    D, F, hd = args.hidden_size, args.intermediate_size, args.head_dim
    Hq, Hkv, V = args.num_attention_heads, args.num_key_value_heads, args.vocab_size
    shapes = {"model.embed_tokens.weight": (V, D)}
    if not args.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    per_layer = {"self_attn.q_proj": (Hq * hd, D), "self_attn.k_proj": (Hkv * hd, D), "self_attn.v_proj": (Hkv * hd, D),
                 "self_attn.o_proj": (D, Hq * hd), "mlp.gate_proj": (F, D), "mlp.up_proj": (F, D), "mlp.down_proj": (D, F)}
    for i in range(args.num_hidden_layers):
        for k, s in per_layer.items():
            shapes[f"model.layers.{i}.{k}.weight"] = s
    return shapes


def weight_format(args, weights: str, name: str) -> str | None:
    """The block format tensor `name` is held in with --weights `weights` (None: a float tensor)."""
    if weights == "float":
        return None
    if weights != "stored":
        return weights_formats(weights, name)
    return ((args.quantization_config or {}).get("tensor_formats") or {}).get(name)


def weight_bytes(args, n_params: int, float_bytes: int, weights: str = "stored") -> int:
    """Bytes of all n_params weights: quantized matrices at their format's size, the rest (norms,
    float matrices) at float_bytes each."""
    total, quantized = 0, 0
    for name, (rows, cols) in matrix_shapes(args).items():
        fmt = weight_format(args, weights, name)
        if fmt is not None:
            total += FORMATS[fmt].bytes_for(rows * cols)
            quantized += rows * cols
    return total + (n_params - quantized) * float_bytes


def weights_label(args, weights: str, dtype: str) -> str:
    """How the weights are held, for tables: the dtype for float weights, else the block format of
    most of them ("Q4_1")."""
    if weights not in ("stored", "float"):
        return weights.upper()
    if weights == "float" or not args.quantization_config:
        return dtype
    return args.quantization_config.get("format") or dtype
