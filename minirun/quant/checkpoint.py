"""Quantized weights in an HF-layout directory: how they are named, described and read.

A checkpoint whose config.json carries

    "quantization_config": {"quant_method": "gguf", "format": "Q4_1",
                            "tensor_formats": {"model.layers.0.self_attn.q_proj.weight": "Q4_1", ...}}

stores each listed tensor NAME as its GGUF blocks' parts, `NAME.<part>` (formats.BlockFormat.parts:
codes `qs`, scales `d`, ...), each a row-major safetensors tensor [rows, k]; every other tensor is
a float tensor as usual. `format` is the format of most of the weights, for display.

`matrix_reader` is what loader.load_weights asks for a weight matrix: the stored blocks, or the
float tensor quantized at load (`--weights q8_0|q4_0|q4_1`), or the blocks dequantized (`--weights float`).
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from ..config import WEIGHTS
from ..errors import CheckpointError
from .formats import FORMATS, block_format, dequantize_blocks, from_planes, quantize, to_planes
from .matrix import QuantMatrix

QUANT_METHOD = "gguf"
# --weights FORMAT quantizes the layers' matrices to FORMAT and the embedding / LM head to Q8_0 (the
# token embedding's rows are read one by one and the LM head decides every token: llama-quantize,
# too, keeps them at a higher precision than the layers)
_EMBED_FORMAT = "Q8_0"
_EMBEDDING_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


def quantization_config(tensor_formats: dict) -> dict:
    """config.json's quantization_config for the quantized tensors {name: format}."""
    by_count = Counter(tensor_formats.values())
    return {"quant_method": QUANT_METHOD, "format": by_count.most_common(1)[0][0] if by_count else None,
            "tensor_formats": dict(sorted(tensor_formats.items()))}


def stored_formats(config: dict) -> dict:
    """{tensor name: format} of a config.json dict (empty for a float checkpoint)."""
    qc = config.get("quantization_config")
    if not qc:
        return {}
    if qc.get("quant_method") != QUANT_METHOD:
        raise CheckpointError(f"config.json: quantization_config quant_method {qc.get('quant_method')!r} is not "
                              f"supported (minirun reads {QUANT_METHOD!r}, written by `minirun convert`)")
    formats = qc.get("tensor_formats") or {}
    for name, fmt in formats.items():
        block_format(fmt)
    return dict(formats)


def part_names(name: str, fmt: str) -> list[str]:
    return [f"{name}.{p[0]}" for p in block_format(fmt).parts]


def planes_for_file(name: str, fmt: str, blocks: np.ndarray, cols: int) -> dict:
    """{safetensors name: array} for one tensor's GGUF blocks (what `minirun convert` writes)."""
    f = block_format(fmt)
    return {f"{name}.{k}": v for k, v in to_planes(f, blocks, cols).items()}


def kept_blocks(t):
    """A gguf.GGUFReader tensor of a block format minirun computes with -> (format, its blocks
    [rows, bytes] as uint8, cols); None for float tensors and other formats (dequantized instead).
    Q5_0 (llama-quantize's Q4_K for widths not a multiple of 256) becomes Q8_0 losslessly."""
    kept = kept_format(t)
    if kept is None:
        return None
    cols = int(t.shape[0])                      # GGUF's ne order: columns first
    blocks = np.asarray(t.data).reshape(int(t.shape[1]), -1)
    return kept[0], q5_0_as_q8_0(blocks) if t.tensor_type.name == "Q5_0" else blocks, cols


def kept_format(t) -> tuple[str, int] | None:
    """(format, bytes) of kept_blocks(t) without making the blocks; None where that is None."""
    name = t.tensor_type.name
    if name not in FORMATS and name != "Q5_0" or len(t.shape) != 2:
        return None
    return ("Q8_0", int(t.n_bytes) // 22 * 34) if name == "Q5_0" else (name, int(t.n_bytes))


def q5_0_as_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 blocks [rows, 22 n] (float16 d, 32 high bits, 16 bytes of low nibbles: element k low,
    16 + k high) -> Q8_0 blocks [rows, 34 n] of the same values: d kept, codes q - 16 as int8."""
    b = blocks.reshape(-1, 22)
    qh = b[:, 2:6].copy().view("<u4")                                    # [n, 1]: bit e is element e's
    lo = np.concatenate([b[:, 6:] & 15, b[:, 6:] >> 4], axis=1)          # [n, 32]
    hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    q = ((lo | hi).astype(np.int16) - 16).astype(np.int8).view(np.uint8)
    return np.concatenate([b[:, :2], q], axis=1).reshape(blocks.shape[0], -1)


def weights_formats(weights: str, name: str) -> str | None:
    """The format --weights gives tensor `name` (None: stays float)."""
    if weights in ("stored", "float"):
        return None
    return _EMBED_FORMAT if name in _EMBEDDING_NAMES else weights.upper()


def matrix_reader(reader, available: set, config: dict, weights: str, dtype: torch.dtype, device: torch.device):
    """A function (name, shape) -> the weight matrix [rows, cols]: a QuantMatrix where the checkpoint
    stores blocks (or --weights quantizes), else a float tensor of `dtype` on `device`; None when
    the checkpoint is float and stays so (the loader's own path).

    reader: loader.TensorReader; available: its tensor names; config: config.json as a dict.
    """
    if weights not in WEIGHTS:
        raise CheckpointError(f"unknown --weights {weights!r}: use {', '.join(WEIGHTS)}")
    stored = stored_formats(config)
    if not stored and weights in ("stored", "float"):
        return None
    if stored and weights not in ("stored", "float"):
        raise CheckpointError(f"--weights {weights} quantizes a float checkpoint; this one is stored as "
                              f"{config['quantization_config'].get('format')} already (use --weights stored or float)")

    def read(name: str) -> torch.Tensor:
        if name not in available:
            raise CheckpointError(f"checkpoint lacks tensor {name}")
        return reader.get(name)

    def matrix(name: str, shape: tuple):
        rows, cols = shape
        fmt = stored.get(name)
        if fmt is not None:
            f = block_format(fmt)
            planes = {p: read(f"{name}.{p}").numpy() for p, *_ in f.parts}
            want = f.bytes_for(rows * cols)
            got = sum(p.nbytes for p in planes.values())
            if any(p.shape[0] != rows for p in planes.values()) or got != want or cols % f.block:
                raise CheckpointError(f"tensor {name} ({fmt}) holds {got} bytes in rows of "
                                      f"{[p.shape for p in planes.values()]}, config.json implies [{rows}, {cols}]")
            if weights == "float":
                w = dequantize_blocks(from_planes(f, planes), fmt, cols)
                return torch.from_numpy(w).to(device=device, dtype=dtype)
            return QuantMatrix.from_planes(f, planes, cols, dtype, device)
        t = read(name)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name} has shape {tuple(t.shape)}, config.json implies {tuple(shape)}")
        target = weights_formats(weights, name)
        if target is None:
            return t.to(device=device, dtype=dtype)
        if cols % FORMATS[target].block:
            raise CheckpointError(f"--weights {weights}: tensor {name} has {cols} columns, not a multiple of "
                                  f"{target}'s block of {FORMATS[target].block}")
        return QuantMatrix.from_blocks(target, quantize(t.float().numpy(), target), cols, dtype, device)

    return matrix
