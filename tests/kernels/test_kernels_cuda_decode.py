"""kernels_cuda/decode.cu (the glue of one GPU decode step) and gather.cu (the GPU value sum)
against tests/references.

Emulated runs (CPU, g++) in several thread orders, and the same checks on a GPU (skipped without
one, with the reason). Tolerances:
  decode_prep       qs exact (one float32 product), qf 1e-6 + 1e-6 |ref| (the turn in float32
                    vs float64); the staged k, v rows bit-exact, the rows around them untouched,
                    the zeroed buffer all zeros
  pack_selection    exact (counts, clamped indices, score bits), entries past min(c, w) unwritten
  lse_merge_staged  float32 out: 1e-6 + 1e-5 |ref|; bfloat16 out: within one bfloat16 rounding
                    (2^-8 relative) of the float32 reference
  gather_value_sum  merged partials equal to weighted_value_sum_ref: o 1e-6 + 1e-5 |ref|, log-sum-exp
                    1e-6 (float32 sums of <= 300 weights <= 1 vs float64)
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
from minirun.kv.pinned import PinnedPool

HAVE_GPU = kernels_cuda.available()
emu_only = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (CPU kernel emulator)")
gpu_only = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device / cupy")
ORDERS = ["forward", "reverse", "random", "greedy"]


def check_decode_prep(env, Hq, Hkv, d, dtype, far, seed=0):
    R = _ref()
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(Hq + 2 * Hkv, d, generator=g).to(dtype)       # the model's fused projection
    q, k, v = qkv[:Hq], qkv[Hq:Hq + Hkv], qkv[Hq + Hkv:]
    ang = torch.rand(d // 2, generator=g, dtype=torch.float64) * 50
    cs = torch.cat([ang.cos(), ang.sin()]).float() if far else None
    tier = torch.full((2, Hkv, 5, d), 7.0).to(dtype)                 # [K/V, Hkv, rows, d]: row 3 is the spare
    zero = torch.ones(1000)
    with env.ctx():
        tier_d, zero_d = tier.to(env.device), zero.to(env.device)
        qs, qf = cw.decode_prep(q.to(env.device), k.to(env.device), v.to(env.device), 0.125, tier_d[0, :, 3],
                                tier_d[1, :, 3], cs=None if cs is None else cs.to(env.device), zero=zero_d)
    rq, rf = R.decode_prep_ref(q.float().numpy(), 0.125, None if cs is None else cs.numpy())
    np.testing.assert_array_equal(np_(qs), rq)
    if far:
        np.testing.assert_allclose(np_(qf), rf, rtol=1e-6, atol=1e-6)
    else:
        assert qf is None
    tier_h = tier_d.cpu()
    assert torch.equal(tier_h[0, :, 3], k) and torch.equal(tier_h[1, :, 3], v)
    keep = [0, 1, 2, 4]
    assert torch.equal(tier_h[:, :, keep], tier[:, :, keep])
    assert not zero_d.cpu().any()
    if dtype == torch.float16:
        return
    # q, k before RoPE and their position's [cos | sin]: turned first, as layer.rope_ turns them
    from kernels_cuda import layer as kl
    from minirun.model import ops
    rope = ops.rope_table(ang.cos()[None].to(dtype), ang.sin()[None].to(dtype))[0]
    with env.ctx():
        turned = kl.rope_(qkv.clone().reshape(1, -1).to(env.device), Hq + Hkv, d, rope.to(env.device))
        turned = turned.view(Hq + 2 * Hkv, d).cpu()
        tier_d = tier.to(env.device)
        qs2, qf2 = cw.decode_prep(q.to(env.device), k.to(env.device), v.to(env.device), 0.125, tier_d[0, :, 3],
                                  tier_d[1, :, 3], cs=None if cs is None else cs.to(env.device), rope=rope.to(env.device))
    rq, rf = R.decode_prep_ref(turned[:Hq].float().numpy(), 0.125, None if cs is None else cs.numpy())
    np.testing.assert_array_equal(np_(qs2), rq)
    if far:
        np.testing.assert_allclose(np_(qf2), rf, rtol=1e-6, atol=1e-6)
    tier_h = tier_d.cpu()
    assert torch.equal(tier_h[0, :, 3], turned[Hq:Hq + Hkv]) and torch.equal(tier_h[1, :, 3], v)
    assert torch.equal(tier_h[:, :, keep], tier[:, :, keep])


def check_pack_selection(env, Hq, n, width, w, cap, seed=1):
    R = _ref()
    rng = np.random.default_rng(seed)
    idx = rng.integers(-3, n + 3, size=(Hq, width)).astype(np.int64)     # out of range: clamped
    z = rng.standard_normal((Hq, n + 5)).astype(np.float32)              # wider than n (a scratch row)
    counts = rng.integers(0, width + 1, size=Hq).astype(np.int32)
    counts[0] = width                                                    # > w when w < width
    idx[:, :4] = [n, -1, n - 1, n + 2]                                   # the clamp's edges, in every row
    counts[1:] = np.maximum(counts[1:], 4)
    with env.ctx():
        pack = cw.pack_selection(env.t(idx, torch.int32), env.t(z)[:, :n], env.t(counts), w, cap=cap)
    pack = np_(pack)
    c, ri, rz = R.pack_selection_ref(idx, z, counts, 2**31 - 1 if cap is None else cap, n, w)
    np.testing.assert_array_equal(pack[:Hq], c)
    gi = pack[Hq:Hq + Hq * w].reshape(Hq, w)
    gz = pack[Hq + Hq * w:].view(np.float32).reshape(Hq, w)
    for h in range(Hq):
        k = min(int(c[h]), w)
        np.testing.assert_array_equal(gi[h, :k], ri[h, :k])
        np.testing.assert_array_equal(gz[h, :k].view(np.int32), rz[h, :k].view(np.int32))


def check_lse_merge_staged(env, P, Hq, d, out_dtype, seed=3):
    R = _ref()
    rng = np.random.default_rng(seed)
    os_ = rng.standard_normal((P, Hq, d)).astype(np.float32)
    ms = (rng.standard_normal((P, Hq)) * 3).astype(np.float32)
    ls = (rng.random((P, Hq)) * 5 + 0.1).astype(np.float32)
    st = np.concatenate([rng.standard_normal((Hq, d)), rng.standard_normal((Hq, 1)) * 3,
                         rng.random((Hq, 1)) * 5 + 0.1], 1).astype(np.float32)
    st[0, d], st[0, d + 1], st[0, :d] = -np.inf, 0.0, np.nan            # an empty host part: never read
    if P >= 1 and Hq >= 3:
        ms[:, 1], ls[:, 1], os_[:, 1] = -np.inf, 0.0, np.nan            # only the host part lives
        ms[:, 2], ls[:, 2] = -np.inf, 0.0
        st[2, d], st[2, d + 1] = -np.inf, 0.0                            # nothing lives
    with env.ctx():
        o = cw.lse_merge_staged(env.t(os_), env.t(ms), env.t(ls), env.t(st), out_dtype)
    ref = R.lse_merge_staged_ref(os_, ms, ls, st)
    o = np_(o)
    assert o.dtype == np.float32 and np.isfinite(o).all()
    if out_dtype == torch.float32:
        np.testing.assert_allclose(o, ref, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_allclose(o, ref, rtol=2.0**-8, atol=1e-6)
        bits = R.float_to_bf16_bits_ref(ref)
        assert (R.bf16_bits_to_float_ref(bits) == o).mean() >= 0.99      # (a 1-ulp tie flip at most, rarely)


def mapped_pool(env, V):
    """A value pool as the GPU value sum's cache has it, sized for V [1, Hkv, tokens, d] (not yet
    written): page-locked and mapped on a GPU, a plain CPU tensor under the emulator."""
    _, Hkv, n, d = V.shape
    pool = PinnedPool((1, Hkv), d, V.dtype, n, env.device, torch.cuda.Stream() if env.kind == "gpu" else None,
                      mapped=True)
    pool.reserve(n)
    assert pool.mapped                 # registered portable | mapped (the GPU reads it at its address)
    return pool


def check_gather_value_sum(env, Hq, Hkv, d, n, width, dtype, cap, nsplit, host_wait=True, seed=5):
    """Each head's own list of rows (any indices, clamped; a cut of n_bins: no head's list is a
    threshold set, so none is shared), merged, against weighted_value_sum_ref. The value rows live
    where the cache keeps them: a PinnedPool (page-locked and mapped, written by its async copy on
    a GPU; a plain CPU tensor under the emulator). host_wait False: the gather waits for that copy
    on the GPU only (device_wait), as the decode step does."""
    R = _ref()
    rng = np.random.default_rng(seed)
    idx = rng.integers(-2, n + 2, size=(Hq, width)).astype(np.int64)       # out of range: clamped
    z = (rng.standard_normal((Hq, n + 3)) * 3).astype(np.float32)          # wider than n (a scratch row)
    m = z[:, :n].max(1)
    counts = rng.integers(1, width + 1, size=Hq).astype(np.int32)
    counts[0] = width
    counts[1] = 0                                                          # an empty head
    m[2] = -np.inf                                                         # no live score: empty too
    V = torch.randn(1, Hkv, n + 7, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    pool = mapped_pool(env, V)
    with env.ctx():
        pool.write_all(0, V.to(env.device))
        pool.wait() if host_wait else pool.device_wait()
        no_cut = env.t(np.full(Hq, kd.N_BINS, np.int32))
        os_, ms, ls = cw.gather_value_sum(env.t(idx, torch.int32), env.t(z)[:, :n], env.t(counts),
                                          env.t(m), pool.data[0], env.t(q2k_for(Hq, Hkv)), n,
                                          (no_cut, kd.Z_RANGE, kd.N_BINS), cap=cap, nsplit=nsplit)
    Vf = V[0].float().numpy()
    c = 2**31 - 1 if cap is None else cap
    # merged, the partials are the one-list weighted sum (the CPU backend's host value sum)
    o, mm, ll = R.lse_merge_ref(np_(os_), np_(ms), np_(ls))
    cl = np.minimum(counts, c).astype(np.int32)
    cl[2] = 0
    wo, wm, wl = R.weighted_value_sum_ref(z[:, :n], np.clip(idx, 0, n - 1), cl, Vf, q2k_for(Hq, Hkv))
    np.testing.assert_allclose(o, wo, rtol=1e-5, atol=1e-6)
    live = cl > 0
    np.testing.assert_allclose(mm[live] + np.log(ll[live]), wm[live] + np.log(wl[live]), rtol=1e-6, atol=1e-6)
    assert not (ll[~live] > 0).any()
    pool.free()


def check_gather_grouped(env, Hq, Hkv, d, n, dtype, tau, cap, nsplit=None, poison=False, seed=7):
    """The grouped gather (each row read once per kv group) on a real threshold selection
    (DecodeStep.select over scores correlated across heads, so the heads' lists overlap) against
    weighted_value_sum_ref of each head's list. cap: also a head
    whose top bin alone holds more than cap tokens (its list is then any cap of them: not shared).
    poison: a value row that head 0 selected and head 1 did not is inf: head 1 stays exact (a row
    read for one head of a group must not reach another's sum)."""
    R = _ref()
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal(n) * 2 + 0.6 * rng.standard_normal((Hq, n))).astype(np.float32)
    if cap:
        z[1, :3 * cap] = z[1].max()                                   # one bin with 3 cap tokens
    V = torch.randn(1, Hkv, n, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    pool = mapped_pool(env, V)
    q2k = q2k_for(Hq, Hkv)
    with env.ctx():
        zt = env.t(z)
        ds = kd.DecodeStep(env.device, Hq, Hkv, d, n, 8, torch.float32)
        idx = torch.zeros(Hq, n, dtype=torch.int32, device=env.device)
        with ds.session() as L:
            torch.amax(zt[:, :n], 1, out=ds.m)
            torch.sum(torch.exp(zt[:, :n] - ds.m[:, None]), 1, out=ds.l)
            ds.hists.zero_()
            ds.select(L, zt, n, tau, idx, cap or 0)
        if poison:
            cnt = np_(ds.counts).astype(np.int64)
            s0, s1 = (set(np_(idx)[h, :cnt[h]].tolist()) for h in (0, 1))
            V[0, 0, min(s0 - s1)] = float("inf")
        pool.write_all(0, V.to(env.device))
        pool.device_wait()
        grouped = cw.gather_value_sum(idx, zt, ds.counts, ds.m, pool.data[0], env.t(q2k), n,
                                      (ds.cut, ds.z_range, ds.n_bins), cap=cap, nsplit=nsplit)
    counts = np_(ds.counts).astype(np.int64)
    c = np.minimum(counts, cap or 2**31 - 1).astype(np.int32)
    assert c.min() > 0 and (cap is None or counts[1] > cap)
    with np.errstate(invalid="ignore"):
        wo, wm, wl = R.weighted_value_sum_ref(z, np_(idx), c, V[0].float().numpy(), q2k)
    exact = np.arange(Hq) != (0 if poison else -1)          # (poison: head 0's sum is inf / NaN)
    with np.errstate(invalid="ignore"):
        o, mm, ll = R.lse_merge_ref(*(np_(t) for t in grouped))
    np.testing.assert_allclose(o[exact], wo[exact], rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose((mm + np.log(ll))[exact], (wm + np.log(wl))[exact], rtol=1e-6, atol=1e-5)
    pool.free()
    return c


@emu_only
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("Hq,Hkv,d,dtype,tau,cap,nsplit,poison", [(6, 2, 32, torch.float32, 0.9, None, None, False),
                                                                 (9, 3, 64, torch.float16, 0.5, 20, 3, False),
                                                                 (8, 1, 96, torch.bfloat16, 0.95, None, 2, False),
                                                                 (8, 2, 32, torch.float32, 0.9, None, 4, True),
                                                                 (10, 2, 32, torch.float16, 0.8, None, 1, False)])
def test_emu_gather_grouped(order, Hq, Hkv, d, dtype, tau, cap, nsplit, poison):
    """Group sizes 3, 4 and 8 (the kernel's register arrays: g3, g4, g8 for 5 and 8)."""
    c = check_gather_grouped(Env("emu", order=order), Hq, Hkv, d, 700, dtype, tau, cap, nsplit, poison)
    assert c.sum() > 2 * Hkv * 20     # lists long enough to overlap


@gpu_only
@pytest.mark.parametrize("tau,cap", [(0.9, None), (0.9, 1024)])
def test_gpu_gather_grouped(tau, cap):
    check_gather_grouped(Env("gpu"), 9, 3, 64, 60000, torch.float16, tau, cap)


@emu_only
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("d,dtype,cap,nsplit", [(32, torch.float32, None, 1), (32, torch.bfloat16, None, 3),
                                                (96, torch.float16, 40, 2), (128, torch.bfloat16, 7, 5)])
def test_emu_gather_value_sum(order, d, dtype, cap, nsplit):
    check_gather_value_sum(Env("emu", order=order), 6, 2, d, 200, 300, dtype, cap, nsplit)


@gpu_only
@pytest.mark.parametrize("dtype,cap,nsplit,host_wait", [(torch.float16, None, 59, False), (torch.bfloat16, None, 59, True),
                                                        (torch.float16, 4096, 7, False), (torch.float32, 100, 1, True)])
def test_gpu_gather_value_sum(dtype, cap, nsplit, host_wait):
    check_gather_value_sum(Env("gpu"), 9, 3, 64, 70000, 5000, dtype, cap, nsplit, host_wait)


@emu_only
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("far", [False, True])
def test_emu_decode_prep(order, dtype, far):
    check_decode_prep(Env("emu", order=order), 6, 2, 16, dtype, far)


@emu_only
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("cap,w", [(None, 8), (None, 40), (5, 8), (100, 300)])
def test_emu_pack_selection(order, cap, w):
    check_pack_selection(Env("emu", order=order), 5, 300, max(w, 40), w, cap)


def check_bf16_rounding(env, Hq=4, d=32, seed=4):
    """One live part of weight 1 (the host's, m = 0, l = 1): the merge returns its o exactly, so
    the bfloat16 store's rounding is checked bit for bit, ties to even included."""
    R = _ref()
    rng = np.random.default_rng(seed)
    o = rng.standard_normal((Hq, d)).astype(np.float32)
    bits = o.view(np.uint32)
    bits[:, :8] = (bits[:, :8] & 0xFFFF0000) | 0x8000                   # exact ties
    bits[:, 8:12] = (bits[:, 8:12] & 0xFFFF0000) | 0x7FFF
    st = np.concatenate([o, np.zeros((Hq, 1)), np.ones((Hq, 1))], 1).astype(np.float32)
    z = np.zeros((0, Hq, d), np.float32)
    with env.ctx():
        got = cw.lse_merge_staged(env.t(z), env.t(z[:, :, 0]), env.t(z[:, :, 0]), env.t(st), torch.bfloat16)
    np.testing.assert_array_equal(got.cpu().view(torch.int16).numpy().view(np.uint16), R.float_to_bf16_bits_ref(o))


@emu_only
def test_emu_bf16_rounding():
    check_bf16_rounding(Env("emu"))


@gpu_only
def test_gpu_bf16_rounding():
    check_bf16_rounding(Env("gpu"))


@emu_only
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("P,out_dtype", [(0, torch.float32), (1, torch.float32), (3, torch.bfloat16),
                                         (6, torch.float32)])
def test_emu_lse_merge_staged(order, P, out_dtype):
    check_lse_merge_staged(Env("emu", order=order), P, 5, 24, out_dtype)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("far", [False, True])
def test_gpu_decode_prep(dtype, far):
    check_decode_prep(Env("gpu"), 9, 3, 64, dtype, far)


@gpu_only
@pytest.mark.parametrize("cap,w", [(None, 1024), (4096, 2048)])
def test_gpu_pack_selection(cap, w):
    check_pack_selection(Env("gpu"), 9, 70000, 5000, w, cap)


@gpu_only
@pytest.mark.parametrize("P,out_dtype", [(1, torch.float32), (5, torch.bfloat16), (12, torch.float32)])
def test_gpu_lse_merge_staged(P, out_dtype):
    check_lse_merge_staged(Env("gpu"), P, 9, 64, out_dtype)


@emu_only
def test_wrapper_argument_errors():
    """Shape and dtype mistakes fail in the wrappers, before any launch."""
    import cuda_emu
    with cuda_emu.emulated(), pytest.raises((ValueError, TypeError)):
        cw.decode_prep(torch.zeros(4, 7), torch.zeros(2, 7), torch.zeros(2, 7), 1.0, torch.zeros(2, 7),
                       torch.zeros(2, 7))                                       # odd head dim
    with cuda_emu.emulated(), pytest.raises(ValueError):
        cw.pack_selection(torch.zeros(3, 4, dtype=torch.int16), torch.zeros(3, 4), torch.zeros(3, dtype=torch.int32), 2)
    with cuda_emu.emulated(), pytest.raises(ValueError):
        cw.gather_value_sum(torch.zeros(3, 4, dtype=torch.int32), torch.zeros(3, 8), torch.zeros(3, dtype=torch.int32),
                            torch.zeros(3), torch.zeros(1, 8, 300), [0, 0, 0], 8,
                            (torch.zeros(3, dtype=torch.int32), 32.0, 2048))   # head dim > block
    with cuda_emu.emulated(), pytest.raises(ValueError):
        cw.lse_merge_staged(torch.zeros(2, 3, 4), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3, 5))
