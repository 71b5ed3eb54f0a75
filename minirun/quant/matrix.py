"""A block-quantized weight matrix as the model uses it: `linear`, `embedding`, `dequantize`.

The model's layer loop takes a QuantMatrix wherever it takes a float weight tensor (ops.linear,
ops.embed, the CPU's fused one-token kernels through `kernel_view`). The blocks are repacked once,
at load, into kernels_cpu.quant's row tiles (kernels_cuda.quant reads the same tiles on a GPU):

- up to ROWS_MAX tokens (a decode step, a short prompt): the integer GEMV of kernels_cpu.quant on
  the T rows, reading the codes and scales as stored, once for all T (dequantizing every weight
  costs more than the products of a few rows; ROWS_MAX sits below the chunk size at which the
  dequantized GEMM overtakes the GEMV on a 2-core AVX2 CPU);
- a longer chunk of tokens (prefill): rows dequantized a slab at a time into one shared scratch buffer,
  then torch's GEMM (in bfloat16 where the CPU has a native one: PREFILL_BF16, else float32), so a
  prompt runs at the float GEMM's speed and nothing float stays resident.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kernels_cpu import quant as kq, quant_rows as kr

from .. import hugepages
from .formats import BlockFormat, block_format, kernel_planes, to_planes

ROWS_MAX = 64                    # tokens of a chunk that take the integer GEMV instead of a dequantized GEMM
_SLAB = 1 << 22                  # elements dequantized per GEMM in a prefill (16 MiB of float32)
_scratch: dict = {}

#: Prefill GEMMs in bfloat16 where torch's bfloat16 GEMM is native (ops.cpu_bf16_gemm): 2-3x the
#: float32 GEMM's speed on Zen 4, for weights and activations rounded to bfloat16 (2^-9 relative;
#: llama.cpp's prefill on Q8_0 rounds activations to 8 bits). False: float32, the same logits as the
#: dequantized weights to 1e-3 (tests/model/test_quant_model.py holds both).
PREFILL_BF16 = True


def _slab(n: int, dtype: torch.dtype) -> torch.Tensor:
    """The shared prefill scratch, at least n elements (one engine runs one forward at a time)."""
    if dtype not in _scratch or _scratch[dtype].numel() < n:
        _scratch[dtype] = torch.empty(n, dtype=dtype)
    return _scratch[dtype][:n]


def prefill_dtype(x: torch.Tensor) -> torch.dtype:
    """The GEMM dtype of a prefill chunk x on the CPU."""
    from ..model.ops import cpu_bf16_gemm
    return torch.bfloat16 if (PREFILL_BF16 or x.dtype == torch.bfloat16) and cpu_bf16_gemm() else torch.float32


class QuantMatrix:
    """A weight [rows, cols] in one GGUF block format, on the CPU (numpy tiles) or a CUDA device.

    dtype: what `linear` and `embedding` return (the model's activation dtype).
    """

    def __init__(self, fmt: BlockFormat, tiles, cols: int, dtype: torch.dtype, device: torch.device,
                 rows: int | None = None):
        self.fmt, self.tiles, self.cols, self.dtype, self.device = fmt, tiles, cols, dtype, device
        self.shape = (tiles.rows if rows is None else rows, cols)
        self.cuda = None                              # kernels_cuda.quant's view, on a GPU

    @classmethod
    def from_planes(cls, fmt: str | BlockFormat, planes: dict, cols: int, dtype: torch.dtype,
                    device: torch.device) -> "QuantMatrix":
        """planes: the GGUF blocks' parts, row-major (formats.to_planes)."""
        fmt = block_format(fmt) if isinstance(fmt, str) else fmt
        m = cls(fmt, kq.tiles_from_planes(fmt.name, kernel_planes(fmt, planes)), cols, dtype, torch.device("cpu"))
        return m.to(device)

    @classmethod
    def from_blocks(cls, fmt: str, blocks: np.ndarray, cols: int, dtype: torch.dtype,
                    device: torch.device) -> "QuantMatrix":
        """blocks: GGUF's bytes [rows, cols / block * type_size]."""
        f = block_format(fmt)
        return cls.from_planes(f, to_planes(f, blocks, cols), cols, dtype, device)

    def to(self, device: torch.device, gpu_kernels: bool | None = None) -> "QuantMatrix":
        """On a CUDA device (or with gpu_kernels, on any device: the tests' emulator) the tiles move to
        the device for kernels_cuda.quant and the host copy is dropped."""
        if gpu_kernels or (gpu_kernels is None and device.type == "cuda"):
            from kernels_cuda import quant as kcq
            self.cuda = kcq.upload(self.tiles, device)
            self.tiles = None
        self.device = device
        return self

    @property
    def nbytes(self) -> int:
        """Bytes the matrix holds (its tiles' parts, padding rows included)."""
        if self.cuda is not None:
            return sum(p.numel() * p.element_size() for p in self.cuda.parts)
        return sum(getattr(self.tiles, f).nbytes for f in type(self.tiles)._fields if f != "rows")

    def kernel_view(self):
        """The tiles kernels_cpu's fused decode kernels take in place of a float matrix."""
        return self.tiles

    def on_hugepages(self) -> "QuantMatrix":
        """The same matrix with its parts copied onto huge pages (minirun.hugepages; CPU)."""
        if self.device.type != "cpu":
            return self
        parts = {}
        for f in type(self.tiles)._fields:
            a = getattr(self.tiles, f)
            parts[f] = a if f == "rows" else hugepages.clone(torch.from_numpy(a)).numpy()
        return QuantMatrix(self.fmt, type(self.tiles)(**parts), self.cols, self.dtype, self.device)

    # ---- what the layer loop calls ---------------------------------------------------------------
    def linear(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, cols] -> x @ W^T (+ b) [T, rows] in x's dtype."""
        if self.cuda is not None:
            from kernels_cuda import quant as kcq
            y = kcq.linear(self.cuda, x)
        elif x.shape[0] <= ROWS_MAX:
            y = torch.from_numpy(kq.gemv(self.tiles, x.float().numpy())).to(x.dtype)
        else:
            dt = prefill_dtype(x)
            y = self._prefill(x.to(dt)).to(x.dtype)
        return y if b is None else y + b

    def _prefill(self, xg: torch.Tensor) -> torch.Tensor:
        """xg [T, cols] float32 or bfloat16 -> [T, rows] in its dtype: the weights dequantized to
        that dtype a slab of rows at a time."""
        rows, cols = self.shape
        out = torch.empty(xg.shape[0], rows, dtype=xg.dtype)
        step = max(1, _SLAB // cols)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            w = _slab((r1 - r0) * cols, xg.dtype).view(r1 - r0, cols)
            wn = w.numpy() if xg.dtype == torch.float32 else w.view(torch.int16).numpy().view(np.uint16)
            kr.dequantize_rows(self.tiles, r0, r1, wn)
            if r0 == 0 and r1 == rows:
                torch.mm(xg, w.t(), out=out)
            else:
                out[:, r0:r1] = xg @ w.t()
        return out

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 -> rows [T, cols] in the matrix's dtype (the token embedding)."""
        if self.cuda is not None:
            from kernels_cuda import quant as kcq
            return kcq.rows(self.cuda, ids).to(self.dtype)
        return torch.from_numpy(kr.dequantize_ids(self.tiles, ids.cpu().numpy())).to(self.dtype)

    def dequantize(self) -> torch.Tensor:
        """The whole matrix as float32 [rows, cols] (on its device)."""
        if self.cuda is not None:
            from kernels_cuda import quant as kcq
            return kcq.rows(self.cuda, torch.arange(self.shape[0], device=self.cuda.parts[0].device))
        return torch.from_numpy(kr.dequantize_rows(self.tiles, 0, self.shape[0]))

    def __repr__(self) -> str:
        return f"QuantMatrix({self.fmt.name}, {self.shape[0]}x{self.shape[1]}, {self.device})"


class RowStack:
    """Matrices of different formats stacked by rows (a Q4_K_M file's Q4_K Q, K beside a Q6_K V; a
    float matrix where the file's format is one minirun dequantizes): `linear` concatenates their
    outputs. The CPU's fused decode kernels take one matrix, so a layer holding one runs its
    one-token steps through `linear`. parts: QuantMatrix or float tensors."""

    def __init__(self, parts: list):
        self.parts = parts
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        self.device = parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() if isinstance(p, torch.Tensor) else p.nbytes for p in self.parts)

    def linear(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.cat([F.linear(x, p) if isinstance(p, torch.Tensor) else p.linear(x) for p in self.parts], dim=-1)
        return y if b is None else y + b

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.float() if isinstance(p, torch.Tensor) else p.dequantize() for p in self.parts])

    def on_hugepages(self) -> "RowStack":
        return RowStack([hugepages.clone(p) if isinstance(p, torch.Tensor) else p.on_hugepages() for p in self.parts])


def cat_rows(mats: list):
    """Weights stacked by rows (QKV, gate/up): float tensors -> torch.cat; quantized ones of one
    format -> one QuantMatrix; of several formats, or float and quantized -> a RowStack."""
    if all(isinstance(m, torch.Tensor) for m in mats):
        return torch.cat(mats, 0).contiguous()
    first = mats[0]
    if any(isinstance(m, torch.Tensor) for m in mats) or len({m.fmt.name for m in mats}) > 1:
        return RowStack(mats)
    if first.cuda is not None:                      # on a GPU: the tiles concatenate when none is padded
        from kernels_cuda import quant as kcq
        cat = kcq.cat_rows([m.cuda for m in mats])
        if cat is None:
            return RowStack(mats)
        m = QuantMatrix(first.fmt, None, first.cols, first.dtype, first.device, rows=cat.rows)
        m.cuda = cat
        return m
    tiles = kq.cat_rows([m.tiles for m in mats])
    return QuantMatrix(first.fmt, tiles, first.cols, first.dtype, first.device)


def is_quantized(w) -> bool:
    return isinstance(w, (QuantMatrix, RowStack))
