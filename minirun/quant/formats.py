"""The GGUF block formats minirun computes with, and their blocks split into named parts.

A GGUF tensor of a block format is, per row, a run of blocks of `type_size` bytes, each holding
`block` weights (ggml-quants.c). On disk (`minirun convert`'s safetensors) and in memory the
blocks are split into their parts -- codes, scales, mins -- each a row-major array [rows, k]
(`to_planes` / `from_planes`, exact inverses, byte for byte). The kernels then take the planes
(kernels_cpu.quant.tiles_from_planes; Q4_K's packed 6-bit scales unpacked to bytes first,
`kernel_planes`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import CheckpointError


@dataclass(frozen=True)
class BlockFormat:
    name: str                     # GGUF's name: "Q8_0", ...
    block: int                    # weights per block
    type_size: int                # bytes per block
    parts: tuple                  # (part, byte offset in the block, bytes, dtype), in block order

    def bytes_for(self, n_weights: int) -> int:
        return n_weights // self.block * self.type_size


FORMATS = {f.name: f for f in (
    BlockFormat("Q8_0", 32, 34, (("d", 0, 2, np.float16), ("qs", 2, 32, np.int8))),
    BlockFormat("Q4_0", 32, 18, (("d", 0, 2, np.float16), ("qs", 2, 16, np.uint8))),
    BlockFormat("Q4_1", 32, 20, (("d", 0, 2, np.float16), ("m", 2, 2, np.float16), ("qs", 4, 16, np.uint8))),
    BlockFormat("Q4_K", 256, 144, (("d", 0, 2, np.float16), ("dmin", 2, 2, np.float16),
                                   ("scales", 4, 12, np.uint8), ("qs", 16, 128, np.uint8))),
    BlockFormat("Q6_K", 256, 210, (("ql", 0, 128, np.uint8), ("qh", 128, 64, np.uint8),
                                   ("scales", 192, 16, np.int8), ("d", 208, 2, np.float16))),
)}


def block_format(name: str) -> BlockFormat:
    f = FORMATS.get(str(name).upper())
    if f is None:
        raise CheckpointError(f"unsupported quantization format {name!r} (supported: {', '.join(FORMATS)})")
    return f


def to_planes(fmt: BlockFormat, blocks: np.ndarray, cols: int) -> dict:
    """GGUF blocks as bytes [rows, cols / block * type_size] -> part name -> array [rows, k]."""
    if cols % fmt.block:
        raise CheckpointError(f"{fmt.name}: {cols} columns are not a multiple of the block of {fmt.block}")
    rows = blocks.shape[0]
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows, cols // fmt.block, fmt.type_size)
    return {name: np.ascontiguousarray(b[:, :, off:off + n]).view(dt).reshape(rows, -1)
            for name, off, n, dt in fmt.parts}


def from_planes(fmt: BlockFormat, planes: dict) -> np.ndarray:
    """The inverse of to_planes: the blocks as bytes [rows, n_blocks * type_size]."""
    first = planes[fmt.parts[0][0]]
    rows = first.shape[0]
    n_blocks = first.reshape(rows, -1).view(np.uint8).shape[1] // fmt.parts[0][2]
    out = np.empty((rows, n_blocks, fmt.type_size), np.uint8)
    for name, off, n, dt in fmt.parts:
        p = np.ascontiguousarray(planes[name])
        if p.dtype != np.dtype(dt) and not (dt is np.float16 and p.dtype == np.uint16):
            raise CheckpointError(f"{fmt.name} part {name} has dtype {p.dtype}, expected {np.dtype(dt)}")
        out[:, :, off:off + n] = p.view(np.uint8).reshape(rows, n_blocks, n)
    return out.reshape(rows, -1)


def kernel_planes(fmt: BlockFormat, planes: dict) -> dict:
    """The planes as kernels_cpu.quant's tiles want them: Q4_K's 12 packed bytes of 6-bit scales and
    mins per super-block -> sc, mn bytes [rows, I/32] (gguf's own unpacking); Q6_K's scales named sc."""
    if fmt.name == "Q6_K":
        return {"ql": planes["ql"], "qh": planes["qh"], "sc": planes["scales"], "d": planes["d"]}
    if fmt.name != "Q4_K":
        return planes
    from gguf.quants import Q4_K

    rows = planes["scales"].shape[0]
    sc, mn = Q4_K.get_scale_min(planes["scales"].reshape(-1, 12))
    return {"qs": planes["qs"], "d": planes["d"], "dmin": planes["dmin"],
            "sc": np.ascontiguousarray(sc, np.uint8).reshape(rows, -1),
            "mn": np.ascontiguousarray(mn, np.uint8).reshape(rows, -1)}


def quantize(w: np.ndarray, name: str) -> np.ndarray:
    """A float matrix [rows, cols] -> GGUF blocks as bytes (gguf.quants; Q8_0, Q4_0, Q4_1 only:
    the gguf package quantizes no K formats)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    if name not in ("Q8_0", "Q4_0", "Q4_1"):
        raise CheckpointError(f"cannot quantize to {name} at load (choose Q8_0, Q4_0 or Q4_1)")
    return gguf_quantize(np.ascontiguousarray(w, np.float32), GGMLQuantizationType[name])


def dequantize_blocks(blocks: np.ndarray, name: str, cols: int) -> np.ndarray:
    """GGUF blocks [rows, bytes] -> float32 [rows, cols] by gguf.quants (the reference)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    return gguf_dequantize(np.ascontiguousarray(blocks, np.uint8), GGMLQuantizationType[name]).reshape(-1, cols)
