"""The GPU's value sum over quantized values (kernels_cuda/gather.cu gather_value_sum_grouped_q8 /
_q4: the codes read from the mapped host pool, dequantized on the device) against
weighted_value_sum_ref over the decoded rows (tests/support/references/values.py), on the CPU emulator
in several thread orders and on a GPU where there is one."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import cuda_wrappers as cw
import kernels_cuda.decode as kd
from cuda_checks import Env, _ref, np_, q2k_for
from minirun.kv.pinned import PinnedPool
from minirun.kv.value_codes import ValueCodes

emu_only = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (CPU kernel emulator)")
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")


def check_gather_quantized(env, Hq, Hkv, d, n, kind, tau, seed=3):
    """A real threshold selection (DecodeStep.select) over scores correlated across heads, the
    grouped gather over a pool of quantized rows written as the cache writes them (PinnedPool)."""
    R = _ref()
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal(n) * 2 + 0.6 * rng.standard_normal((Hq, n))).astype(np.float32)
    V = torch.randn(Hkv, n, d, generator=torch.Generator().manual_seed(seed))
    V[:, :, 3] *= 15                                    # an outlier channel, as models have
    codes = ValueCodes(kind, d)
    rows = codes.encode(V)[None]                        # [1, Hkv, n, width]
    pool = PinnedPool((1, Hkv), codes.width, torch.uint8, n, env.device,
                      torch.cuda.Stream() if env.kind == "gpu" else None, mapped=True)
    pool.reserve(n)
    q2k = q2k_for(Hq, Hkv)
    with env.ctx():
        zt = env.t(z)
        ds = kd.DecodeStep(env.device, Hq, Hkv, d, n, 8, torch.float32)
        idx = torch.zeros(Hq, n, dtype=torch.int32, device=env.device)
        with ds.session() as L:
            torch.amax(zt[:, :n], 1, out=ds.m)
            torch.sum(torch.exp(zt[:, :n] - ds.m[:, None]), 1, out=ds.l)
            ds.hists.zero_()
            ds.select(L, zt, n, tau, idx, 0)
        pool.write_all(0, rows.to(env.device))
        pool.device_wait()
        parts = cw.gather_value_sum(idx, zt, ds.counts, ds.m, pool.data[0], env.t(q2k), n,
                                    (ds.cut, ds.z_range, ds.n_bins), head_dim=d)
    c = np_(ds.counts).astype(np.int32)
    assert c.min() > 0
    Vd = R.decode_values_ref(rows[0].numpy(), kind, d)
    wo, wm, wl = R.weighted_value_sum_ref(z, np_(idx), c, Vd, q2k)
    o, mm, ll = R.lse_merge_ref(*(np_(t) for t in parts))
    np.testing.assert_allclose(o, wo, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mm + np.log(ll), wm + np.log(wl), rtol=1e-6, atol=1e-5)
    # the codes are not the float values: the sum is the decoded rows', within the codes' error
    wf = R.weighted_value_sum_ref(z, np_(idx), c, V.numpy(), q2k)[0]
    assert not np.array_equal(o, wf) and np.abs(o - wf).max() < (0.05 if kind == "q8" else 0.5)
    pool.free()


@emu_only
@pytest.mark.parametrize("order", ["forward", "random"])
@pytest.mark.parametrize("Hq,Hkv,d,kind,tau", [(9, 3, 64, "q8", 0.9), (9, 3, 64, "q4", 0.5), (8, 2, 128, "q4", 0.95),
                                               (8, 1, 32, "q8", 0.8)])
def test_emu_gather_quantized(order, Hq, Hkv, d, kind, tau):
    check_gather_quantized(Env("emu", order=order), Hq, Hkv, d, 700, kind, tau)


@gpu_only
@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_gpu_gather_quantized(kind):
    check_gather_quantized(Env("gpu"), 9, 3, 64, 60000, kind, 0.9)


def test_gather_refuses_quantized_rows_without_head_dim():
    import cuda_emu
    V = torch.zeros(2, 10, 40, dtype=torch.uint8)
    with cuda_emu.emulated(), pytest.raises(ValueError, match="head_dim"):
        cw.gather_value_sum(torch.zeros(4, 4, dtype=torch.int32), torch.zeros(4, 8), torch.zeros(4, dtype=torch.int32),
                            torch.zeros(4), V, np.arange(4) // 2, 8, (torch.zeros(4, dtype=torch.int32), 64.0, 4096))
