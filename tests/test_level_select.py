"""kernels_cpu.level_select (scores kept as integer levels, selection by level buckets) against its
NumPy reference (same tokens, same scores), against the exact softmax mass (the documented bound),
and its exact fallback and compact value sum."""
import numpy as np
import pytest

import kernels_cpu as kc
import references as ref
from kernels_cpu.level_select import NB

HQ, HKV = 9, 3
Q2K = (np.arange(HQ) // (HQ // HKV)).astype(np.int32)


def case(rng, g, c, n, mag):
    """Tables with per-head magnitudes (real queries differ by head) and random indices."""
    T = (rng.standard_normal((HQ, g, c)) * mag * rng.uniform(0.1, 3.0, (HQ, 1, 1))).astype(np.float32)
    P = rng.integers(0, c, size=(HKV, n + 7, g)).astype(np.int16 if c > 256 else np.uint8)
    return T, P


def check_same(got, want):
    idx, counts, m, l_sel, zs = got
    ridx, rcounts, rm, rl, rz = want
    np.testing.assert_array_equal(counts, rcounts)
    for h in range(HQ):
        np.testing.assert_array_equal(idx[h, :counts[h]], ridx[h, :counts[h]])
        np.testing.assert_array_equal(zs[h, :counts[h]], rz[h, :counts[h]])
    np.testing.assert_array_equal(m, rm)
    np.testing.assert_allclose(l_sel, rl, rtol=2e-5)


@pytest.mark.parametrize("g,c,n", [(16, 1024, 5000), (32, 1024, 3000), (16, 256, 1025), (8, 64, 1), (16, 1024, 7)])
@pytest.mark.parametrize("tau", [0.9, 0.5, 0.99, 1.0, 0.0])
@pytest.mark.parametrize("mag", [0.02, 0.5, 3.0, 40.0])
def test_packed_select_matches_reference(g, c, n, tau, mag):
    rng = np.random.default_rng([g, c, n, int(tau * 100), int(mag * 100)])
    T, P = case(rng, g, c, n, mag)
    packed = kc.pack_lut(T, Q2K)
    Q = ref.pack_lut_ref(T)[0]
    np.testing.assert_array_equal(packed.top, Q.max(axis=2).sum(axis=1))   # no level exceeds top
    s = packed.scale.astype(np.float64)
    w = s * 2.0 ** packed.shift
    assert ((packed.shift == 0) | (w <= 1 / 32)).all()
    assert ((packed.shift == 15) | (2 * w > 1 / 32)).all()                  # the widest such bucket
    got = kc.packed_select(packed, ref.group_major(P), n, tau)
    check_same(got, ref.packed_select_ref(T, P, Q2K, n, tau))
    z = ref.packed_scores_ref(T, P, Q2K, n)
    idx, counts, m, _, _ = got
    np.testing.assert_array_equal(m, z.max(axis=1))
    if tau >= 1:
        assert (counts == n).all()
    if tau <= 0:
        assert (counts == 0).all()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tau", [0.5, 0.9, 0.95])
def test_selection_mass_within_the_bucket_bound(seed, tau):
    """Upper set of the scores; exact mass >= tau e^-w; without its boundary bucket < tau e^w."""
    rng = np.random.default_rng([seed, int(tau * 100)])
    g, c, n = (16, 1024, 6000) if seed % 2 else (32, 256, 4000)
    T, P = case(rng, g, c, n, [0.3, 1.0, 4.0][seed % 3])
    packed = kc.pack_lut(T, Q2K)
    idx, counts, m, l_sel, zs = kc.packed_select(packed, ref.group_major(P), n, tau)
    z = ref.packed_scores_ref(T, P, Q2K, n)
    Q = ref.pack_lut_ref(T)[0]
    for h in range(HQ):
        sel = idx[h, :counts[h]]
        assert (np.diff(sel) > 0).all()
        np.testing.assert_array_equal(zs[h, :counts[h]], z[h, sel])
        zc = z[h, sel].min()
        np.testing.assert_array_equal(sel, np.flatnonzero(z[h] >= zc))         # an upper set
        wts = np.exp(z[h].astype(np.float64) - z[h].max())
        S = wts.sum()
        w = float(packed.scale[h]) * 2.0 ** int(packed.shift[h])
        assert wts[sel].sum() >= tau * np.exp(-w) * S * (1 - 1e-6)
        # the selection without its boundary bucket (levels within one bucket of the cut)
        L = Q[h, np.arange(g)[None, :], P[Q2K[h], :n].astype(np.int64)].sum(axis=1)
        top, sh = int(packed.top[h]), int(packed.shift[h])
        above = ((top - L) >> sh) < ((top - L[sel].min()) >> sh)
        assert wts[above].sum() < tau * np.exp(w) * S * (1 + 1e-6)
        assert abs(l_sel[h] - wts[sel].sum()) <= 1e-4 * wts[sel].sum()


def test_fallback_when_top_is_loose():
    """Each group's largest entry is never indexed and far above the rest: top lies > NB buckets
    above every level, the catch-all bucket holds them all, and the head falls back to the exact
    float selection (threshold_select on the same scores)."""
    rng = np.random.default_rng(5)
    g, c, n = 16, 256, 3000
    T = (rng.standard_normal((HQ, g, c)) * 0.2).astype(np.float32)
    T[:, :, 0] = 50.0                                                # never indexed: P >= 1
    P = rng.integers(1, c, size=(HKV, n, g)).astype(np.uint8)
    packed = kc.pack_lut(T, Q2K)
    w = packed.scale.astype(np.float64) * 2.0 ** packed.shift
    z = ref.packed_scores_ref(T, P, Q2K, n)
    assert ((packed.top * packed.scale - (z.max(axis=1) - packed.offset)) > NB * w).all()  # really loose
    got = kc.packed_select(packed, ref.group_major(P), n, 0.9)
    check_same(got, ref.packed_select_ref(T, P, Q2K, n, 0.9))
    ridx, rcounts, _, _ = ref.threshold_select_ref(z, 0.9)
    np.testing.assert_array_equal(got[1], rcounts)
    for h in range(HQ):
        np.testing.assert_array_equal(got[0][h, :rcounts[h]], ridx[h, :rcounts[h]])


@pytest.mark.parametrize("vdt", [np.float32, np.float16])
def test_weighted_value_sum_compact_scores(vdt):
    rng = np.random.default_rng(3)
    n, d = 3000, 64
    T, P = case(rng, 16, 256, n, 1.0)
    idx, counts, _, _, zs = kc.packed_select(kc.pack_lut(T, Q2K), ref.group_major(P), n, 0.9)
    z = ref.packed_scores_ref(T, P, Q2K, n)
    V = rng.standard_normal((HKV, n, d)).astype(vdt)
    got = kc.weighted_value_sum(zs, idx, counts, V, Q2K, compact=True)
    want = kc.weighted_value_sum(z, idx, counts, V, Q2K)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_packed_select_rejects_bad_buffers():
    rng = np.random.default_rng(0)
    T, P = case(rng, 16, 256, 10, 1.0)
    packed = kc.pack_lut(T, Q2K)
    with pytest.raises(ValueError, match="out_idx"):
        kc.packed_select(packed, ref.group_major(P), 10, 0.9, out_idx=np.zeros((HQ, 5), np.int32))
    with pytest.raises(ValueError, match="out_z"):
        kc.packed_select(packed, ref.group_major(P), 10, 0.9, out_z=np.zeros((HQ, 10), np.float64))
    with pytest.raises(ValueError, match="capacity"):
        kc.packed_select(packed, ref.group_major(P), 100, 0.9)
