"""Tests for kernels_cuda.

Three layers (the checks both runs share are in tests/support/cuda_checks.py):

* compile checks (tests/kernels/test_cuda_compile.py): every kernels_cuda/*.cu with nvcc
  and NVRTC -- both need no GPU;
* CPU emulation (``emu``): the checked wrappers (tests/support/cuda_wrappers.py, over the runtime's
  launch helpers) and kernels_cuda.encode_keys run the unchanged .cu sources through the fiber SIMT emulator
  (tests/support/cuda_emu.py, needs g++) on small shapes, in forward / reverse /
  random thread orders, against the NumPy references;
* GPU (``gpu``): the same checks on a CUDA device at the specified shapes
  (Hq 9, Hkv 3, d 64, g 16/32, c 256/1024, n 0/1/1000/70000); skipped with the
  reason when cupy or a device is missing.

Tolerances (GPU and emulator alike; references accumulate in float64):
  build_lut       |T - ref| <= 1e-5 + 1e-5 |ref|
  approx_scores   |z - ref| <= 1e-5 * g + 1e-5 |ref|, m likewise, l rtol 1e-4
  threshold       set checks: contains the reference set (up to 1e-5 of the mass
                  lost to float rounding at a bin edge), extras only inside the
                  cut bin (z >= zcut_ref - z_range / n_bins), a top set, mass
                  >= tau S (1 - 1e-5); counts exact for tau <= 0 / >= 1;
                  m exact, l_sel rtol 1e-4 vs the float64 mass of the set
  attend_exact    o: 2e-5 + 1e-4 |ref|, m: 1e-5 + 1e-5 |ref|, l rtol 1e-4 (f16 /
                  bf16 inputs: the reference gets the same upcast values)
  encode_keys     identical codes except near-ties: a differing code must be
                  within 1e-4 (1 + |x|^2) of the reference's squared distance,
                  and at most 0.1 % of the codes may differ
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import cuda_wrappers as cw
import kernels_cuda

HAVE_GPU = kernels_cuda.available()
HAVE_GXX = shutil.which("g++") is not None
NO_GPU_REASON = "no CUDA device / cupy"

torch = pytest.importorskip("torch")

from cuda_checks import (Env, _pq_data, _ref, check_approx_scores, check_attend, check_build_lut,  # noqa: E402
                         check_encode, check_selection, check_threshold, check_threshold_cap, np_,
                         q2k_for)


emu_only = pytest.mark.skipif(not HAVE_GXX, reason="g++ not found (CPU kernel emulator)")
# MINIRUN_EMULATE_GPU_TESTS=1 runs the gpu tests' bodies on the emulator instead
# (slow; checks the test code itself on a machine without a GPU).
EMULATE_GPU = bool(os.environ.get("MINIRUN_EMULATE_GPU_TESTS")) and HAVE_GXX and not HAVE_GPU
GPU_KIND = "emu" if EMULATE_GPU else "gpu"
gpu_only = pytest.mark.skipif(not (HAVE_GPU or EMULATE_GPU), reason=NO_GPU_REASON)

if not HAVE_GPU:
    print(f"kernels_cuda GPU tests skipped: {NO_GPU_REASON}")


# ---------------------------------------------------------------------------
# Emulated runs (CPU): small shapes, several thread orders / device profiles
# ---------------------------------------------------------------------------

EMU_ORDERS = ["forward", "reverse", "random", "greedy", "greedy_reverse"]


@emu_only
@pytest.mark.parametrize("order", EMU_ORDERS)
@pytest.mark.parametrize("g,c", [(16, 256), (32, 1024)])
def test_emu_build_lut(order, g, c):
    check_build_lut(Env("emu", order=order), 9, 3, 64, g, c)


@emu_only
@pytest.mark.parametrize("order", EMU_ORDERS)
@pytest.mark.parametrize(
    "g,c,n,kw",
    [
        (16, 256, 0, {}),
        (16, 256, 1, {}),
        (16, 256, 2500, {"n_cap": 2600, "out_extra": 5}),
        (32, 1024, 700, {}),
        (32, 256, 500, {}),  # uint8, two 16-byte loads per row
        (16, 1024, 300, {}),  # int16, vec16 with 8 codes per load
        (12, 256, 333, {}),  # g*1 % 16 != 0: scalar path
        (16, 256, 999, {"misalign": True}),  # odd address: scalar path
    ],
)
def test_emu_approx_scores(order, g, c, n, kw):
    check_approx_scores(Env("emu", order=order), 9, 3, g, c, n, **kw)


@emu_only
@pytest.mark.parametrize("num_sms,optin", [(4, 227 * 1024), (132, 8 * 1024)])
def test_emu_approx_scores_profiles(num_sms, optin):
    """Many blocks per head; T too large for shared memory -> global-memory path."""
    check_approx_scores(Env("emu", num_sms=num_sms, smem_optin=optin), 9, 3, 16, 256, 5000)


def _z_cases(rng, Hq, n):
    z = (rng.standard_normal((Hq, n)) * 2).astype(np.float32)
    if Hq >= 4 and n >= 8:
        z[1] = (rng.standard_normal(n) * 0.05).astype(np.float32)  # flat: cut inside a crowded bin
        z[2, :] = np.round(z[2] * 4) / 4  # many exact ties
        z[3, :] = -50.0
        z[3, 5] = 10.0  # one dominant token; the rest far below the histogram range
    return z


@emu_only
@pytest.mark.parametrize("order", EMU_ORDERS)
@pytest.mark.parametrize("n", [1, 7, 3000])
def test_emu_threshold_select(order, n):
    rng = np.random.default_rng(10 + n)
    z = _z_cases(rng, 9, n)
    check_threshold(Env("emu", order=order), z, [0.0, 0.3, 0.9, 0.99, 1.0, 1.5])


@emu_only
@pytest.mark.parametrize("order", EMU_ORDERS)
@pytest.mark.parametrize("cap", [1, 5, 40, 2999])
@pytest.mark.parametrize("tau", [0.9, 1.0])
def test_emu_threshold_select_cap(order, cap, tau):
    rng = np.random.default_rng(30 + cap)
    z = _z_cases(rng, 9, 3000)
    z[4, :200] = 3.0                       # a top bin of 200 tokens: alone above small caps
    check_threshold_cap(Env("emu", order=order), z, tau, cap)


@emu_only
def test_emu_threshold_select_stats_out_and_edge_rows():
    env = Env("emu", num_sms=132)
    rng = np.random.default_rng(5)
    z = _z_cases(rng, 9, 4000)
    check_threshold(env, z, [0.5, 0.95], use_stats=True, out_extra=3)
    # n = 0
    with env.ctx():
        idx, counts, m, l_sel = cw.threshold_select(torch.zeros((4, 0)), 0.9)
    assert idx.shape == (4, 0) and (np_(counts) == 0).all() and (np_(m) == -np.inf).all() and (np_(l_sel) == 0).all()
    # all -inf rows and NaN scores
    z = rng.standard_normal((3, 500)).astype(np.float32)
    z[0] = -np.inf
    z[1, ::7] = np.nan
    for tau in (0.9, 1.0):
        with env.ctx():
            idx, counts, m, l_sel = cw.threshold_select(env.t(z), tau)
        idx, counts, m, l_sel = np_(idx), np_(counts), np_(m), np_(l_sel)
        assert counts[0] == 0 and m[0] == -np.inf and l_sel[0] == 0
        sel1 = idx[1, : counts[1]]
        if tau < 1:
            assert not np.isnan(z[1, sel1]).any()
        else:
            assert counts[1] == 500
        assert m[1] == np.nanmax(z[1])


@emu_only
@pytest.mark.parametrize("order", EMU_ORDERS)
@pytest.mark.parametrize("num_sms", [4, 132])
@pytest.mark.parametrize(
    "n,kw",
    [
        (0, {}),
        (1, {}),
        (300, {"n_cap": 320, "dtype": torch.float16}),
        (1100, {"layout": "nhd", "dtype": torch.bfloat16}),
        (1100, {}),
    ],
)
def test_emu_attend_exact(order, num_sms, n, kw):
    check_attend(Env("emu", order=order, num_sms=num_sms), 9, 3, 64, n, **kw)


@emu_only
@pytest.mark.parametrize("num_sms", [1, 132])
@pytest.mark.parametrize("n,valid,kw", [(1100, "ring", {}), (700, "ring", {"dtype": torch.bfloat16, "layout": "nhd"}),
                                        (300, "none", {"dtype": torch.float16})])
def test_emu_attend_exact_valid_mask(num_sms, n, valid, kw):
    """Dead slots (a truncated ring) are left out: against the reference over the live rows only."""
    check_attend(Env("emu", order="random", num_sms=num_sms), 9, 3, 64, n, valid=valid, **kw)


ATTEND_KERNEL_CASES = [
    (9, 3, 64, torch.bfloat16, "auto", "attend_gqa_bf16_g4"),       # SmolLM2: 3 heads a kv head
    (16, 2, 128, torch.float16, "auto", "attend_gqa_f16_g8"),
    (10, 2, 64, torch.float32, "auto", "attend_gqa_f32_g8"),        # G = 5 on the 8-head kernel
    (4, 4, 256, torch.float32, "auto", "attend_gqa_f32_g4"),        # G = 1, d 256: a token a warp
    (9, 3, 64, torch.bfloat16, "partial", "attend_partial_bf16"),
    (4, 2, 96, torch.float32, "auto", "attend_partial_f32"),        # d 96: not d / 8 lanes a token
]


@emu_only
@pytest.mark.parametrize("Hq,Hkv,d,dtype,kernel,want", ATTEND_KERNEL_CASES)
def test_emu_attend_kernel_choice(Hq, Hkv, d, dtype, kernel, want):
    """attend_gqa (a block per kv head and split) where the shape is GQA's, attend_partial else;
    both against the reference, over a masked ring and an unmasked store."""
    for valid in ("ring", None):
        names = check_attend(Env("emu", order="random", num_sms=7), Hq, Hkv, d, 900, dtype=dtype, valid=valid,
                             kernel=kernel)
        assert want in names and {n for n in names if n.startswith("attend")} == {want}


@emu_only
@pytest.mark.parametrize("d", [32, 128, 96])
def test_emu_attend_exact_head_dims(d):
    check_attend(Env("emu", num_sms=132), 4, 2, d, 600, layout="nhd")


@emu_only
@pytest.mark.parametrize("order", EMU_ORDERS)
@pytest.mark.parametrize(
    "d,g,c,n,kw",
    [
        (64, 16, 256, 0, {}),
        (64, 16, 256, 1, {}),
        (64, 32, 256, 128, {"dtype": torch.bfloat16}),  # the last size a warp-sized block takes
        (64, 32, 256, 129, {}),
        (64, 16, 256, 1500, {}),
        (64, 32, 256, 700, {"dtype": torch.float16}),
        (128, 16, 256, 500, {"dtype": torch.bfloat16}),
        (64, 16, 1024, 300, {}),
        (48, 16, 64, 260, {}),  # ds = 3: generic path
        (64, 4, 32, 200, {}),  # ds = 16
        (64, 64, 16, 100, {}),  # ds = 1
    ],
)
def test_emu_encode_keys(order, d, g, c, n, kw):
    check_encode(Env("emu", order=order), 3, d, g, c, n, **kw)


@emu_only
def test_emu_pipeline_end_to_end():
    """encode -> build_lut -> approx_scores -> threshold_select(stats) on the emulator."""
    R = _ref()
    env = Env("emu", num_sms=16)
    rng = np.random.default_rng(7)
    Hq, Hkv, d, g, c, n = 9, 3, 64, 16, 256, 1200
    q = (rng.standard_normal((Hq, d)) / 8).astype(np.float32)
    cb = rng.standard_normal((Hkv, g, c, d // g)).astype(np.float32)
    K = rng.standard_normal((Hkv, n, d)).astype(np.float32)
    q2k = q2k_for(Hq, Hkv)
    with env.ctx():
        P = kernels_cuda.encode_keys(env.t(K), env.t(cb))
        T = cw.build_lut(env.t(q), env.t(cb), env.t(q2k))
        z, stats = cw.approx_scores(T, P, env.t(q2k), n)
        idx, counts, m, l_sel = cw.threshold_select(z, 0.9, stats=stats)
    zr = R.approx_scores_ref(R.build_lut_ref(q, cb, q2k), np_(P), q2k, n)
    np.testing.assert_allclose(np_(z), zr, rtol=1e-5, atol=2e-4)
    check_selection(np_(z), 0.9, idx, counts, m, l_sel)


@emu_only
def test_emu_argument_errors():
    env = Env("emu")
    with env.ctx():
        T = torch.zeros((2, 16, 300))
        with pytest.raises(ValueError):
            cw.approx_scores(T, torch.zeros((1, 10, 16), dtype=torch.uint8), [0, 0], 5)  # c > 256
        with pytest.raises(TypeError):
            cw.approx_scores(T, torch.zeros((1, 10, 16), dtype=torch.int32), [0, 0], 5)
        with pytest.raises(ValueError):
            cw.approx_scores(T, torch.zeros((1, 10, 16), dtype=torch.int16), [0, 0], 11)  # n > n_cap
        with pytest.raises(ValueError):
            cw.build_lut(torch.zeros((2, 64)), torch.zeros((1, 16, 8, 4)), [0, 1])  # q_to_kv >= Hkv
        with pytest.raises(TypeError):
            cw.attend_exact(torch.zeros((2, 64)), torch.zeros((1, 4, 64)), torch.zeros((1, 4, 64)).half(),
                                      [0, 0], 4)  # fmt: skip
        with pytest.raises(ValueError):
            cw.attend_exact(torch.zeros((2, 512)), torch.zeros((1, 4, 512)), torch.zeros((1, 4, 512)),
                                      [0, 0], 4)  # fmt: skip
        for bad in (torch.ones(4, dtype=torch.int32), torch.ones(3, dtype=torch.uint8)):   # valid: dtype, length
            with pytest.raises(ValueError):
                cw.attend_exact(torch.zeros((2, 64)), torch.zeros((1, 4, 64)), torch.zeros((1, 4, 64)),
                                          [0, 0], 4, valid=bad)  # fmt: skip
        with pytest.raises(ValueError):
            kernels_cuda.encode_keys(torch.zeros((1, 4, 64)), torch.zeros((2, 16, 256, 4)))  # Hkv differs
        with pytest.raises(ValueError):
            cw.threshold_select(torch.zeros((2, 5)), float("nan"))
        # degenerate sizes: no launch with an empty grid
        z, (m, l) = cw.approx_scores(torch.zeros((0, 16, 256)), torch.zeros((1, 9, 16), dtype=torch.uint8),
                                               torch.zeros(0, dtype=torch.int32), 9)  # fmt: skip
        assert z.shape == (0, 9) and m.shape == (0,)
        P = kernels_cuda.encode_keys(torch.zeros((0, 5, 64)), torch.zeros((0, 16, 256, 4)))
        assert P.shape == (0, 5, 16) and P.dtype == torch.uint8
        o, m, l = cw.attend_exact(torch.zeros((0, 64)), torch.zeros((1, 4, 64)), torch.zeros((1, 4, 64)),
                                            torch.zeros(0, dtype=torch.int32), 4)  # fmt: skip
        assert o.shape == (0, 64)


# ---------------------------------------------------------------------------
# GPU runs (CUDA device + cupy): the specified shapes
# ---------------------------------------------------------------------------

GPU_N = [0, 1, 1000, 70000]


@gpu_only
@pytest.mark.parametrize("g,c", [(16, 256), (32, 256), (16, 1024), (32, 1024)])
def test_gpu_build_lut(g, c):
    check_build_lut(Env(GPU_KIND, num_sms=132), 9, 3, 64, g, c)


@gpu_only
@pytest.mark.parametrize("n", GPU_N)
@pytest.mark.parametrize("g,c", [(16, 256), (32, 256), (16, 1024), (32, 1024)])
def test_gpu_approx_scores(g, c, n):
    check_approx_scores(Env(GPU_KIND, num_sms=132), 9, 3, g, c, n, n_cap=n + 17, out_extra=3 if n else 0)


@gpu_only
def test_gpu_approx_scores_misaligned():
    check_approx_scores(Env(GPU_KIND, num_sms=132), 9, 3, 16, 256, 1000, misalign=True)


@gpu_only
@pytest.mark.parametrize("n", [1, 1000, 70000])
def test_gpu_threshold_select(n):
    rng = np.random.default_rng(20 + n)
    z = _z_cases(rng, 9, n)
    check_threshold(Env(GPU_KIND, num_sms=132), z, [0.0, 0.5, 0.9, 0.99, 1.0])
    if n > 1:
        check_threshold(Env(GPU_KIND, num_sms=132), z[[0, 4, 5]], [0.9], use_stats=True, out_extra=2)


@gpu_only
@pytest.mark.parametrize("cap", [1, 64, 4096])
@pytest.mark.parametrize("tau", [0.9, 1.0])
def test_gpu_threshold_select_cap(cap, tau):
    rng = np.random.default_rng(40 + cap)
    z = _z_cases(rng, 9, 70000)
    z[4, :5000] = 3.0
    check_threshold_cap(Env(GPU_KIND, num_sms=132), z, tau, cap)


@gpu_only
def test_gpu_threshold_select_on_scores():
    env = Env(GPU_KIND, num_sms=132)
    rng = np.random.default_rng(21)
    T, P = _pq_data(rng, 9, 3, 16, 256, 70000)
    with env.ctx():
        z, stats = cw.approx_scores(env.t(T), env.t(P), env.t(q2k_for(9, 3)), 70000)
        idx, counts, m, l_sel = cw.threshold_select(z, 0.9, stats=stats)
    check_selection(np_(z), 0.9, idx, counts, m, l_sel)


@gpu_only
@pytest.mark.parametrize("n", GPU_N)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_attend_exact(n, dtype):
    check_attend(Env(GPU_KIND, num_sms=132), 9, 3, 64, n, n_cap=n + 33, dtype=dtype)


@gpu_only
@pytest.mark.parametrize("n,valid,dtype", [(5000, "ring", torch.bfloat16), (1100, "ring", torch.float32),
                                           (300, "none", torch.float16)])
def test_gpu_attend_exact_valid_mask(n, valid, dtype):
    check_attend(Env(GPU_KIND, num_sms=132), 9, 3, 64, n, valid=valid, dtype=dtype)


@gpu_only
@pytest.mark.parametrize("Hq,Hkv,d,dtype,kernel,want", ATTEND_KERNEL_CASES)
def test_gpu_attend_kernel_choice(Hq, Hkv, d, dtype, kernel, want):
    for valid in ("ring", None):
        check_attend(Env(GPU_KIND, num_sms=132), Hq, Hkv, d, 70000, dtype=dtype, valid=valid, kernel=kernel)


@gpu_only
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_attend_exact_strided(d):
    check_attend(Env(GPU_KIND, num_sms=132), 9, 3, d, 5000, layout="nhd", dtype=torch.float16)


@gpu_only
@pytest.mark.parametrize(
    "g,c,n,dtype",
    [
        (16, 256, 0, torch.float32),
        (16, 256, 1, torch.float32),
        (32, 256, 128, torch.bfloat16),
        (16, 256, 1000, torch.float32),
        (32, 256, 1000, torch.float16),
        (16, 1024, 1000, torch.bfloat16),
        (32, 1024, 1000, torch.float32),
        (16, 256, 70000, torch.float16),
    ],
)
def test_gpu_encode_keys(g, c, n, dtype):
    check_encode(Env(GPU_KIND, num_sms=132), 3, 64, g, c, n, dtype=dtype)


@gpu_only
def test_gpu_encode_keys_large_codebook_smem_optin():
    """c = 4096, ds = 8 -> 144 KiB of shared memory: needs the opt-in attribute."""
    check_encode(Env(GPU_KIND, num_sms=132), 2, 128, 16, 4096, 3000)


@gpu_only
def test_gpu_approx_scores_large_lut_smem_optin():
    """g*c*4 = 128 KiB of T in shared memory (opt-in above 48 KiB)."""
    check_approx_scores(Env(GPU_KIND, num_sms=132), 9, 3, 32, 1024, 70000)


@gpu_only
def test_gpu_side_stream():
    """Launches follow torch's current stream (results correct after syncing only that stream)."""
    if GPU_KIND != "gpu":
        pytest.skip("needs a real CUDA stream")
    R = _ref()
    env = Env(GPU_KIND, num_sms=132)
    rng = np.random.default_rng(8)
    Hq, Hkv, d, n = 9, 3, 64, 70000
    q = (rng.standard_normal((Hq, d)) / 8).astype(np.float32)
    K = rng.standard_normal((Hkv, n, d)).astype(np.float32)
    V = rng.standard_normal((Hkv, n, d)).astype(np.float32)
    q2k = q2k_for(Hq, Hkv)
    qt, Kt, Vt, qk = env.t(q), env.t(K), env.t(V), env.t(q2k)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        o, m, l = cw.attend_exact(qt, Kt, Vt, qk, n)
        o2 = o * 2  # torch work queued behind the kernels on the same stream
    s.synchronize()
    ro, _, _ = R.attend_exact_ref(q, K, V, q2k, n)
    np.testing.assert_allclose(np_(o2) / 2, ro, rtol=1e-4, atol=2e-5)
