"""Wrappers of quant.cu: block-quantized weight matrices (kernels_cpu.quant's row tiles) on a GPU.

    w = upload(tiles, device)      # once, at load (minirun.quant.QuantMatrix.to)
    linear(w, x)                   # x [T, I] -> [T, rows]: T = 1 the GEMV, else dequantized slabs + torch's GEMM
    rows(w, ids)                   # the rows `ids` as float32 [n, I] (embedding lookups)

References: tests/support/references/quant.py (dequantize_ref, gemv_ref), compared in
tests/kernels/test_quant_cuda.py on the CPU emulator (and on a device when there is one).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels_cpu.quant import in_features

from . import _sources
from .launch import _backend, _cdiv, _i32, _torch

__all__ = ["upload", "cat_rows", "gemv", "linear", "rows"]

TILE = _sources.constant("quant.cu", "MR_QTILE")
_THREADS = _sources.constant("quant.cu", "MR_QGEMV_THREADS")
_ROWS_THREADS = 256
_KCHUNK = 8192                      # qgemv: the most columns a block takes (x in shared memory: 33 KiB)
_SLAB = 1 << 24                     # elements of a prefill's dequantized slab (32 MiB in bfloat16)
_PART_ORDER = {"Q8_0Tiles": "q8_0", "Q4_0Tiles": "q4_0", "Q4_1Tiles": "q4_1", "Q4_KTiles": "q4_k",
               "Q6_KTiles": "q6_k"}
# format -> (its GEMV kernel, its row kernel)
_KERNELS = {"q8_0": ("qgemv_q8_0", "qrows_q8_0"), "q4_0": ("qgemv_q4_0", "qrows_q4_0"),
            "q4_1": ("qgemv_q4_1", "qrows_q4_1"), "q4_k": ("qgemv_q4_k", "qrows_q4_k"),
            "q6_k": ("qgemv_q6_k", "qrows_q6_k")}


@dataclass
class CudaQuant:
    """A quantized matrix on the device: its parts (uint8 bytes, float16 scales as int16 bits), in
    the kernels' argument order; rows, cols I; fmt the kernels' suffix."""
    fmt: str
    parts: tuple
    rows: int
    cols: int

    @property
    def n_tiles(self) -> int:
        return self.parts[0].shape[0]


def upload(tiles, device) -> CudaQuant:
    """kernels_cpu.quant tiles (numpy) -> CudaQuant on `device` (the same bytes; int8 seen as uint8)."""
    torch = _torch()
    fmt = _PART_ORDER[type(tiles).__name__]
    if tiles[0].shape[2] != TILE:
        raise ValueError(f"upload: tiles of {tiles[0].shape[2]} rows, quant.cu reads {TILE}")
    parts = []
    for name in type(tiles)._fields:
        if name == "rows":
            continue
        a = np.ascontiguousarray(getattr(tiles, name))
        a = a.view(np.int16) if a.dtype == np.uint16 else a.view(np.uint8)
        parts.append(torch.from_numpy(a).to(device))
    return CudaQuant(fmt, tuple(parts), int(tiles.rows), in_features(tiles))


def cat_rows(ws: list) -> CudaQuant | None:
    """Matrices of one format stacked by rows (fused QKV, gate/up) without leaving the device: their
    tiles concatenated, possible when no matrix but the last has padding rows (None otherwise)."""
    if len({w.fmt for w in ws}) != 1 or any(w.rows % TILE for w in ws[:-1]):
        return None
    torch = _torch()
    parts = tuple(torch.cat([w.parts[k] for w in ws]) for k in range(len(ws[0].parts)))
    return CudaQuant(ws[0].fmt, parts, sum(w.rows for w in ws), ws[0].cols)


def gemv(w: CudaQuant, x):
    """x [I] float32 (contiguous, on w's device) -> W @ x [rows] float32."""
    torch = _torch()
    be = _backend()
    out = torch.zeros(w.rows, dtype=torch.float32, device=x.device)
    num_sms = be.device_info(x.device)[0] if x.is_cuda else 4
    # enough blocks for the GPU: split the columns when there are few tiles (a 576-row projection is
    # 9); a split is whole 32-column blocks, its x (and block sums) in shared memory: at most _KCHUNK
    n_split = max(1, min(_cdiv(w.cols, 256), _cdiv(4 * num_sms, w.n_tiles)), _cdiv(w.cols, _KCHUNK))
    kchunk = _cdiv(_cdiv(w.cols, n_split), 32) * 32
    with be.session(x.device) as L:
        L.launch("quant.cu", _KERNELS[w.fmt][0], (w.n_tiles, _cdiv(w.cols, kchunk)), (_THREADS,),
                 (*w.parts, _i32(w.cols), _i32(w.rows), x, _i32(kchunk), out), shared_mem=(kchunk + kchunk // 32) * 4)
    return out


def rows(w: CudaQuant, ids):
    """ids [n] int64 (each in [0, rows), on w's device) -> W[ids] float32 [n, I]."""
    torch = _torch()
    ids = ids.to(torch.int64).contiguous()
    n = ids.shape[0]
    out = torch.empty(n, w.cols, dtype=torch.float32, device=ids.device)
    if n:
        with _backend().session(ids.device) as L:
            L.launch("quant.cu", _KERNELS[w.fmt][1], (min(_cdiv(n * w.cols, _ROWS_THREADS), 65535),), (_ROWS_THREADS,),
                     (*w.parts, _i32(w.cols), ids, _i32(n), out))
    return out


def linear(w: CudaQuant, x):
    """x [T, I] -> x @ W^T [T, rows] in x's dtype: one token through gemv; a chunk through slabs of
    rows dequantized (in x's dtype) and torch's GEMM."""
    torch = _torch()
    if x.shape[0] == 1:
        return gemv(w, x[0].float().contiguous())[None].to(x.dtype)
    out = torch.empty(x.shape[0], w.rows, dtype=x.dtype, device=x.device)
    step = max(1, _SLAB // w.cols)
    for r0 in range(0, w.rows, step):
        r1 = min(w.rows, r0 + step)
        slab = rows(w, torch.arange(r0, r1, device=x.device)).to(x.dtype)
        out[:, r0:r1] = x @ slab.t()
    return out
