"""Checkpoint loading: safetensors (single file or sharded), memory-mapped, mapped to our names.

Every checkpoint tensor name is mapped in one place (`_layer_names`), so the model code never sees
Hugging Face names. A Gemma3ForConditionalGeneration checkpoint holds its language model under a
prefix (`TEXT_PREFIXES`) beside the vision tower's tensors: TensorReader shows the language model's
under the plain names and leaves the rest out.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .. import quant
from ..config import ModelArgs
from ..errors import CheckpointError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# where multimodal checkpoints keep the language model's "model." tensors (transformers 4.5x saves
# the first, transformers 5's module tree is the second) and its lm_head
TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
_TEXT_HEADS = ("language_model.lm_head.",)


def _layer_names(i: int, post_norms: bool = False) -> dict[str, str]:
    """Layer i's tensor names. With norms after attention and MLP (Gemma) post_attention_layernorm
    is the attention's post-norm and the MLP's input norm is pre_feedforward_layernorm."""
    p = f"model.layers.{i}."
    names = {
        "attn_norm": p + "input_layernorm.weight",
        "wq": p + "self_attn.q_proj.weight",
        "wk": p + "self_attn.k_proj.weight",
        "wv": p + "self_attn.v_proj.weight",
        "wo": p + "self_attn.o_proj.weight",
        "ffn_norm": p + "post_attention_layernorm.weight",
        "w_gate": p + "mlp.gate_proj.weight",
        "w_up": p + "mlp.up_proj.weight",
        "w_down": p + "mlp.down_proj.weight",
    }
    if post_norms:
        names |= {"ffn_norm": p + "pre_feedforward_layernorm.weight", "post_attn_norm": p + "post_attention_layernorm.weight",
                  "post_ffn_norm": p + "post_feedforward_layernorm.weight"}
    return names


def _safetensors_files(model_dir: Path) -> dict[str, Path]:
    """Map tensor name -> file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is corrupt ({e})") from None
        return {k: model_dir / v for k, v in weight_map.items()}
    single = model_dir / "model.safetensors"
    if single.is_file():
        return {}  # resolved lazily: every name lives in the single file
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {model_dir}")
    if len(files) == 1:
        return {}
    raise CheckpointError(f"{model_dir} has several .safetensors files but no model.safetensors.index.json")


def _config_json(model_dir: Path) -> dict:
    """config.json as a dict (ModelArgs has read and checked it already)."""
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _text_model_names(stored: set[str]) -> dict[str, str] | None:
    """{plain name ("model.layers.0..."): stored name} for a checkpoint whose language model sits
    under one of TEXT_PREFIXES (the other tensors, a vision tower's, left out); None for a plain one."""
    if any(n.startswith("model.embed_tokens.") for n in stored):
        return None
    prefix = next((p for p in TEXT_PREFIXES if any(n.startswith(p + "embed_tokens.") for n in stored)), None)
    if prefix is None:
        return None
    names = {"model." + n[len(prefix):]: n for n in stored if n.startswith(prefix)}
    for head in _TEXT_HEADS:
        names |= {"lm_head." + n[len(head):]: n for n in stored if n.startswith(head)}
    return names


class TensorReader:
    """Reads named tensors from one model directory, opening each shard once (memory-mapped)."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.name_to_file = _safetensors_files(model_dir)
        self._default = (model_dir / "model.safetensors") if (model_dir / "model.safetensors").is_file() \
            else next(iter(sorted(model_dir.glob("*.safetensors"))), None)
        self._handles: dict[Path, object] = {}
        self._stored = _text_model_names(self._stored_names())   # (None: names as stored)

    def _handle(self, path: Path):
        if path not in self._handles:
            if not path.is_file():
                raise CheckpointError(f"missing weight file {path}")
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{path.name} is not a valid safetensors file ({e})") from None
        return self._handles[path]

    def _stored_names(self) -> set[str]:
        if self.name_to_file:
            return set(self.name_to_file)
        return set(self._handle(self._default).keys())

    def names(self) -> set[str]:
        """The tensors' names, a multimodal checkpoint's language model's as a plain one's."""
        return set(self._stored) if self._stored is not None else self._stored_names()

    def get(self, name: str) -> torch.Tensor:
        if self._stored is not None:
            name = self._stored.get(name, name)
        path = self.name_to_file.get(name, self._default)
        h = self._handle(path)
        try:
            return h.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"cannot read tensor {name} from {path.name} ({e})") from None


def load_weights(model_dir: str | Path, args: ModelArgs, dtype: torch.dtype, device: torch.device,
                 weights: str = "stored") -> dict:
    """Load every tensor the model needs, converted to `dtype` on `device`.

    Returns {"embed": [V, D], "norm": [D], "lm_head": [V, D] (shared with embed when tied),
             "layers": [ {attn_norm, wqkv [(Hq+2Hkv)*hd, D], wo, ffn_norm, w_gate_up [2F, D], w_down,
                          and where the architecture has them bqkv, bo, q_norm, k_norm [hd],
                          post_attn_norm, post_ffn_norm} ]}; norms with the architecture's offset added.
    Q, K and V (and gate and up) are fused so one GEMM serves each. The matrices are
    minirun.quant.QuantMatrix where the checkpoint stores GGUF blocks or `weights` quantizes
    ("q8_0", "q4_0", "q4_1"; "float": blocks dequantized to `dtype`; "stored": as the checkpoint holds them).
    """
    model_dir = Path(model_dir)
    reader = TensorReader(model_dir)
    available = reader.names()
    src = _Source(reader, available, quant.matrix_reader(reader, available, _config_json(model_dir), weights, dtype,
                                                          device), args.norm_offset, dtype, device)
    D, V = args.hidden_size, args.vocab_size
    embed = src.matrix("model.embed_tokens.weight", (V, D))
    has_head = "lm_head.weight" in available or "lm_head.weight.d" in available     # (.d: stored as blocks)
    if args.tie_word_embeddings or not has_head:
        lm_head = embed
    else:
        lm_head = src.matrix("lm_head.weight", (V, D))
    layers = [_layer(src, args, i) for i in range(args.num_hidden_layers)]
    return {"embed": embed, "norm": src.norm("model.norm.weight", D), "lm_head": lm_head, "layers": layers}


class _Source:
    """The checkpoint's tensors as the model holds them: on the device in the compute dtype, the
    matrices quantized where the checkpoint or `weights` says (quantized: quant.matrix_reader's),
    the norms with the architecture's offset folded in."""

    def __init__(self, reader, available: set, quantized, norm_offset: float, dtype, device):
        self.reader, self.available, self.quantized = reader, available, quantized
        self.norm_offset, self.dtype, self.device = norm_offset, dtype, device

    def raw(self, name: str) -> torch.Tensor:
        """The tensor as stored."""
        if name not in self.available:
            raise CheckpointError(f"checkpoint lacks tensor {name}")
        return self.reader.get(name)

    def get(self, name: str) -> torch.Tensor:
        return self.raw(name).to(device=self.device, dtype=self.dtype)

    def check(self, t: torch.Tensor, shape: tuple, name: str) -> torch.Tensor:
        if tuple(t.shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {tuple(t.shape)}, config.json implies {shape}")
        return t

    def matrix(self, name: str, shape: tuple):
        if self.quantized is not None:
            return self.quantized(name, shape)
        return self.check(self.get(name), shape, name)

    def norm(self, name: str, n: int) -> torch.Tensor:
        """A norm's weights [n] as the model multiplies by them: (offset + w), summed in float32."""
        w = self.check(self.raw(name), (n,), name)
        return (w.float() + self.norm_offset).to(device=self.device, dtype=self.dtype)


def _layer(src: _Source, args: ModelArgs, i: int) -> dict:
    """Layer i's weights (load_weights' layout)."""
    D, hd, F = args.hidden_size, args.head_dim, args.intermediate_size
    Hq, Hkv = args.num_attention_heads, args.num_key_value_heads
    n = _layer_names(i, args.post_norms)
    wq, wk, wv = src.matrix(n["wq"], (Hq * hd, D)), src.matrix(n["wk"], (Hkv * hd, D)), src.matrix(n["wv"], (Hkv * hd, D))
    wg, wu = src.matrix(n["w_gate"], (F, D)), src.matrix(n["w_up"], (F, D))
    layer = {"attn_norm": src.norm(n["attn_norm"], D), "wqkv": quant.cat_rows([wq, wk, wv]),
             "wo": src.matrix(n["wo"], (D, Hq * hd)), "ffn_norm": src.norm(n["ffn_norm"], D),
             "w_gate_up": quant.cat_rows([wg, wu]), "w_down": src.matrix(n["w_down"], (D, F))}
    p = f"model.layers.{i}.self_attn."
    if args.attention_bias:
        layer["bqkv"] = torch.cat([src.get(p + "q_proj.bias"), src.get(p + "k_proj.bias"), src.get(p + "v_proj.bias")])
        layer["bo"] = src.get(p + "o_proj.bias") if p + "o_proj.bias" in src.available else None
    if args.qk_norm:
        layer["q_norm"], layer["k_norm"] = src.norm(p + "q_norm.weight", hd), src.norm(p + "k_norm.weight", hd)
    if args.post_norms:
        layer["post_attn_norm"], layer["post_ffn_norm"] = src.norm(n["post_attn_norm"], D), src.norm(n["post_ffn_norm"], D)
    return layer
