"""kernels_cpu.fastscan (4-bit codes, pshufb lookups) against its NumPy references (its tables and
levels as the one-call step leaves them in its scratch), and the nibble pairs against the product
codebook they index."""
import numpy as np
import pytest

import kernels_cpu as kc
from kernels_cpu import fastscan as fs
from kernels_cpu.level_select import NB
from references import fs_levels_ref, fs_lut_ref, hca_decode_attend_fs_ref, levels_select_ref
from kernel_steps import factors, fastscan_store_step as store_step

pytestmark = pytest.mark.skipif(not fs.available(), reason="fast scan needs AVX2 (the generic path is tested "
                                                           "in test_hca_cache.py on every CPU)")


@pytest.mark.parametrize("Hq,Hkv,G,ds", [(9, 3, 64, 1), (8, 2, 32, 2), (4, 4, 64, 1), (10, 2, 16, 1)])
def test_lut_matches_reference(Hq, Hkv, G, ds):
    rng = np.random.default_rng([Hq, G, ds])
    q2k = np.arange(Hq) // (Hq // Hkv)
    q = rng.standard_normal((Hq, G * ds)).astype(np.float32)
    F = factors(rng, Hkv, G, ds)
    lut, _, _ = store_step(q, F, rng.integers(0, 256, (Hkv, G // 2, 64), dtype=np.uint8), 64, q2k)
    Q, scale, offset = fs_lut_ref(q, F, q2k)
    np.testing.assert_array_equal(lut.tabs, Q)
    np.testing.assert_array_equal(lut.scale, scale)
    np.testing.assert_array_equal(lut.offset, offset)
    np.testing.assert_array_equal(lut.top, Q.max(axis=2).sum(axis=1))
    assert lut.tabs.max() <= fs.QMAX and (lut.tabs.max(axis=2) == fs.QMAX).any(axis=1).all()   # widest row spans all


@pytest.mark.parametrize("n", [5, 32, 1000, 1024, 4133])
@pytest.mark.parametrize("Hq,Hkv,G", [(9, 3, 64), (10, 2, 64), (8, 1, 32), (2, 2, 64), (4, 2, 64)])
def test_levels_match_reference(n, Hq, Hkv, G):
    """Every block kernel (heads per kv-head 1, 2, 3, 5 = 4 + 1 and 8 = 4 + 4),
    tails that are not a block, and codes beyond n that must not be read into the counts."""
    rng = np.random.default_rng([n, Hq, G])
    q2k = np.arange(Hq) // (Hq // Hkv)
    PT = rng.integers(0, 256, (Hkv, G // 2, n + 40), dtype=np.uint8)
    lut, lev, counts = store_step(rng.standard_normal((Hq, G)).astype(np.float32), factors(rng, Hkv, G, 1), PT,
                                  n, q2k)
    want = fs_levels_ref(lut.tabs.astype(np.int64), PT, q2k, n)
    np.testing.assert_array_equal(lev, want)
    for h in range(Hq):
        b = np.minimum((lut.top[h] - want[h]) >> lut.shift[h], NB - 1)
        np.testing.assert_array_equal(counts[h], np.bincount(b, minlength=NB))


def test_nibble_pairs_index_the_product_codebook():
    """encode_pairs equals encode_keys over the factor codebooks, packed two per byte; the product
    codebook's centroid of each byte is the two factors' centroids side by side."""
    from minirun.kv.codebooks import pair_product
    rng = np.random.default_rng(3)
    Hkv, G, ds, m = 3, 64, 1, 300
    F = factors(rng, Hkv, G, ds)
    K = rng.standard_normal((Hkv, m, G * ds)).astype(np.float32)
    codes = fs.encode_pairs(K, F)
    C = F.transpose(0, 1, 3, 2)                                   # [Hkv, G, 16, ds]
    want = kc.encode_keys(K, np.ascontiguousarray(C))             # [Hkv, m, G]
    np.testing.assert_array_equal(codes, want[..., 0::2] | (want[..., 1::2] << 4))
    prod = pair_product(C)                                        # [Hkv, G/2, 256, 2 ds]
    p = 5
    np.testing.assert_array_equal(prod[1, p, codes[1, 7, p]], np.concatenate([C[1, 2 * p, want[1, 7, 2 * p]],
                                                                             C[1, 2 * p + 1, want[1, 7, 2 * p + 1]]]))


@pytest.mark.parametrize("pool_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n_exact,n_store,tau,sel_cap", [(272, 5000, 0.9, 0), (272, 5000, 1.0, 0), (16, 1, 0.9, 0),
                                                         (272, 0, 0.9, 0), (0, 3000, 0.5, 0), (272, 16383, 0.9, 0),
                                                         (272, 5000, 0.9, 30), (272, 5000, 1.0, 8)])
def test_fused_step_matches_reference(pool_dtype, n_exact, n_store, tau, sel_cap):
    rng = np.random.default_rng([n_exact, n_store, int(tau * 10)])
    Hq, Hkv, D = 9, 3, 64
    q2k = (np.arange(Hq) // 3).astype(np.int32)
    cap = n_store + 13
    q = (rng.standard_normal((Hq, D)) / np.sqrt(D) * 3).astype(np.float32)
    k, v = rng.standard_normal((2, Hkv, D)).astype(np.float32)
    EK, EV = rng.standard_normal((2, Hkv, n_exact + 5, D)).astype(pool_dtype)
    V = rng.standard_normal((Hkv, cap, D)).astype(pool_dtype)
    F = factors(rng, Hkv, D, 1)
    PT = rng.integers(0, 256, (Hkv, D // 2, cap), dtype=np.uint8)
    lut = fs.FastScanLUT(Hq, D, kc.lane_map(q2k, Hkv))
    counts = np.zeros(Hq, np.int32)
    z, idx = np.full((Hq, cap), np.nan, np.float32), np.zeros((Hq, cap), np.int32)
    codes = np.zeros((Hkv, 1, D // 2), np.uint8)
    enc = (n_exact - 1, codes) if n_exact and n_store else None
    o = fs.hca_decode_attend_fs(q, k, v, EK, EV, n_exact, F, PT, n_store, V, tau, q2k, lut, z, idx, counts,
                                encode=enc, cap=sel_cap)
    want = hca_decode_attend_fs_ref(q, k, v, EK, EV, n_exact, F, PT, n_store, V, tau, q2k, cap=sel_cap)
    np.testing.assert_allclose(o, want, rtol=1e-4, atol=1e-4)
    if n_store:
        Q, scale, offset = fs_lut_ref(q, F, q2k)
        _, cnt, _, _, _ = levels_select_ref(fs_levels_ref(Q, PT, q2k, n_store), Q.max(axis=2).sum(axis=1),
                                            scale, offset, tau, sel_cap)
        np.testing.assert_array_equal(counts, cnt)
        assert sel_cap == 0 or (counts <= sel_cap).all()
    if enc is not None:
        ek = EK[:, n_exact - 1:n_exact]
        np.testing.assert_array_equal(codes, fs.encode_pairs(ek, F))


def test_scores_track_the_float_scores():
    """z = scale * level + offset stays within G * scale / 2 of the float LUT sums (the bound in the
    module docstring): the quantization is what the levels lose, nothing else."""
    rng = np.random.default_rng(9)
    Hq, Hkv, G, n = 9, 3, 64, 2000
    q2k = np.arange(Hq) // 3
    q = rng.standard_normal((Hq, G)).astype(np.float32)
    F = factors(rng, Hkv, G, 1)
    PT = rng.integers(0, 256, (Hkv, G // 2, n), dtype=np.uint8)
    lut, lev, _ = store_step(q, F, PT, n, q2k)
    z = lev.astype(np.float64) * lut.scale[:, None] + lut.offset[:, None]
    codes = np.stack([PT & 15, PT >> 4], 2).reshape(Hkv, G, n)      # groups 2p, 2p + 1
    exact = np.stack([(q[h][:, None] * F[q2k[h], np.arange(G), 0][np.arange(G)[:, None], codes[q2k[h]]]).sum(0)
                      for h in range(Hq)])
    err = np.abs(z - exact).max(axis=1)
    assert (err <= G * lut.scale / 2 + 1e-4).all()
    assert (err > 0).any()                                          # (the bound is not trivially met)
