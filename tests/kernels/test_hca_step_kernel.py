"""kernels_cpu.hca_decode_attend (one decode token's whole HCA attention in one call) against the
composition of the NumPy references, and against the store's part summed by weighted_value_sum."""
import numpy as np
import pytest

import kernels_cpu as kc
import references as ref
from kernels_cpu.level_select import NB
from kernel_steps import D, HKV, HQ, Q2K, run_fused, setup



@pytest.mark.parametrize("pool_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n_exact,n_store,tau", [(272, 5000, 0.9), (272, 5000, 1.0), (16, 1, 0.9), (272, 0, 0.9),
                                                 (0, 3000, 0.5)])
@pytest.mark.parametrize("g,c", [(16, 1024), (32, 256)])
def test_hca_decode_attend(pool_dtype, n_exact, n_store, tau, g, c):
    rng = np.random.default_rng([n_exact, n_store, g, c, int(tau * 10)])
    q, k, v, EK, EV, C, P, V, cap = setup(rng, n_exact, n_store, g, c, pool_dtype)
    o, counts, _, T = run_fused(q, k, v, EK, EV, n_exact, C, P, n_store, V, tau, cap)
    assert o.shape == (HQ, D) and o.dtype == np.float32 and np.isfinite(o).all()
    want = ref.hca_decode_attend_ref(q, k, v, EK, EV, n_exact, C, P, n_store, V, tau, Q2K)
    np.testing.assert_allclose(o, want, rtol=1e-4, atol=1e-4)
    # the same step with the store's part selected by the reference on the step's own table T
    # (bit for bit the same selection) and summed by weighted_value_sum, the exact tier and the
    # merge by their references
    parts = [ref.attend_exact_ref(q, EK, EV, Q2K, n_exact)]
    parts.append((v[Q2K], np.einsum("hd,hd->h", q, k[Q2K]), np.ones(HQ, np.float32)))
    if n_store:
        idx, cnt, _, _, zs = ref.packed_select_ref(T, P, Q2K, n_store, tau)
        parts.append(kc.weighted_value_sum(zs, idx, cnt, V, Q2K, compact=True))
        np.testing.assert_array_equal(counts, cnt)
    step = ref.lse_merge_ref(*[np.stack(x) for x in zip(*parts)])[0]
    np.testing.assert_allclose(o, step, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hq,hkv,d,n_exact,n_store", [(8, 1, 48, 1500, 2100), (2, 2, 48, 40, 900),
                                                      (5, 1, 64, 600, 1300)])
def test_hca_decode_attend_other_shapes(hq, hkv, d, n_exact, n_store):
    # more than 4 query heads per kv-head (two lane rows, one partly empty), one head per kv-head
    # (three empty lanes), and a sinks + ring longer than a value-sum range (its scores share the
    # range task's scratch)
    rng = np.random.default_rng([hq, hkv, d, n_exact])
    g, c = d // 4, 256
    q2k = (np.arange(hq) // (hq // hkv)).astype(np.int32)
    q = (rng.standard_normal((hq, d)) / np.sqrt(d) * 3).astype(np.float32)
    k, v = rng.standard_normal((2, hkv, d)).astype(np.float32)
    EK, EV = rng.standard_normal((2, hkv, n_exact, d)).astype(np.float32)
    C = rng.standard_normal((hkv, g, c, d // g)).astype(np.float32)
    P = rng.integers(0, c, size=(hkv, n_store, g)).astype(np.uint8)
    V = rng.standard_normal((hkv, n_store, d)).astype(np.float32)
    lanes = kc.lane_map(q2k, hkv)
    packed = kc.PackedLUT(np.empty((lanes.shape[0], g, c), np.uint64), lanes, np.empty(hq, np.float32),
                          np.empty(hq, np.float32))
    o = kc.hca_decode_attend(q, k, v, EK, EV, n_exact, ref.codebooks_t(C), ref.group_major(P), n_store, V,
                             0.9, q2k, packed, np.empty((hq, g, c), np.float32), np.empty((hq, n_store), np.float32),
                             np.empty((hq, n_store), np.int32))
    want = ref.hca_decode_attend_ref(q, k, v, EK, EV, n_exact, C, P, n_store, V, 0.9, q2k)
    np.testing.assert_allclose(o, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tau", [0.5, 0.9, 0.99])
def test_hca_decode_attend_exact_fallback(tau):
    """Tables whose top is far above every store score (a centroid no key uses scores high): each
    head selects by the exact fallback on the float scores (kernels_cpu.select, the minimal set of
    threshold_select_ref), and the value sum then reads the same set from the levels (every level
    >= the least selected one)."""
    rng = np.random.default_rng(5)
    n = 3000
    q, k, v, EK, EV, C, P, V, cap = setup(rng, 272, n, 16, 256, np.float32)
    q = np.abs(q)
    C *= 0.2
    C[:, :, 0] = 50.0                                                # never indexed: top far above
    P[P == 0] = 1
    T = ref.build_lut_ref(q, C, Q2K)
    o, counts, packed, _ = run_fused(q, k, v, EK, EV, 272, C, P, n, V, tau, cap)
    w = packed.scale.astype(np.float64) * 2.0 ** packed.shift
    z = ref.packed_scores_ref(T, P, Q2K, n)
    assert ((packed.top * packed.scale - (z.max(axis=1) - packed.offset)) > NB * w).all()   # really loose
    want = ref.hca_decode_attend_ref(q, k, v, EK, EV, 272, C, P, n, V, tau, Q2K)
    np.testing.assert_allclose(o, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(counts, ref.packed_select_ref(T, P, Q2K, n, tau)[1])
    np.testing.assert_array_equal(counts, ref.threshold_select_ref(z, tau)[1])


@pytest.mark.parametrize("tau,sel_cap", [(0.9, 40), (1.0, 7), (0.5, 1), (0.9, 100000)])
def test_hca_decode_attend_capped(tau, sel_cap):
    """The cap inside the fused step: at most sel_cap tokens per head, whole level buckets from the
    top, as the reference's levels_select_ref cuts them (a cap above the selection changes nothing)."""
    rng = np.random.default_rng([7, int(tau * 10), sel_cap])
    q, k, v, EK, EV, C, P, V, cap = setup(rng, 272, 5000, 16, 1024, np.float32)
    g, c = C.shape[1], C.shape[2]
    lanes = kc.lane_map(Q2K, HKV)
    packed = kc.PackedLUT(np.empty((lanes.shape[0], g, c), np.uint64), lanes, np.empty(HQ, np.float32),
                          np.empty(HQ, np.float32))
    counts = np.zeros(HQ, np.int32)
    o = kc.hca_decode_attend(q, k, v, EK, EV, 272, ref.codebooks_t(C), ref.group_major(P), 5000, V, tau, Q2K,
                             packed, np.empty((HQ, g, c), np.float32), np.zeros((HQ, cap), np.float32),
                             np.zeros((HQ, cap), np.int32), counts, cap=sel_cap)
    want = ref.hca_decode_attend_ref(q, k, v, EK, EV, 272, C, P, 5000, V, tau, Q2K, cap=sel_cap)
    np.testing.assert_allclose(o, want, rtol=1e-4, atol=1e-4)
    _, rcounts, _, _, _ = ref.packed_select_ref(ref.build_lut_ref(q, C, Q2K), P, Q2K, 5000, tau, sel_cap)
    np.testing.assert_array_equal(counts, rcounts)
    assert (counts >= 1).all() and ((counts <= sel_cap).all() or sel_cap == 1)   # (a top bucket stays whole)
    free = run_fused(q, k, v, EK, EV, 272, C, P, 5000, V, tau, cap)[1]
    assert (counts <= free).all() and (sel_cap >= free.max() or (counts < free).any())
