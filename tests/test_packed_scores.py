"""kernels_cpu.packed (integer-quantized lookup tables, 4 query heads per uint64) against its NumPy
reference (bit-exact: same float32 operations, exact integer sums) and against the float scores
(within the quantization bound g * scale / 2)."""
import numpy as np
import pytest

import kernels_cpu as kc
import references as ref

HQ, HKV = 9, 3
Q2K = (np.arange(HQ) // (HQ // HKV)).astype(np.int32)


def unpack(packed, Hq):
    """tables [R, g, c] uint64 -> Q [Hq, g, c] int64 (each head's 16-bit lane)."""
    Q = np.full((Hq,) + packed.tables.shape[1:], -1, np.int64)
    for r, row in enumerate(packed.lanes):
        for e, h in enumerate(row):
            if h >= 0:
                Q[h] = ((packed.tables[r] >> np.uint64(16 * e)) & np.uint64(0xFFFF)).astype(np.int64)
    return Q


def tables(rng, Hq, g, c, spread=None):
    """Per-head tables with head-dependent magnitude (as real queries have)."""
    mag = rng.uniform(0.05, 20.0, size=(Hq, 1, 1)) if spread is None else spread
    return (rng.standard_normal((Hq, g, c)) * mag).astype(np.float32)


@pytest.mark.parametrize("g,c", [(16, 1024), (32, 1024), (16, 16), (64, 256), (8, 4096)])
def test_pack_lut_matches_reference(g, c):
    rng = np.random.default_rng([g, c])
    T = tables(rng, HQ, g, c)
    packed = kc.pack_lut(T, Q2K)
    Q, scale, offset = ref.pack_lut_ref(T)
    np.testing.assert_array_equal(unpack(packed, HQ), Q)
    np.testing.assert_array_equal(packed.scale, scale)
    np.testing.assert_array_equal(packed.offset, offset)
    assert Q.min() >= 0 and Q.max() * g <= 65535          # no lane can carry into the next
    assert (Q.max(axis=(1, 2)) == 65535 // g).all()          # each head uses its full range


@pytest.mark.parametrize("n", [0, 1, 7, 1023, 1024, 1025, 5000])
@pytest.mark.parametrize("g,c,pdtype", [(16, 1024, np.int16), (32, 1024, np.int16), (16, 256, np.uint8),
                                        (64, 16, np.int16), (32, 32768, np.int16)])
def test_packed_scores(n, g, c, pdtype):
    rng = np.random.default_rng([n, g, c])
    T = tables(rng, HQ, g, c)
    cap = n + 11                                               # indices wider than the live tokens
    P = rng.integers(0, c, size=(HKV, cap, g)).astype(pdtype)
    P[:, :min(n, 3)] = c - 1                                   # the largest index is reachable
    packed = kc.pack_lut(T, Q2K)
    z = kc.packed_scores(packed, ref.group_major(P), n)
    assert z.shape == (HQ, n) and z.dtype == np.float32
    want = ref.packed_scores_ref(T, P, Q2K, n)
    np.testing.assert_array_equal(z, want)
    # against the float scores: within the rounding of g table entries, plus float32 rounding
    exact = ref.approx_scores_ref(T, P, Q2K, n)
    bound = g * packed.scale[:, None] / 2 + 1e-6 * (np.abs(exact) + g * np.abs(T).max(axis=(1, 2))[:, None])
    assert (np.abs(z - exact) <= bound).all()
    out = np.full((HQ, n + 5), np.nan, np.float32)
    z2 = kc.packed_scores(packed, ref.group_major(P), n, out=out)
    assert np.shares_memory(z2, out) or n == 0
    np.testing.assert_array_equal(z2, z)
    assert np.isnan(out[:, n:]).all()                          # nothing written past n


@pytest.mark.parametrize("Hq,Hkv,shuffle", [(4, 4, False), (6, 3, False), (8, 2, False), (10, 2, False),
                                            (8, 1, False), (12, 3, True), (9, 1, False)])
def test_packed_scores_any_gqa_grouping(Hq, Hkv, shuffle):
    """1..9 query heads per kv-head: more than 4 take several table rows (passes)."""
    rng = np.random.default_rng([Hq, Hkv, shuffle])
    q2k = (np.arange(Hq) // (Hq // Hkv)).astype(np.int32)
    if shuffle:
        q2k = rng.permutation(q2k).astype(np.int32)
    g, c, n = 16, 256, 2100
    T = tables(rng, Hq, g, c)
    P = rng.integers(0, c, size=(Hkv, n, g)).astype(np.int16)
    lanes = kc.lane_map(q2k, Hkv)
    heads = lanes[lanes >= 0]
    assert sorted(heads.tolist()) == list(range(Hq))           # every head in exactly one lane
    z = kc.packed_scores(kc.pack_lut(T, q2k, lanes=lanes), ref.group_major(P), n)
    np.testing.assert_array_equal(z, ref.packed_scores_ref(T, P, q2k, n))


def test_packed_degenerate_tables():
    """A constant table (zero width) scores its offset exactly; a head with one huge entry still
    keeps every sum within 16 bits."""
    rng = np.random.default_rng(1)
    g, c, n = 16, 64, 300
    T = rng.standard_normal((HQ, g, c)).astype(np.float32)
    T[0] = 0.25
    T[1, 3, 7] = 1e4
    P = rng.integers(0, c, size=(HKV, n, g)).astype(np.uint8)
    P[0, 0, 3] = 7
    z = kc.packed_scores(kc.pack_lut(T, Q2K), ref.group_major(P), n)
    np.testing.assert_array_equal(z[0], np.float32(0.25 * g))
    np.testing.assert_array_equal(z, ref.packed_scores_ref(T, P, Q2K, n))
    assert abs(z[1, 0] - ref.approx_scores_ref(T, P, Q2K, n)[1, 0]) <= g * 1e4 / (65535 // g) / 2 + 1e-2


def test_packed_scores_rejects_bad_input():
    T = np.zeros((HQ, 16, 256), np.float32)
    packed = kc.pack_lut(T, Q2K)
    P = np.zeros((HKV, 16, 100), np.int16)
    with pytest.raises(TypeError):
        kc.packed_scores(packed, P.astype(np.int32), 10)
    with pytest.raises(ValueError):
        kc.packed_scores(packed, P, 101)                       # beyond the capacity
    with pytest.raises(ValueError):
        kc.packed_scores(packed, np.zeros((HKV, 8, 100), np.int16), 10)   # wrong group count
