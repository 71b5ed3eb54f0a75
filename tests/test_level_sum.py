"""kernels_cpu.level_value_sum (the store's part of a decode step read from the integer levels, no
selection list, one value-row read per token of a kv-head's union) against weighted_value_sum_ref
over packed_select_ref's selection, for GQA layouts with 1, 3 and 8 query heads per kv-head."""
import numpy as np
import pytest

import kernels_cpu as kc
import references as ref
from kernels_cpu.level_select import NB


def case(rng, Hq, Hkv, g, c, n, mag, vdt, d=64):
    q2k = (np.arange(Hq) // (Hq // Hkv)).astype(np.int32)
    T = (rng.standard_normal((Hq, g, c)) * mag * rng.uniform(0.1, 3.0, (Hq, 1, 1))).astype(np.float32)
    P = rng.integers(0, c, size=(Hkv, n + 5, g)).astype(np.int16 if c > 256 else np.uint8)
    V = rng.standard_normal((Hkv, n + 5, d)).astype(vdt)
    return q2k, T, P, V


def check(T, P, V, q2k, n, tau):
    packed = kc.pack_lut(T, q2k)
    o, m, l, counts = kc.level_value_sum(packed, kc.group_major(P), n, tau, V)
    idx, rc, rm, _, zs = ref.packed_select_ref(T, P, q2k, n, tau)
    np.testing.assert_array_equal(counts, rc)
    z = ref.packed_scores_ref(T, P, q2k, n)
    ro = ref.weighted_value_sum_ref(z, idx, rc, V, q2k)[0]
    for h in range(len(q2k)):
        if rc[h] == 0:
            assert m[h] == -np.inf and l[h] == 0 and (o[h] == 0).all()
            continue
        zh = zs[h, :rc[h]].astype(np.float64)
        # m: at or above the best score, by less than one level bucket (+ float rounding)
        w = float(packed.scale[h]) * 2.0 ** int(packed.shift[h])
        assert rm[h] <= m[h] <= rm[h] + w + 1e-5 * max(1.0, abs(rm[h]))
        # the same softmax: l against the selection's exact sum at this m, o against the reference
        want_l = np.exp(zh - np.float64(m[h])).sum()
        assert abs(l[h] - want_l) <= 1e-5 * want_l
        np.testing.assert_allclose(o[h], ro[h], rtol=2e-5, atol=2e-6)
    return counts


@pytest.mark.parametrize("Hq,Hkv", [(9, 3), (8, 1), (4, 4)])
@pytest.mark.parametrize("n", [1, 63, 1000, 2500])
@pytest.mark.parametrize("tau", [0.9, 0.5, 1.0, 0.0])
def test_level_value_sum_matches_reference(Hq, Hkv, n, tau):
    rng = np.random.default_rng([Hq, Hkv, n, int(tau * 10)])
    q2k, T, P, V = case(rng, Hq, Hkv, 16, 256, n, 1.0, np.float32)
    counts = check(T, P, V, q2k, n, tau)
    if tau >= 1:
        assert (counts == n).all()
    if tau <= 0:
        assert (counts == 0).all()


@pytest.mark.parametrize("vdt", [np.float32, np.float16])
@pytest.mark.parametrize("g,c,mag", [(16, 1024, 3.0), (32, 1024, 0.5), (8, 64, 40.0)])
def test_level_value_sum_pools_and_shapes(vdt, g, c, mag):
    rng = np.random.default_rng([g, c, int(mag)])
    q2k, T, P, V = case(rng, 9, 3, g, c, 5000, mag, vdt)
    check(T, P, V, q2k, 5000, 0.9)


def test_level_value_sum_exact_fallback():
    """A head whose top is too loose selects by threshold_select on the float scores; the value sum
    then reads the same set from the levels (every level >= the least selected one)."""
    rng = np.random.default_rng(5)
    Hq, Hkv, g, c, n = 9, 3, 16, 256, 3000
    q2k = (np.arange(Hq) // 3).astype(np.int32)
    T = (rng.standard_normal((Hq, g, c)) * 0.2).astype(np.float32)
    T[:, :, 0] = 50.0                                                # never indexed: top far above
    P = rng.integers(1, c, size=(Hkv, n, g)).astype(np.uint8)
    V = rng.standard_normal((Hkv, n, 64)).astype(np.float32)
    packed = kc.pack_lut(T, q2k)
    w = packed.scale.astype(np.float64) * 2.0 ** packed.shift
    z = ref.packed_scores_ref(T, P, q2k, n)
    assert ((packed.top * packed.scale - (z.max(axis=1) - packed.offset)) > NB * w).all()
    counts = check(T, P, V, q2k, n, 0.9)
    np.testing.assert_array_equal(counts, ref.threshold_select_ref(z, 0.9)[1])


def test_level_value_sum_rejects_bad_pool():
    rng = np.random.default_rng(0)
    q2k, T, P, V = case(rng, 9, 3, 16, 256, 100, 1.0, np.float32)
    packed = kc.pack_lut(T, q2k)
    with pytest.raises(ValueError, match="V must be"):
        kc.level_value_sum(packed, kc.group_major(P), 100, 0.9, V[:2])
    with pytest.raises(ValueError, match="V must be"):
        kc.level_value_sum(packed, kc.group_major(P), 100, 0.9, V[:, :50])
