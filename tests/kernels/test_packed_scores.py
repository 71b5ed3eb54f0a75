"""kernels_cpu.packed (integer-quantized lookup tables, 4 query heads per uint64) and the scoring
pass of kernels_cpu.level_select (their lane sums kept as uint16 levels, counted into buckets), as
the one-call step hca_decode_attend leaves them in its scratch: against their NumPy references
(bit-exact: same float32 operations, exact integer sums) and against the float scores (within the
quantization bound g * scale / 2)."""
import numpy as np
import pytest

import kernels_cpu as kc
import references as ref
from kernels_cpu.level_select import NB
from kernel_steps import D, HKV, HQ, Q2K, packed_store_step as store_step



def unpack(packed, Hq):
    """tables [R, g, c] uint64 -> Q [Hq, g, c] int64 (each head's 16-bit lane)."""
    Q = np.full((Hq,) + packed.tables.shape[1:], -1, np.int64)
    for r, row in enumerate(packed.lanes):
        for e, h in enumerate(row):
            if h >= 0:
                Q[h] = ((packed.tables[r] >> np.uint64(16 * e)) & np.uint64(0xFFFF)).astype(np.int64)
    return Q


def inputs(rng, Hq, Hkv, g, c, n_cap, pdtype=None):
    """Queries with head-dependent magnitude (as real queries have), codebooks, token-major indices."""
    q = (rng.standard_normal((Hq, D)) * rng.uniform(0.05, 20.0, size=(Hq, 1))).astype(np.float32)
    C = rng.standard_normal((Hkv, g, c, D // g)).astype(np.float32)
    pdtype = pdtype or (np.int16 if c > 256 else np.uint8)
    return q, C, rng.integers(0, c, size=(Hkv, n_cap, g)).astype(pdtype)


def check_levels(packed, T, lev, H, P, q2k, n):
    """lev are the lane sums of pack_lut_ref(T)'s tables (z = scale * lev + offset as
    packed_scores_ref), and H their bucket counts."""
    z = lev.astype(np.float32) * packed.scale[:, None] + packed.offset[:, None]
    np.testing.assert_array_equal(z, ref.packed_scores_ref(T, P, q2k, n))
    for h in range(T.shape[0]):
        b = np.minimum((packed.top[h] - lev[h]) >> packed.shift[h], NB - 1)
        np.testing.assert_array_equal(H[h], np.bincount(b, minlength=NB))


@pytest.mark.parametrize("g,c", [(16, 1024), (32, 1024), (64, 1024), (16, 16), (32, 256), (64, 256), (8, 4096)])
def test_tables_match_reference(g, c):
    rng = np.random.default_rng([g, c])
    q, C, P = inputs(rng, HQ, HKV, g, c, 40)
    _, _, packed, T, _, _ = store_step(q, C, P, 40, Q2K)
    np.testing.assert_allclose(T, ref.build_lut_ref(q, C, Q2K), rtol=1e-5, atol=1e-5 * np.abs(T).max())
    Q, scale, offset = ref.pack_lut_ref(T)
    np.testing.assert_array_equal(unpack(packed, HQ), Q)
    np.testing.assert_array_equal(packed.scale, scale)
    np.testing.assert_array_equal(packed.offset, offset)
    np.testing.assert_array_equal(packed.top, Q.max(axis=2).sum(axis=1))    # no level exceeds top
    assert Q.min() >= 0 and Q.max() * g <= 65535          # no lane can carry into the next
    assert (Q.max(axis=(1, 2)) == 65535 // g).all()          # each head uses its full range
    w = packed.scale.astype(np.float64) * 2.0 ** packed.shift
    assert ((packed.shift == 0) | (w <= 1 / 32)).all()
    assert ((packed.shift == 15) | (2 * w > 1 / 32)).all()                  # the widest such bucket


@pytest.mark.parametrize("n", [1, 7, 1023, 1024, 1025, 5000])
@pytest.mark.parametrize("g,c,pdtype", [(16, 1024, np.int16), (32, 1024, np.int16), (16, 256, np.uint8),
                                        (64, 16, np.int16), (32, 32768, np.int16)])
def test_levels(n, g, c, pdtype):
    rng = np.random.default_rng([n, g, c])
    q, C, P = inputs(rng, HQ, HKV, g, c, n + 11, pdtype)       # indices wider than the live tokens
    P[:, :min(n, 3)] = c - 1                                   # the largest index is reachable
    _, _, packed, T, lev, H = store_step(q, C, P, n, Q2K)
    check_levels(packed, T, lev, H, P, Q2K, n)
    # against the float scores: within the rounding of g table entries, plus float32 rounding
    z = lev.astype(np.float32) * packed.scale[:, None] + packed.offset[:, None]
    exact = ref.approx_scores_ref(T, P, Q2K, n)
    bound = g * packed.scale[:, None] / 2 + 1e-6 * (np.abs(exact) + g * np.abs(T).max(axis=(1, 2))[:, None])
    assert (np.abs(z - exact) <= bound).all()


@pytest.mark.parametrize("Hq,Hkv,shuffle", [(4, 4, False), (6, 3, False), (8, 2, False), (10, 2, False),
                                            (8, 1, False), (12, 3, True), (9, 1, False)])
def test_any_gqa_grouping(Hq, Hkv, shuffle):
    """1..9 query heads per kv-head: more than 4 take several table rows (passes); any q_to_kv
    order (the whole step against its reference too)."""
    rng = np.random.default_rng([Hq, Hkv, shuffle])
    q2k = (np.arange(Hq) // (Hq // Hkv)).astype(np.int32)
    if shuffle:
        q2k = rng.permutation(q2k).astype(np.int32)
    g, c, n = 16, 256, 2100
    q, C, P = inputs(rng, Hq, Hkv, g, c, n, np.int16)
    q /= np.abs(q).max(axis=1, keepdims=True)
    lanes = kc.lane_map(q2k, Hkv)
    assert sorted(lanes[lanes >= 0].tolist()) == list(range(Hq))  # every head in exactly one lane
    V = rng.standard_normal((Hkv, n, D)).astype(np.float32)
    o, _, packed, T, lev, H = store_step(q, C, P, n, q2k, V=V)
    np.testing.assert_allclose(T, ref.build_lut_ref(q, C, q2k), rtol=1e-5, atol=1e-5 * np.abs(T).max())
    check_levels(packed, T, lev, H, P, q2k, n)
    empty = np.zeros((Hkv, 1, D), np.float32)
    want = ref.hca_decode_attend_ref(q, empty[:, 0], empty[:, 0], empty, empty, 0, C, P, n, V, 0.9, q2k)
    np.testing.assert_allclose(o, want, rtol=1e-4, atol=1e-4)


def test_degenerate_tables():
    """A constant table (zero width: a query of zeros) scores its offset exactly; a head with one
    huge entry still keeps every sum within 16 bits."""
    rng = np.random.default_rng(1)
    g, c, n = 16, 64, 300
    q, C, P = inputs(rng, HQ, HKV, g, c, n)
    q[0] = 0.0
    C[0, 3, 7] = 1e4
    P[0, 0, 3] = 7
    _, _, packed, T, lev, H = store_step(q, C, P, n, Q2K)
    check_levels(packed, T, lev, H, P, Q2K, n)
    z = lev.astype(np.float32) * packed.scale[:, None] + packed.offset[:, None]
    np.testing.assert_array_equal(z[0], np.float32(0.0))
    wide = np.abs(T[1]).max()
    assert wide > 1e3 and abs(z[1, 0] - ref.approx_scores_ref(T, P, Q2K, n)[1, 0]) <= g * wide / (65535 // g) + 1e-2
