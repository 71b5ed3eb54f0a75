"""kernels_cuda/quant.cu (block-quantized GEMV and row dequantization) against the NumPy reference
(tests/support/references/quant.py, itself held to gguf.quants in test_quant_kernels.py), on the CPU
emulator and, with a GPU, on the device; and a model's steps through them against the CPU kernels.

Tolerance: float32 summation order only (the GEMV adds 4 column groups and the K splits by
atomicAdd): 1e-5 of the row's sum of |w x|."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import kernels_cuda
from cuda_checks import Env
from kernels_cpu import quant as kq
from references.quant import dequantize_ref, gemv_ref
from kernels_cuda import quant as kcq
from minirun.quant.formats import FORMATS, kernel_planes, to_planes
from shared import random_blocks

emu_only = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (CPU kernel emulator)")
gpu_only = pytest.mark.skipif(not kernels_cuda.available(), reason="no CUDA device / cupy")


def tiles(fmt, rows, cols, seed):
    rng = np.random.default_rng(seed)
    f = FORMATS[fmt]
    return kq.tiles_from_planes(fmt, kernel_planes(f, to_planes(f, random_blocks(rng, fmt, rows, cols), cols)))


def check_format(env, fmt, rows=70, cols=512, seed=0):
    w = tiles(fmt, rows, cols, seed)
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    ids = np.array([rows - 1, 0, 64, 5])
    with env.ctx():
        cw = kcq.upload(w, env.device)
        y = kcq.gemv(cw, env.t(x[0]))
        r = kcq.rows(cw, env.t(ids))
        yl = kcq.linear(cw, env.t(x))                          # T > 1: dequantized slab and torch's GEMM
    ref = dequantize_ref(w)
    np.testing.assert_allclose(r.cpu().numpy(), ref[ids], rtol=1e-6, atol=1e-7)
    bound = np.abs(ref) @ np.abs(x.T)                            # [rows, 3]
    got = y.cpu().numpy()
    assert got.shape == (rows,) and np.all(np.abs(got - gemv_ref(w, x[0])) <= 1e-5 * bound[:, 0] + 1e-6)
    want = np.stack([gemv_ref(w, xi) for xi in x])
    assert np.all(np.abs(yl.cpu().numpy() - want) <= 1e-5 * bound.T + 1e-6)


@emu_only
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_emu_quant_kernels(fmt):
    check_format(Env("emu", order="random"), fmt)


@emu_only
@pytest.mark.parametrize("fmt,rows,cols", [("Q4_1", 130, 800), ("Q4_K", 65, 1536), ("Q8_0", 70, 96)])
def test_emu_quant_gemv_splits(fmt, rows, cols):
    """Column ranges of whole 32-column blocks, uneven over the 4 column groups, a short last range."""
    check_format(Env("emu", order="random"), fmt, rows=rows, cols=cols, seed=3)


@emu_only
def test_emu_cat_rows():
    env = Env("emu")
    a, b = tiles("Q4_1", 64, 256, 1), tiles("Q4_1", 40, 256, 2)
    assert kcq.cat_rows([kcq.upload(b, env.device), kcq.upload(a, env.device)]) is None      # b is padded
    cat = kcq.cat_rows([kcq.upload(a, env.device), kcq.upload(b, env.device)])
    x = np.random.default_rng(3).standard_normal(256).astype(np.float32)
    with env.ctx():
        y = kcq.gemv(cat, env.t(x)).numpy()
    want = np.concatenate([gemv_ref(a, x), gemv_ref(b, x)])
    assert cat.rows == 104 and np.allclose(y, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@emu_only
def test_emu_model_steps_through_quant_kernels(tiny_model_dir, float32_quant_prefill):
    """A model whose quantized matrices run on quant.cu (forced onto the CPU: the emulator) against the
    same model on the CPU kernels: logits of a prefill and of decode steps."""
    import cuda_emu
    from minirun import Engine
    from minirun.quant import QuantMatrix
    d = tiny_model_dir("gqa-untied")
    ids = list(range(5, 25))
    ref = Engine.load(d, device="cpu", ctx=64, weights="q8_0")
    eng = Engine.load(d, device="cpu", ctx=64, weights="q8_0")
    w = eng.model.w
    for m in {id(v): v for lw in w["layers"] for v in lw.values() if isinstance(v, QuantMatrix)}.values():
        m.to(torch.device("cpu"), gpu_kernels=True)
    for m in {id(w["embed"]): w["embed"], id(w["lm_head"]): w["lm_head"]}.values():
        m.to(torch.device("cpu"), gpu_kernels=True)
    assert eng.model.use_cuda_layer_kernels(force=True)
    with cuda_emu.emulated() as be:
        lq = eng.logits(ids[:8])
        eng.reset()
        eng.prefill(ids[:8])
        sq = torch.cat([eng.step(t) for t in ids[8:12]])
    assert {"qgemv_q8_0", "qrows_q8_0"} <= {x[0] for x in be.launches}
    lr = ref.logits(ids[:8])
    ref.reset()
    ref.prefill(ids[:8])
    sr = torch.cat([ref.step(t) for t in ids[8:12]])
    assert (lq - lr).abs().max() <= 1e-4 * lr.abs().max()
    assert (sq - sr).abs().max() <= 1e-3 * sr.abs().max()


@gpu_only
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_gpu_quant_kernels(fmt):
    check_format(Env("gpu"), fmt, rows=1000, cols=1536)


@gpu_only
def test_gpu_model_quantized_vs_dequantized(tiny_model_dir):
    from minirun import Engine
    d = tiny_model_dir("gqa-untied")
    ids = list(range(5, 25))
    q = Engine.load(d, device="cuda", ctx=64, weights="q8_0")
    f = Engine.load(d, device="cpu", ctx=64, weights="q8_0")
    assert (q.logits(ids).cpu() - f.logits(ids)).abs().max() <= 1e-3 * f.logits(ids).abs().max()
