"""What a captured HCA decode token needs of the kernels (minirun/kv/hca_graph.py): the store's
length read from device memory (n_live of approx_scores, zhist, zcompact, with grids sized for a
bucket), and store_rows (the leaving token's values into the pool at a row held on the device).

Emulated (CPU, g++) in several thread orders, and on a GPU (skipped without one, with the reason).
Tolerances: scores and m bit-exact against the same kernels run for exactly n tokens (each score
is one row's sum in the same order; m a max); l 1e-6 relative (block partials summed in another
partition); the selected sets equal; columns past n untouched. store_rows exact (raw copies).
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import cuda_wrappers as cw
import kernels_cuda
import kernels_cuda.decode as kd
from cuda_checks import Env, _ref, np_, q2k_for

HAVE_GPU = kernels_cuda.available()
emu_only = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (CPU kernel emulator)")
gpu_only = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device / cupy")
ORDERS = ["forward", "reverse", "random"]


def check_live_count(env, n, nb, tau, cap, Hq=6, Hkv=2, d=32, g=8, c=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    P = torch.randint(0, c, (Hkv, nb, g), generator=gen, dtype=torch.int32).to(torch.uint8)
    C = torch.randn(Hkv, g, c, d // g, generator=gen)
    q = torch.randn(Hq, d, generator=gen)
    q2k = torch.from_numpy(q2k_for(Hq, Hkv))
    out = {}
    with env.ctx():
        dev = env.device
        ds = kd.DecodeStep(dev, Hq, Hkv, d, nb, 8, torch.float32)
        args = [t.to(dev) for t in (q, q2k, C, P)]
        for live in (False, True):
            z = torch.full((Hq, nb), float("nan"), device=dev)          # poison: columns past n stay
            idx = torch.full((Hq, nb), -1, dtype=torch.int32, device=dev)
            ds.hists.zero_()
            n_live = torch.tensor([n], dtype=torch.int32, device=dev) if live else None
            with ds.session() as L:
                ds.scores(L, *args, nb if live else n, z, n_live=n_live)
                ds.select(L, z, nb if live else n, tau, idx, cap, n_live=n_live)
            cnt = np_(ds.counts).copy()
            rows = [np.sort(np_(idx)[h, :min(cnt[h], cap or nb)]) for h in range(Hq)]
            out[live] = (np_(z).copy(), np_(ds.m).copy(), np_(ds.l).copy(), cnt, rows)
    (za, ma, la, ca, ra), (zb, mb, lb, cb, rb) = out[False], out[True]
    np.testing.assert_array_equal(zb[:, :n], za[:, :n])
    assert np.isnan(zb[:, n:]).all()
    np.testing.assert_array_equal(mb, ma)
    np.testing.assert_allclose(lb, la, rtol=1e-6)
    np.testing.assert_array_equal(cb, ca)
    for a, b in zip(ra, rb):
        np.testing.assert_array_equal(a, b)
        assert len(a) == 0 or a[-1] < n


@emu_only
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("n,nb", [(300, 4096), (4095, 4096), (1, 64), (2048, 2048)])
@pytest.mark.parametrize("tau,cap", [(0.9, 0), (0.9, 40), (1.0, 0)])
def test_emu_live_count(order, n, nb, tau, cap):
    check_live_count(Env("emu", order=order), n, nb, tau, cap)


@gpu_only
@pytest.mark.parametrize("n,nb", [(300, 4096), (4095, 4096), (50000, 65536)])
@pytest.mark.parametrize("tau,cap", [(0.9, 0), (0.9, 40)])
def test_gpu_live_count(n, nb, tau, cap):
    check_live_count(Env("gpu"), n, nb, tau, cap)


def check_store_rows(env, dtype, R=6, T=9, d=64, row=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randn(R, d, generator=gen).to(dtype)
    dst = torch.randn(R, T, d, generator=gen).to(dtype)
    want = _ref().store_rows_ref(np_(src), np_(dst), row)
    with env.ctx():
        dst_d = dst.to(env.device)
        cw.store_rows(src.to(env.device), dst_d, torch.tensor([row], dtype=torch.int32, device=env.device))
    np.testing.assert_array_equal(np_(dst_d), want)


@emu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_emu_store_rows(dtype):
    check_store_rows(Env("emu"), dtype)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_store_rows(dtype):
    check_store_rows(Env("gpu"), dtype)


@gpu_only
def test_gpu_store_rows_into_the_mapped_pool():
    """On a GPU: the kernel writes the page-locked, mapped value pool at its host address."""
    from minirun.kv.pinned import PinnedPool
    dev = torch.device("cuda")
    if not kd.host_pool_readable(dev):
        pytest.skip("this GPU cannot read page-locked host memory at its address")
    pool = PinnedPool((2, 3), 64, torch.bfloat16, 16, dev, torch.cuda.Stream(dev), mapped=True)
    pool.reserve(16)
    assert pool.mapped
    pool.data.zero_()
    src = torch.randn(6, 64, device=dev).to(torch.bfloat16)
    cw.store_rows(src, pool.data.view(6, 16, 64), torch.tensor([7], dtype=torch.int32, device=dev))
    torch.cuda.synchronize()
    assert torch.equal(pool.data.view(6, 16, 64)[:, 7], src.cpu())
    assert not pool.data.view(6, 16, 64)[:, :7].any() and not pool.data.view(6, 16, 64)[:, 8:].any()
    pool.free()


@emu_only
def test_store_rows_argument_errors():
    import cuda_emu
    with cuda_emu.emulated():
        with pytest.raises(ValueError, match="dst"):
            cw.store_rows(torch.zeros(2, 4), torch.zeros(3, 5, 4), torch.zeros(1, dtype=torch.int32))
        with pytest.raises(ValueError, match="row"):
            cw.store_rows(torch.zeros(2, 4), torch.zeros(2, 5, 4), torch.zeros(1, dtype=torch.int64))
