"""kernels_cpu.hca_exact_decode_attend (one decode token over sinks + ring, itself and a store of
exact keys, the 50% preset) against hca_exact_decode_attend_ref, for GQA layouts with 1, 2, 3, 4, 5
and 8 query heads per kv-head, float32 and float16 pools, one and two threads."""
import numba
import numpy as np
import pytest

import kernels_cpu as kc
import references as ref


def case(rng, Hq, Hkv, n, n_exact, pool=np.float32, d=64, qscale=0.3):
    q2k = (np.arange(Hq) // (Hq // Hkv)).astype(np.int32)
    q = (rng.standard_normal((Hq, d)) * qscale).astype(np.float32)
    K = rng.standard_normal((Hkv, n + 3, d)).astype(np.float32)
    V = rng.standard_normal((Hkv, n + 3, d)).astype(pool)
    EK = rng.standard_normal((Hkv, max(n_exact, 1), d)).astype(pool)
    EV = rng.standard_normal((Hkv, max(n_exact, 1), d)).astype(pool)
    k, v = rng.standard_normal((Hkv, d)).astype(pool), rng.standard_normal((Hkv, d)).astype(pool)
    return q2k, q, K, V, EK, EV, k, v


def run(q2k, q, K, V, EK, EV, k, v, n, n_exact, tau):
    """-> (o, counts, z): the kernel's output, selection sizes and scores."""
    Hq, Hkv = len(q2k), K.shape[0]
    z = np.full((Hq, n + 3), np.nan, np.float32)
    counts = np.zeros(Hq, np.int32)
    o = kc.hca_exact_decode_attend(q, k, v, EK, EV, n_exact, K, n, V, tau, q2k, kc.lane_map(q2k, Hkv), z,
                                   kc.level_hist(Hq), counts)
    return o, counts, z[:, :n]


def check(q2k, q, K, V, EK, EV, k, v, n, n_exact, tau):
    o, counts, z = run(q2k, q, K, V, EK, EV, k, v, n, n_exact, tau)
    # the scores: float32 dot products against float64 ones
    want_z = np.einsum("hd,hnd->hn", q.astype(np.float64), K[q2k, :n].astype(np.float64))
    np.testing.assert_allclose(z, want_z, rtol=1e-5, atol=1e-5 * np.abs(want_z).max(initial=1.0))
    # the selection and the whole output, on the kernel's own scores (a score on a bucket edge
    # may round to either side between float32 and float64)
    sel = ref.exact_select_ref(z, tau)
    np.testing.assert_array_equal(counts, sel.sum(1))
    want = ref.hca_exact_decode_attend_ref(q, k, v, EK, EV, n_exact, K, n, V, tau, q2k, z=z)
    np.testing.assert_allclose(o, want, rtol=2e-5, atol=2e-6)
    return counts, z, sel


@pytest.mark.parametrize("Hq,Hkv", [(9, 3), (8, 2), (4, 4), (8, 1), (5, 1), (6, 3)])
@pytest.mark.parametrize("n", [1, 1023, 1025, 5000])
@pytest.mark.parametrize("tau", [0.9, 0.5, 1.0, 0.0])
def test_hca_exact_decode_attend_matches_reference(Hq, Hkv, n, tau):
    rng = np.random.default_rng([Hq, Hkv, n, int(tau * 10)])
    counts, _, _ = check(*case(rng, Hq, Hkv, n, 40), n, 40, tau)
    if tau >= 1:
        assert (counts == n).all()
    if tau <= 0:
        assert (counts == 0).all()


@pytest.mark.parametrize("pool", [np.float32, np.float16])
@pytest.mark.parametrize("n_exact,n", [(0, 3000), (272, 0), (272, 2049)])
def test_hca_exact_decode_attend_pools_and_tiers(pool, n_exact, n):
    rng = np.random.default_rng([n_exact, n, pool().itemsize])
    check(*case(rng, 9, 3, n, n_exact, pool), n, n_exact, 0.9)


def test_selection_mass_bounds():
    """The cut is at 1/32-logit bucket resolution: the selection holds at least tau e^(-1/32) of
    the softmax mass, and without its lowest bucket less than tau e^(1/32)."""
    rng = np.random.default_rng(7)
    for qscale in (0.1, 0.5, 2.0):
        n, tau = 6000, 0.9
        args = case(rng, 9, 3, n, 16, qscale=qscale)
        _, counts, z = run(*args, n, 16, tau)
        for h in range(9):
            zh = z[h].astype(np.float64)
            w = np.exp(zh - zh.max())
            cut = np.sort(zh)[::-1][counts[h] - 1]                 # the lowest selected score
            sel_mass = w[zh >= cut].sum() / w.sum()
            above_boundary = w[np.floor(zh * 32) > np.floor(cut * 32)].sum() / w.sum()
            assert sel_mass >= tau * np.exp(-1 / 32)
            assert above_boundary < tau * np.exp(1 / 32)


@pytest.mark.parametrize("order", ["rising", "falling", "jump"])
def test_thread_reference_buckets_move(order):
    """Each thread counts on its own highest bucket so far and shifts its counts when a later block
    is higher (by a few buckets, or by more than all NB of them): the same selection as the
    reference with one thread and with two."""
    rng = np.random.default_rng(11)
    Hq, Hkv, n, d = 9, 3, 8 * 1024 + 5, 64
    q2k, q, K, V, EK, EV, k, v = case(rng, Hq, Hkv, n, 8)
    block = np.arange(n + 3) // 1024
    if order == "rising":
        K *= (0.2 + 0.3 * block)[None, :, None].astype(np.float32)
    elif order == "falling":
        K *= (0.2 + 0.3 * (block.max() - block))[None, :, None].astype(np.float32)
    else:   # the last block's scores ~200 logits above the rest for each kv-head's first query
        # head (further than NB buckets)
        K[:, block == block.max()] += (200.0 * q[::3] / (q[::3] ** 2).sum(1, keepdims=True))[:, None, :]
    before = numba.get_num_threads()
    try:
        for threads in (1, 2):
            kc.set_num_threads(threads)
            counts, _, _ = check(q2k, q, K, V, EK, EV, k, v, n, 8, 0.9)
    finally:
        numba.set_num_threads(before)
    if order == "jump":
        assert (counts[::3] <= 1024).all()      # the first head of each kv-head: its mass sits in the last block


def test_hca_exact_decode_attend_rejects_bad_scratch():
    rng = np.random.default_rng(0)
    q2k, q, K, V, EK, EV, k, v = case(rng, 9, 3, 100, 8)
    lanes = kc.lane_map(q2k, 3)
    with pytest.raises(ValueError, match="z must be"):
        kc.hca_exact_decode_attend(q, k, v, EK, EV, 8, K, 100, V, 0.9, q2k, lanes,
                                   np.empty((9, 50), np.float32), kc.level_hist(9))
    with pytest.raises(ValueError, match="K must be"):
        kc.hca_exact_decode_attend(q, k, v, EK, EV, 8, K[:, :50], 100, V, 0.9, q2k, lanes,
                                   np.empty((9, 100), np.float32), kc.level_hist(9))


def test_exact_valid_mask_skips_slots():
    """exact_valid: slots marked 0 (a ring not refilled after a truncate) are not attended, in
    both one-call steps: the same as the reference over the live slots only."""
    rng = np.random.default_rng(5)
    n, ne = 1500, 40
    q2k, q, K, V, EK, EV, k, v = case(rng, 9, 3, n, ne)
    valid = (rng.random(ne) < 0.6).astype(np.uint8)
    live = valid.astype(bool)
    z = np.empty((9, n), np.float32)
    o = kc.hca_exact_decode_attend(q, k, v, EK, EV, ne, K, n, V, 0.9, q2k, kc.lane_map(q2k, 3), z,
                                   kc.level_hist(9), exact_valid=valid)
    want = ref.hca_exact_decode_attend_ref(q, k, v, EK[:, live], EV[:, live], int(live.sum()), K, n, V, 0.9, q2k,
                                           z=z)
    np.testing.assert_allclose(o, want, rtol=2e-5, atol=2e-6)
    # the codebook step
    g, c = 16, 64
    cb = rng.standard_normal((3, g, c, 64 // g)).astype(np.float32)
    P = rng.integers(0, c, size=(3, n, g)).astype(np.uint8)
    Hq = 9
    packed = kc.PackedLUT(np.empty((3, g, c), np.uint64), kc.lane_map(q2k, 3), np.empty(Hq, np.float32),
                          np.empty(Hq, np.float32))
    o2 = kc.hca_decode_attend(q, k, v, EK, EV, ne, ref.codebooks_t(cb), ref.group_major(P), n, V, 0.9, q2k,
                              packed, np.empty((Hq, g, c), np.float32), np.empty((Hq, n), np.float32),
                              np.empty((Hq, n), np.int32), exact_valid=valid)
    want2 = ref.hca_decode_attend_ref(q, k, v, EK[:, live], EV[:, live], int(live.sum()), cb, P, n, V, 0.9, q2k)
    np.testing.assert_allclose(o2, want2, rtol=2e-4, atol=2e-5)
    with pytest.raises(ValueError, match="exact_valid"):
        kc.hca_exact_decode_attend(q, k, v, EK, EV, ne, K, n, V, 0.9, q2k, kc.lane_map(q2k, 3), z,
                                   kc.level_hist(9), exact_valid=valid[:10])


@pytest.mark.parametrize("tau,cap", [(1.0, 6), (0.9, 20), (0.5, 1), (1.0, 10 ** 6)])
def test_hca_exact_decode_attend_capped(tau, cap):
    """The cap inside the exact-key step: at most cap tokens per head in whole 1/32-logit buckets
    from the top (exact_select_ref with the cap), the output the reference's over that set."""
    rng = np.random.default_rng([3, int(tau * 10), cap])
    q2k, q, K, V, EK, EV, k, v = case(rng, 9, 3, 3000, 40)
    z = np.full((9, 3003), np.nan, np.float32)
    counts = np.zeros(9, np.int32)
    o = kc.hca_exact_decode_attend(q, k, v, EK, EV, 40, K, 3000, V, tau, q2k, kc.lane_map(q2k, 3), z,
                                   kc.level_hist(9), counts, cap=cap)
    sel = ref.exact_select_ref(z[:, :3000], tau, cap)
    np.testing.assert_array_equal(counts, sel.sum(1))
    want = ref.hca_exact_decode_attend_ref(q, k, v, EK, EV, 40, K, 3000, V, tau, q2k, z=z[:, :3000], cap=cap)
    np.testing.assert_allclose(o, want, rtol=2e-5, atol=2e-6)
    assert (counts >= 1).all() and ((counts <= cap).all() or cap == 1)
    if cap < 3000:
        for h in range(9):                                 # a top set: nothing left out scores higher
            assert z[h, :3000][sel[h]].min() >= z[h, :3000][~sel[h]].max()
