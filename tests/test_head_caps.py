"""Per-head selection caps in the CPU decode steps (kernels_cpu.level_select.head_caps: > 0 at most
that many store tokens, 0 tau alone, < 0 the head skips the store) against the references, which cut
each head as the uniform cap would; and a step whose every head skips the store equals attention
over sinks + ring and the token alone."""
import numpy as np
import pytest

import kernels_cpu as kc
import references as ref
from kernels_cpu import fastscan as fs
from kernels_cpu.level_select import head_caps

HQ, HKV, D = 9, 3, 64
Q2K = (np.arange(HQ) // (HQ // HKV)).astype(np.int32)
CAPS = np.array([-1, 0, 40, 5, -1, 100000, 1, 0, 300])       # skip, tau alone, capped, over the store


def inputs(rng, n_exact, n_store, pool=np.float32):
    q = (rng.standard_normal((HQ, D)) / np.sqrt(D) * 3).astype(np.float32)
    k, v = rng.standard_normal((2, HKV, D)).astype(np.float32)
    EK, EV = rng.standard_normal((2, HKV, n_exact + 5, D)).astype(pool)
    V = rng.standard_normal((HKV, n_store + 13, D)).astype(pool)
    return q, k, v, EK, EV, V


def test_head_caps_shapes():
    np.testing.assert_array_equal(head_caps(None, 3), [0, 0, 0])
    np.testing.assert_array_equal(head_caps(7, 2), [7, 7])
    np.testing.assert_array_equal(head_caps([1, -1, 0], 3), [1, -1, 0])
    with pytest.raises(ValueError, match="Hq=4"):
        head_caps([1, 2], 4)


def _check_counts(counts, free, caps):
    assert (counts[caps < 0] == 0).all()                               # skipped heads read nothing
    np.testing.assert_array_equal(counts[caps == 0], free[caps == 0])  # tau alone: as uncapped
    capped = caps > 1
    assert (counts[capped] <= np.minimum(caps[capped], free[capped])).all()


@pytest.mark.parametrize("tau", [0.9, 1.0])
def test_packed_step_per_head_caps(tau):
    rng = np.random.default_rng([11, int(tau * 10)])
    n, g, c = 5000, 16, 1024
    q, k, v, EK, EV, V = inputs(rng, 272, n)
    C = rng.standard_normal((HKV, g, c, D // g)).astype(np.float32)
    P = rng.integers(0, c, size=(HKV, n + 13, g)).astype(np.int16)
    lanes = kc.lane_map(Q2K, HKV)

    def run(cap):
        packed = kc.PackedLUT(np.empty((lanes.shape[0], g, c), np.uint64), lanes, np.empty(HQ, np.float32),
                              np.empty(HQ, np.float32))
        counts = np.zeros(HQ, np.int32)
        o = kc.hca_decode_attend(q, k, v, EK, EV, 272, ref.codebooks_t(C), ref.group_major(P), n, V, tau, Q2K,
                                 packed, np.empty((HQ, g, c), np.float32), np.zeros((HQ, n + 13), np.float32),
                                 np.zeros((HQ, n + 13), np.int32), counts, cap=cap)
        return o, counts
    o, counts = run(CAPS)
    np.testing.assert_allclose(o, ref.hca_decode_attend_ref(q, k, v, EK, EV, 272, C, P, n, V, tau, Q2K, cap=CAPS),
                               rtol=1e-4, atol=1e-4)
    _, rcounts, _, _, _ = ref.packed_select_ref(ref.build_lut_ref(q, C, Q2K), P, Q2K, n, tau, CAPS)
    np.testing.assert_array_equal(counts, rcounts)
    _check_counts(counts, run(0)[1], CAPS)


@pytest.mark.skipif(not fs.available(), reason="fast scan needs AVX2 (the packed step above on every CPU)")
def test_fastscan_step_per_head_caps():
    rng = np.random.default_rng(12)
    n = 5000
    q, k, v, EK, EV, V = inputs(rng, 272, n, np.float16)
    F = rng.standard_normal((HKV, D, 1, 16)).astype(np.float32)
    PT = rng.integers(0, 256, (HKV, D // 2, n + 13), dtype=np.uint8)

    def run(cap):
        counts = np.zeros(HQ, np.int32)
        o = fs.hca_decode_attend_fs(q, k, v, EK, EV, 272, F, PT, n, V, 0.9, Q2K,
                                    fs.FastScanLUT(HQ, D, kc.lane_map(Q2K, HKV)), np.zeros((HQ, n + 13), np.float32),
                                    np.zeros((HQ, n + 13), np.int32), counts, cap=cap)
        return o, counts
    o, counts = run(CAPS)
    want = ref.hca_decode_attend_fs_ref(q, k, v, EK, EV, 272, F, PT, n, V, 0.9, Q2K, cap=CAPS)
    np.testing.assert_allclose(o, want, rtol=1e-4, atol=1e-4)
    Q, scale, offset = ref.fs_lut_ref(q, F, Q2K)
    _, rcounts, _, _, _ = ref.levels_select_ref(ref.fs_levels_ref(Q, PT, Q2K, n), Q.max(axis=2).sum(axis=1),
                                                scale, offset, 0.9, CAPS)
    np.testing.assert_array_equal(counts, rcounts)
    _check_counts(counts, run(0)[1], CAPS)


@pytest.mark.parametrize("tau", [0.9, 1.0])
def test_exact_step_per_head_caps(tau):
    rng = np.random.default_rng([13, int(tau * 10)])
    n = 3000
    q, k, v, EK, EV, V = inputs(rng, 40, n)
    q *= 0.3
    K = rng.standard_normal((HKV, n + 3, D)).astype(np.float32)

    def run(cap):
        z, counts = np.full((HQ, n + 13), np.nan, np.float32), np.zeros(HQ, np.int32)
        o = kc.hca_exact_decode_attend(q, k, v, EK, EV, 40, K, n, V, tau, Q2K, kc.lane_map(Q2K, HKV), z,
                                       kc.level_hist(HQ), counts, cap=cap)
        return o, counts, z[:, :n]
    o, counts, z = run(CAPS)
    sel = ref.exact_select_ref(z, tau, CAPS)
    np.testing.assert_array_equal(counts, sel.sum(1))
    want = ref.hca_exact_decode_attend_ref(q, k, v, EK, EV, 40, K, n, V, tau, Q2K, z=z, cap=CAPS)
    np.testing.assert_allclose(o, want, rtol=2e-5, atol=2e-6)
    _check_counts(counts, run(0)[1], CAPS)


def test_every_head_skipping_is_the_exact_tier_alone():
    """All heads skip: the store adds nothing, the step is the exact tier and the token itself."""
    rng = np.random.default_rng(14)
    n = 2000
    q, k, v, EK, EV, V = inputs(rng, 100, n)
    K = rng.standard_normal((HKV, n + 3, D)).astype(np.float32)
    z, counts = np.zeros((HQ, n + 13), np.float32), np.zeros(HQ, np.int32)
    o = kc.hca_exact_decode_attend(q, k, v, EK, EV, 100, K, n, V, 0.9, Q2K, kc.lane_map(Q2K, HKV), z,
                                   kc.level_hist(HQ), counts, cap=np.full(HQ, -1))
    assert (counts == 0).all()
    want = ref.hca_exact_decode_attend_ref(q, k, v, EK, EV, 100, K, 0, V, 0.9, Q2K)
    np.testing.assert_allclose(o, want, rtol=2e-5, atol=2e-6)


@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="g++ not found (CPU kernel emulator)")
@pytest.mark.parametrize("order", ["forward", "random"])
@pytest.mark.parametrize("tau", [0.9, 1.0])
def test_emu_zcut_per_head_caps(order, tau):
    """The GPU's zcut with per-head caps (kernels_cuda scores.cu, on the emulator): each head's
    selection is the one a uniform cap of its own value makes (0: the uncapped one), none where its
    cap is negative: the same contract as the CPU's head_caps."""
    import cuda_wrappers as cw
    from cuda_checks import Env, np_
    rng = np.random.default_rng(40)
    z = (rng.standard_normal((HQ, 3000)) * 2).astype(np.float32)
    z[4, :200] = 3.0                                   # a top bin of 200 tokens: above the small caps
    env = Env("emu", order=order)
    with env.ctx():
        zt = env.t(z)
        idx, counts, _, _ = cw.threshold_select(zt, tau, caps=env.t(CAPS.astype(np.int32)))
        idx, counts = np_(idx), np_(counts)
        for h, cap in enumerate(CAPS):
            if cap < 0:
                assert counts[h] == 0
                continue
            i1, c1, _, _ = cw.threshold_select(zt[h:h + 1].contiguous(), tau, cap=int(cap) or None)
            assert set(idx[h, :counts[h]].tolist()) == set(np_(i1)[0, :int(np_(c1)[0])].tolist()), h
