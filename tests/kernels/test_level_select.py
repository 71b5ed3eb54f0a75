"""kernels_cpu.level_select (selection by level buckets on the integer scores), as the one-call step
hca_decode_attend makes it: the same selection sizes as its NumPy reference (packed_select_ref on
the step's own tables), an upper set of the levels, and within the documented bound of the exact
softmax mass. Also weighted_value_sum over compact scores (the GPU cache's host value sum)."""
import numpy as np
import pytest

import kernels_cpu as kc
import references as ref
from kernel_steps import D, HKV, HQ, Q2K, packed_store_step as store_step


def case(rng, g, c, n, mag):
    """Queries with per-head magnitudes (real queries differ by head), codebooks whose table entries
    are about that large, random token-major indices."""
    q = (rng.standard_normal((HQ, D)) * mag * rng.uniform(0.1, 3.0, (HQ, 1))).astype(np.float32)
    C = (rng.standard_normal((HKV, g, c, D // g)) / np.sqrt(D // g)).astype(np.float32)
    P = rng.integers(0, c, size=(HKV, n + 7, g)).astype(np.int16 if c > 256 else np.uint8)
    return q, C, P


def selection(lev, counts):
    """Each head's selection from its levels and size: its counts[h] highest levels, which must be
    an upper set (every level at or above the least selected one) -> list of index arrays."""
    sel = []
    for h in range(lev.shape[0]):
        c = int(counts[h])
        if c == 0:
            sel.append(np.zeros(0, np.int64))
            continue
        cut = np.sort(lev[h])[::-1][c - 1]
        s = np.flatnonzero(lev[h] >= cut)
        assert s.size == c, (h, c, s.size)
        sel.append(s)
    return sel


@pytest.mark.parametrize("g,c,n", [(16, 1024, 5000), (32, 1024, 3000), (16, 256, 1025), (8, 64, 1), (16, 1024, 7)])
@pytest.mark.parametrize("tau", [0.9, 0.5, 0.99, 1.0, 0.0])
@pytest.mark.parametrize("mag", [0.02, 0.5, 3.0, 40.0])
def test_selection_matches_reference(g, c, n, tau, mag):
    rng = np.random.default_rng([g, c, n, int(tau * 100), int(mag * 100)])
    q, C, P = case(rng, g, c, n, mag)
    _, counts, _, T, lev, _ = store_step(q, C, P, n, Q2K, tau)
    ridx, rcounts, _, _, _ = ref.packed_select_ref(T, P, Q2K, n, tau)
    np.testing.assert_array_equal(counts, rcounts)
    for h, s in enumerate(selection(lev, counts)):
        np.testing.assert_array_equal(s, ridx[h, :rcounts[h]])
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
    q, C, P = case(rng, g, c, n, [0.3, 1.0, 4.0][seed % 3])
    _, counts, packed, _, lev, _ = store_step(q, C, P, n, Q2K, tau)
    z = lev.astype(np.float32) * packed.scale[:, None] + packed.offset[:, None]
    for h, sel in enumerate(selection(lev, counts)):
        assert sel.size > 0
        wts = np.exp(z[h].astype(np.float64) - z[h].max())
        S = wts.sum()
        w = float(packed.scale[h]) * 2.0 ** int(packed.shift[h])
        assert wts[sel].sum() >= tau * np.exp(-w) * S * (1 - 1e-6)
        # the selection without its boundary bucket (levels within one bucket of the cut)
        L = lev[h]
        top, sh = int(packed.top[h]), int(packed.shift[h])
        above = ((top - L) >> sh) < ((top - L[sel].min()) >> sh)
        assert wts[above].sum() < tau * np.exp(w) * S * (1 + 1e-6)


@pytest.mark.parametrize("vdt", [np.float32, np.float16])
def test_weighted_value_sum_compact_scores(vdt):
    """compact=True: z[h, t] is the score of idx[h, t] (the selected scores side by side, as the
    GPU cache copies them back): the same sums as over scores per token."""
    rng = np.random.default_rng(3)
    n, d, g, c = 3000, 64, 16, 256
    T = rng.standard_normal((HQ, g, c)).astype(np.float32)
    P = rng.integers(0, c, size=(HKV, n, g)).astype(np.uint8)
    idx, counts, _, _, zs = ref.packed_select_ref(T, P, Q2K, n, 0.9)
    z = ref.packed_scores_ref(T, P, Q2K, n)
    V = rng.standard_normal((HKV, n, d)).astype(vdt)
    got = kc.weighted_value_sum(zs, idx, counts, V, Q2K, compact=True)
    want = kc.weighted_value_sum(z, idx, counts, V, Q2K)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
