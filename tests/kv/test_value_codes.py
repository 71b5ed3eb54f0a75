"""The HCA store's quantized values (kv_values q8 / q4): the runtime's encoder and decoder
(minirun/kv/value_codes.py) against the NumPy references, and every CPU value sum that reads the
codes (kernels_cpu.value_rows inside weighted_value_sum, the one-call steps of hca_step, fastscan
and exact_step, rescore) against the references summing the decoded rows."""
import numpy as np
import pytest
import torch

import kernels_cpu as kc
import references as ref
from kernels_cpu import fastscan as fs
from minirun.errors import MiniRunError
from minirun.kv.value_codes import ValueCodes, value_codes

HQ, HKV, D = 9, 3, 64
Q2K = (np.arange(HQ) // (HQ // HKV)).astype(np.int32)
KINDS = ["q8", "q4"]


def values(rng, shape, outliers=True):
    """Values as a model makes them: mostly small, a few large channels, some constant groups."""
    V = rng.standard_normal(shape).astype(np.float32)
    if outliers:
        V[..., 5] *= 20
        V[..., 0, :32] = 0.75                # a constant group (scale 0 at q4's minimum)
    return V


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_encode_matches_reference(kind, d, dtype):
    rng = np.random.default_rng([d, len(kind), dtype.itemsize])
    V = torch.from_numpy(values(rng, (3, 40, d))).to(dtype)
    codes = ValueCodes(kind, d)
    rows = codes.encode(V)
    assert rows.dtype == torch.uint8 and rows.shape == (3, 40, codes.width)
    want = ref.encode_values_ref(V.float().numpy(), kind)
    np.testing.assert_array_equal(rows.numpy(), want)
    np.testing.assert_array_equal(codes.decode(rows).numpy(), ref.decode_values_ref(want, kind, d))


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_error_is_half_a_step(kind):
    """Each value comes back within half its group's step (plus the float16 rounding of the scale
    and minimum), and a constant group exactly."""
    rng = np.random.default_rng(len(kind))
    V = values(rng, (2, 50, D))
    back = ref.decode_values_ref(ref.encode_values_ref(V, kind), kind, D)
    g = V.reshape(2, 50, D // 32, 32)
    step = (np.abs(g).max(-1) / 127) if kind == "q8" else (g.max(-1) - g.min(-1)) / 15
    err = np.abs(back - V).reshape(g.shape).max(-1)
    assert (err <= 0.5 * step * 1.01 + 1e-3 * np.abs(g).max(-1)).all()
    np.testing.assert_allclose(back[..., 0, :32], 0.75, rtol=1e-3)
    rel = np.abs(back - V).mean() / np.abs(V).mean()
    assert rel < (0.03 if kind == "q8" else 0.3)


def test_sizes_and_bad_shapes():
    assert ValueCodes("q8", 64).row_bytes == 68 and ValueCodes("q4", 64).row_bytes == 40
    assert ValueCodes("q4", 128).row_bytes == 80          # 0.3125x float16's 256
    assert value_codes("float", 64, torch.bfloat16).dtype == torch.float16
    assert value_codes("float", 64, torch.float32).row_bytes == 256
    with pytest.raises(MiniRunError, match="multiple of 32"):
        ValueCodes("q4", 48)
    with pytest.raises(MiniRunError, match="kv_values"):
        ValueCodes("q2", 64)


def quantized_pool(rng, kind, n_cap):
    V = values(rng, (HKV, n_cap, D))
    rows = ref.encode_values_ref(V, kind)
    return rows, ref.decode_values_ref(rows, kind, D)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 700, 5000])
def test_weighted_value_sum_reads_codes(kind, n):
    rng = np.random.default_rng([n, len(kind)])
    rows, Vd = quantized_pool(rng, kind, n + 2)
    z = (rng.standard_normal((HQ, n)) * 3).astype(np.float32)
    counts = rng.integers(0, n + 1, size=HQ).astype(np.int32)
    counts[0], counts[1] = 0, n
    idx = np.zeros((HQ, n), np.int32)
    for h in range(HQ):
        idx[h, :counts[h]] = rng.choice(n, counts[h], replace=False)
    o, m, l = kc.weighted_value_sum(z, idx, counts, rows, Q2K, head_dim=D)
    ro, rm, rl = ref.weighted_value_sum_ref(z, idx, counts, Vd, Q2K)
    np.testing.assert_allclose(o, ro, rtol=1e-4, atol=1e-4 * np.abs(Vd).max())
    np.testing.assert_array_equal(m, rm)
    np.testing.assert_allclose(l, rl, rtol=1e-5)
    with pytest.raises(ValueError, match="head_dim"):
        kc.weighted_value_sum(z, idx, counts, rows, Q2K)


def step_inputs(rng, n_exact, n_store, kind):
    cap = n_store + 13
    q = (rng.standard_normal((HQ, D)) / np.sqrt(D) * 3).astype(np.float32)
    k, v = rng.standard_normal((2, HKV, D)).astype(np.float32)
    EK, EV = rng.standard_normal((2, HKV, n_exact + 5, D)).astype(np.float16)
    rows, Vd = quantized_pool(rng, kind, cap)
    return q, k, v, EK, EV, rows, Vd, cap


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_exact,n_store,tau,rescore", [(272, 5000, 0.9, False), (16, 1, 1.0, False),
                                                         (0, 3000, 0.5, False), (272, 4000, 0.9, True)])
def test_hca_step_reads_codes(kind, n_exact, n_store, tau, rescore):
    from kernel_steps import run_fused
    rng = np.random.default_rng([n_exact, n_store, len(kind), rescore])
    q, k, v, EK, EV, rows, Vd, cap = step_inputs(rng, n_exact, n_store, kind)
    C = rng.standard_normal((HKV, 32, 256, 2)).astype(np.float32)
    P = rng.integers(0, 256, size=(HKV, cap, 32)).astype(np.uint8)
    Kh = rng.standard_normal((HKV, cap, D)).astype(np.float16) if rescore else None
    o, _, _, _ = run_fused(q, k, v, EK, EV, n_exact, C, P, n_store, rows, tau, cap, host_keys=Kh)
    want = ref.hca_decode_attend_ref(q, k, v, EK, EV, n_exact, C, P, n_store, Vd, tau, Q2K, host_keys=Kh)
    np.testing.assert_allclose(o, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_exact,n_store,tau,sel_cap", [(272, 5000, 0.9, 0), (16, 1, 0.9, 0), (272, 5000, 0.9, 30)])
def test_fastscan_step_reads_codes(kind, n_exact, n_store, tau, sel_cap):
    from kernel_steps import factors
    rng = np.random.default_rng([n_exact, n_store, len(kind), sel_cap])
    q, k, v, EK, EV, rows, Vd, cap = step_inputs(rng, n_exact, n_store, kind)
    F = factors(rng, HKV, D, 1)
    PT = rng.integers(0, 256, (HKV, D // 2, cap), dtype=np.uint8)
    lut = fs.FastScanLUT(HQ, D, kc.lane_map(Q2K, HKV))
    z, idx = np.full((HQ, cap), np.nan, np.float32), np.zeros((HQ, cap), np.int32)
    o = fs.hca_decode_attend_fs(q, k, v, EK, EV, n_exact, F, PT, n_store, rows, tau, Q2K, lut, z, idx, cap=sel_cap)
    want = ref.hca_decode_attend_fs_ref(q, k, v, EK, EV, n_exact, F, PT, n_store, Vd, tau, Q2K, cap=sel_cap)
    np.testing.assert_allclose(o, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,tau", [(3000, 0.9), (1025, 1.0)])
def test_exact_step_reads_codes(kind, n, tau):
    rng = np.random.default_rng([n, len(kind)])
    q = (rng.standard_normal((HQ, D)) * 0.3).astype(np.float32)
    K = rng.standard_normal((HKV, n + 3, D)).astype(np.float32)
    rows, Vd = quantized_pool(rng, kind, n + 3)
    EK, EV = rng.standard_normal((2, HKV, 40, D)).astype(np.float32)
    k, v = rng.standard_normal((2, HKV, D)).astype(np.float32)
    z = np.full((HQ, n + 3), np.nan, np.float32)
    o = kc.hca_exact_decode_attend(q, k, v, EK, EV, 40, K, n, rows, tau, Q2K, kc.lane_map(Q2K, HKV), z,
                                   kc.level_hist(HQ))
    want = ref.hca_exact_decode_attend_ref(q, k, v, EK, EV, 40, K, n, Vd, tau, Q2K, z=z[:, :n])
    np.testing.assert_allclose(o, want, rtol=2e-5, atol=2e-5)
