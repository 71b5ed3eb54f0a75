"""Tests for kernels_cuda.

Three layers:

* compile checks: every kernels_cuda/*.cu with nvcc (sm_80 / sm_90, with the
  run-time options, warnings are errors) and, when a libnvrtc is found, with
  NVRTC on exactly the text CuPy compiles -- both need no GPU;
* CPU emulation (``emu``): the unchanged wrappers of kernels_cuda.ops run the
  unchanged .cu sources through the fiber SIMT emulator
  (kernels_cuda/_emu.py, needs g++) on small shapes, in forward / reverse /
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
  lse_merge       o: 1e-6 + 1e-5 |ref|, m exact, l rtol 1e-5
  encode_keys     identical codes except near-ties: a differing code must be
                  within 1e-4 (1 + |x|^2) of the reference's squared distance,
                  and at most 0.1 % of the codes may differ
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kernels_cuda
from kernels_cuda import _sources

ROOT = Path(__file__).resolve().parents[1]
CU_FILES = [p.name for p in _sources.cu_files()]

HAVE_GPU = kernels_cuda.available()
HAVE_GXX = shutil.which("g++") is not None
NO_GPU_REASON = "no CUDA device / cupy"

torch = pytest.importorskip("torch")


# ---------------------------------------------------------------------------
# Compile checks (no GPU needed)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("cu", CU_FILES)
def test_cuda_sources_compile(cu, arch):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("nvcc not found: cannot compile-check the CUDA sources")
        pytest.skip("nvcc not found")
    opts = list(_sources.OPTIONS.get(cu, ("-std=c++17",)))
    cmd = [nvcc, *opts, f"-arch={arch}", "--cubin", "-Werror", "all-warnings", "-o", os.devnull, cu]
    res = subprocess.run(cmd, cwd=_sources.HERE, capture_output=True, text=True)
    log = res.stdout + res.stderr
    assert res.returncode == 0, f"{' '.join(cmd)}\n{log}"
    assert "warning" not in log.lower(), log


def _find_nvrtc():
    cands = []
    if os.environ.get("MINIRUN_NVRTC"):
        cands.append(os.environ["MINIRUN_NVRTC"])
    found = ctypes.util.find_library("nvrtc")
    if found:
        cands.append(found)
    for base in [os.environ.get("CUDA_PATH", ""), "/usr/local/cuda", *sys.path]:
        if base:
            cands += sorted(glob.glob(os.path.join(base, "lib64", "libnvrtc.so*")))
            cands += sorted(glob.glob(os.path.join(base, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")))
            cands += sorted(glob.glob(os.path.join(base, "nvidia", "cu*", "lib", "libnvrtc.so*")))
    for c in cands:
        if "builtins" in c or ".alt." in c:
            continue
        try:
            return ctypes.CDLL(c), c
        except OSError:
            continue
    return None, None


def _nvrtc_compile(lib, src: str, name: str, opts: list[str]) -> tuple[int, str]:
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None)
    assert rc == 0, f"nvrtcCreateProgram failed ({rc})"
    try:
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(max(1, size.value))
        lib.nvrtcGetProgramLog(prog, buf)
        return rc, buf.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("cu", CU_FILES)
def test_cuda_sources_compile_nvrtc(cu, arch):
    """The exact text CuPy hands to NVRTC (common.cuh inlined, run-time options)."""
    lib, path = _find_nvrtc()
    if lib is None:
        print("libnvrtc not found (set MINIRUN_NVRTC=/path/libnvrtc.so): NVRTC check skipped")
        pytest.skip("libnvrtc not found")
    opts = [*_sources.OPTIONS[cu], f"--gpu-architecture={arch}"]
    rc, log = _nvrtc_compile(lib, _sources.source(cu), cu, opts)
    assert rc == 0, f"NVRTC ({path}) failed on {cu}:\n{log}"
    assert "warning" not in log.lower(), log


def test_sources_self_contained():
    """No headers beyond common.cuh (NVRTC has no host headers); the entry points the
    wrappers launch exist as extern "C" kernels and every such kernel is listed."""
    from kernels_cuda import _emu

    assert set(CU_FILES) == set(_sources.OPTIONS) == set(_sources.KERNELS)
    for cu in CU_FILES + list(_sources.HEADERS):
        for inc in re.findall(r"^\s*#\s*include\s*([<\"][^>\"]+[>\"])", _sources.raw_text(cu), re.M):
            assert inc == '"common.cuh"', f"{cu} includes {inc}"
    for cu in CU_FILES:
        src = _sources.source(cu)
        assert not re.search(r"^\s*#\s*include", src, re.M), f"{cu}: unexpanded #include"
        assert set(_emu.signatures(cu)) == set(_sources.KERNELS[cu]), cu
    ops_text = (_sources.HERE / "ops.py").read_text()
    for names in _sources.KERNELS.values():
        for name in names:
            stem = re.sub(r"_(f32|f16|bf16|u8|i16)$", "", re.sub(r"_(u8|i16)$", "", name))
            assert stem in ops_text, f"{name} is never launched"


def test_import_without_cupy_or_torch():
    code = "import sys, kernels_cuda; assert 'cupy' not in sys.modules and 'torch' not in sys.modules; print('ok')"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr
    if not HAVE_GPU:
        assert kernels_cuda.available() is False


# ---------------------------------------------------------------------------
# Backends: emulated (CPU tensors) or real GPU (CUDA tensors)
# ---------------------------------------------------------------------------


class Env:
    """Where a check runs: device for the tensors plus the context to launch in."""

    def __init__(self, kind, **emu_kw):
        self.kind = kind
        self.emu_kw = emu_kw
        self.device = torch.device("cuda") if kind == "gpu" else torch.device("cpu")

    def ctx(self):
        if self.kind == "gpu":
            import contextlib

            return contextlib.nullcontext()
        from kernels_cuda import _emu

        return _emu.emulated(**self.emu_kw)

    def t(self, a, dtype=None):
        x = torch.from_numpy(np.ascontiguousarray(a))
        if dtype is not None:
            x = x.to(dtype)
        return x.to(self.device)


def np_(t):
    t = t.detach().cpu()
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    return t.numpy()


def _ref():
    return pytest.importorskip("kernels_cpu.reference")


emu_only = pytest.mark.skipif(not HAVE_GXX, reason="g++ not found (CPU kernel emulator)")
# MINIRUN_EMULATE_GPU_TESTS=1 runs the gpu tests' bodies on the emulator instead
# (slow; checks the test code itself on a machine without a GPU).
EMULATE_GPU = bool(os.environ.get("MINIRUN_EMULATE_GPU_TESTS")) and HAVE_GXX and not HAVE_GPU
GPU_KIND = "emu" if EMULATE_GPU else "gpu"
gpu_only = pytest.mark.skipif(not (HAVE_GPU or EMULATE_GPU), reason=NO_GPU_REASON)

if not HAVE_GPU:
    print(f"kernels_cuda GPU tests skipped: {NO_GPU_REASON}")


def q2k_for(Hq, Hkv):
    return (np.arange(Hq) // (Hq // Hkv)).astype(np.int32)


# ---------------------------------------------------------------------------
# Shared checks
# ---------------------------------------------------------------------------


def check_build_lut(env, Hq, Hkv, d, g, c, seed=0):
    R = _ref()
    rng = np.random.default_rng(seed)
    ds = d // g
    q = (rng.standard_normal((Hq, d)) / math.sqrt(d)).astype(np.float32)
    cb = rng.standard_normal((Hkv, g, c, ds)).astype(np.float32)
    q2k = q2k_for(Hq, Hkv)
    with env.ctx():
        T = kernels_cuda.build_lut(env.t(q), env.t(cb), env.t(q2k))
    ref = R.build_lut_ref(q, cb, q2k)
    assert T.shape == (Hq, g, c) and T.dtype == torch.float32
    np.testing.assert_allclose(np_(T), ref, rtol=1e-5, atol=1e-5)
    return T


def _pq_data(rng, Hq, Hkv, g, c, n_cap):
    T = (rng.standard_normal((Hq, g, c)) * 0.5).astype(np.float32)
    dt = np.uint8 if c <= 256 else np.int16
    P = rng.integers(0, c, (Hkv, n_cap, g)).astype(dt)
    return T, P


def check_approx_scores(env, Hq, Hkv, g, c, n, n_cap=None, out_extra=0, misalign=False, seed=1):
    R = _ref()
    rng = np.random.default_rng(seed)
    n_cap = n if n_cap is None else n_cap
    T, P = _pq_data(rng, Hq, Hkv, g, c, max(n_cap, 1))
    q2k = q2k_for(Hq, Hkv)
    Pt = env.t(P)
    if misalign:  # same values at an odd byte address: forces the scalar (non-vec16) path
        flat = torch.empty(Pt.numel() * Pt.element_size() + 1, dtype=torch.uint8, device=env.device)
        view = flat[1:].view(Pt.dtype) if Pt.element_size() == 1 else None
        if view is not None:
            view.copy_(Pt.reshape(-1))
            Pt = view.view(Pt.shape)
    out = None
    if out_extra:
        out = torch.full((Hq, n + out_extra), 7.0, device=env.device)
    with env.ctx():
        z, (m, l) = kernels_cuda.approx_scores(env.t(T), Pt, env.t(q2k), n, out=out)
    assert z.shape == (Hq, n) and z.dtype == torch.float32
    ref = R.approx_scores_ref(T, P, q2k, n)
    atol = 1e-5 * g
    np.testing.assert_allclose(np_(z), ref, rtol=1e-5, atol=atol)
    if out is not None:
        assert (np_(out)[:, n:] == 7.0).all(), "approx_scores wrote past n"
        assert z.data_ptr() == out.data_ptr()
    if n == 0:
        assert np.all(np_(m) == -np.inf) and np.all(np_(l) == 0)
    else:
        z64 = ref.astype(np.float64)
        mr = z64.max(1)
        lr = np.exp(z64 - mr[:, None]).sum(1)
        np.testing.assert_allclose(np_(m), mr, rtol=1e-5, atol=atol)
        np.testing.assert_allclose(np_(l), lr, rtol=1e-4)
    return z, (m, l)


def check_selection(z_np, tau, idx, counts, m, l_sel, n_bins=2048, z_range=32.0):
    R = _ref()
    Hq, n = z_np.shape
    idx, counts, m, l_sel = np_(idx), np_(counts), np_(m), np_(l_sel)
    assert idx.shape == (Hq, n) and counts.shape == (Hq,)
    ridx, rcnt, rm, rl = R.threshold_select_ref(z_np, tau)
    width = z_range / n_bins
    for h in range(Hq):
        zh = z_np[h]
        c = int(counts[h])
        sel = idx[h, :c]
        assert 0 <= c <= n
        assert len(np.unique(sel)) == c and (c == 0 or (sel.min() >= 0 and sel.max() < n)), f"head {h}: bad indices"
        live = np.isfinite(zh)
        if not live.any():
            assert c == 0 and m[h] == -np.inf and l_sel[h] == 0
            continue
        assert m[h] == np.nanmax(np.where(np.isnan(zh), -np.inf, zh)), f"head {h}: m"
        w = np.exp(zh.astype(np.float64) - float(m[h]))
        w[np.isnan(w)] = 0.0
        S = w.sum()
        mask = np.zeros(n, bool)
        mask[sel] = True
        np.testing.assert_allclose(l_sel[h], w[mask].sum(), rtol=1e-4, atol=1e-30, err_msg=f"head {h}: l_sel")
        if tau >= 1:
            assert c == n
            continue
        if tau <= 0:
            assert c == 0 and l_sel[h] == 0
            continue
        assert not np.isnan(zh[mask]).any(), "NaN selected"
        rset = np.zeros(n, bool)
        rset[ridx[h, : rcnt[h]]] = True
        missing = rset & ~mask
        assert w[missing].sum() <= 1e-5 * S, f"head {h}: {missing.sum()} reference tokens not selected"
        assert w[mask].sum() >= tau * S * (1 - 1e-5), f"head {h}: selected mass below tau"
        if (~mask & live).any():
            assert zh[mask].min() >= zh[~mask & live].max(), f"head {h}: selection is not a top set"
        if rcnt[h]:
            zcut_ref = zh[rset].min()
            extra = mask & ~rset
            if extra.any():
                assert zh[extra].min() >= zcut_ref - width * 1.001 - 1e-6 * abs(zcut_ref), (
                    f"head {h}: extra tokens outside the cut bin"
                )


def check_threshold(env, z_np, taus, use_stats=False, out_extra=0):
    Hq, n = z_np.shape
    zt = env.t(z_np)
    for tau in taus:
        with env.ctx():
            stats = None
            if use_stats:
                m = z_np.max(1)
                l = np.exp(z_np.astype(np.float64) - m[:, None]).sum(1)
                stats = (env.t(m.astype(np.float32)), env.t(l.astype(np.float32)))
            out = None
            if out_extra:
                out = torch.full((Hq, n + out_extra), -5, dtype=torch.int32, device=env.device)
            idx, counts, m, l_sel = kernels_cuda.threshold_select(zt, tau, out, stats=stats)
        check_selection(z_np, tau, idx, counts, m, l_sel)
        if out is not None:
            assert idx.data_ptr() == out.data_ptr()
            assert (np_(out)[:, n:] == -5).all()


def check_attend(env, Hq, Hkv, d, n, n_cap=None, dtype=torch.float32, layout="hnd", seed=2):
    R = _ref()
    rng = np.random.default_rng(seed)
    n_cap = n if n_cap is None else n_cap
    n_cap = max(n_cap, 1)
    q = (rng.standard_normal((Hq, d)) / math.sqrt(d) * 2).astype(np.float32)
    K = rng.standard_normal((Hkv, n_cap, d)).astype(np.float32)
    V = rng.standard_normal((Hkv, n_cap, d)).astype(np.float32)
    q2k = q2k_for(Hq, Hkv)
    if layout == "nhd":  # pool stored token-major: strides (d, Hkv*d, 1)
        Kt = env.t(K.transpose(1, 0, 2), dtype).permute(1, 0, 2)
        Vt = env.t(V.transpose(1, 0, 2), dtype).permute(1, 0, 2)
    else:
        Kt, Vt = env.t(K, dtype), env.t(V, dtype)
    with env.ctx():
        o, m, l = kernels_cuda.attend_exact(env.t(q), Kt, Vt, env.t(q2k), n)
    Kr, Vr = np_(Kt), np_(Vt)  # exactly the (upcast) values the kernel saw
    ro, rm, rl = R.attend_exact_ref(q, Kr, Vr, q2k, n)
    assert o.shape == (Hq, d) and m.shape == (Hq,) and l.shape == (Hq,)
    o, m, l = np_(o), np_(m), np_(l)
    assert np.isfinite(o).all()
    np.testing.assert_allclose(o, ro, rtol=1e-4, atol=2e-5)
    if n == 0:
        assert (m == -np.inf).all() and (l == 0).all() and (o == 0).all()
    else:
        np.testing.assert_allclose(m, rm, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(l, rl, rtol=1e-4)


def check_lse_merge(env, P, Hq, d, seed=3):
    R = _ref()
    rng = np.random.default_rng(seed)
    os_ = rng.standard_normal((P, Hq, d)).astype(np.float32)
    ms = (rng.standard_normal((P, Hq)) * 3).astype(np.float32)
    ls = (rng.random((P, Hq)) * 5 + 0.1).astype(np.float32)
    if P >= 2 and Hq >= 4:
        ms[0, 0], ls[0, 0] = -np.inf, 0.0  # empty part
        os_[0, 0] = np.nan  # garbage in an empty part must not leak
        ls[1, 1] = 0.0  # l == 0 with a finite m: empty
        os_[1, 1] = np.inf
        ms[:, 2], ls[:, 2] = -np.inf, 0.0  # every part empty
        ms[:, 3] = ms[0, 3]  # ties
    with env.ctx():
        o, m, l = kernels_cuda.lse_merge(env.t(os_), env.t(ms), env.t(ls))
    ro, rm, rl = R.lse_merge_ref(os_, ms, ls)
    o, m, l = np_(o), np_(m), np_(l)
    assert np.isfinite(o).all() and not np.isnan(m).any() and not np.isnan(l).any()
    np.testing.assert_allclose(o, ro, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(m, rm)
    np.testing.assert_allclose(l, rl, rtol=1e-5)


def check_encode(env, Hkv, d, g, c, n, dtype=torch.float32, pool_extra=0, chunk=4096, seed=4):
    R = _ref()
    rng = np.random.default_rng(seed)
    ds = d // g
    cb = rng.standard_normal((Hkv, g, c, ds)).astype(np.float32)
    K = rng.standard_normal((Hkv, n, d)).astype(np.float32)
    if n >= 4:  # exact ties: a key equal to a duplicated centroid
        cb[0, 0, 7] = cb[0, 0, 3]
        K[0, 1, :ds] = cb[0, 0, 3]
    Kt = env.t(K, dtype)
    Kr = np_(Kt).astype(np.float32)  # the values the kernel sees
    cdt = torch.uint8 if c <= 256 else torch.int16
    out = None
    if pool_extra:
        out = torch.full((Hkv, n + pool_extra, g), 9, dtype=cdt, device=env.device)
    with env.ctx():
        P = kernels_cuda.encode_keys(Kt, env.t(cb), out=out)
    assert P.shape == (Hkv, n, g) and P.dtype == cdt
    if out is not None:
        assert (np_(out)[:, n:] == 9).all()
    if n == 0:
        return
    Pg = np_(P).astype(np.int64)
    ref = np.concatenate([R.encode_keys_ref(Kr[:, a : a + chunk], cb) for a in range(0, n, chunk)], axis=1)
    ref = ref.astype(np.int64)
    if n >= 4:
        assert Pg[0, 1, 0] == 3, "tie must go to the lowest index"
    diff = np.argwhere(Pg != ref)
    assert len(diff) <= max(2, 1e-3 * Pg.size), f"{len(diff)} codes differ"
    x = Kr.astype(np.float64).reshape(Hkv, n, g, ds)
    cbd = cb.astype(np.float64)
    for kv, t, j in diff:
        xv = x[kv, t, j]
        dg = ((xv - cbd[kv, j, Pg[kv, t, j]]) ** 2).sum()
        dr = ((xv - cbd[kv, j, ref[kv, t, j]]) ** 2).sum()
        assert dg <= dr + 1e-4 * (1 + (xv**2).sum()), (kv, t, j, dg, dr)


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
def test_emu_threshold_select_stats_out_and_edge_rows():
    env = Env("emu", num_sms=132)
    rng = np.random.default_rng(5)
    z = _z_cases(rng, 9, 4000)
    check_threshold(env, z, [0.5, 0.95], use_stats=True, out_extra=3)
    # n = 0
    with env.ctx():
        idx, counts, m, l_sel = kernels_cuda.threshold_select(torch.zeros((4, 0)), 0.9)
    assert idx.shape == (4, 0) and (np_(counts) == 0).all() and (np_(m) == -np.inf).all() and (np_(l_sel) == 0).all()
    # all -inf rows and NaN scores
    z = rng.standard_normal((3, 500)).astype(np.float32)
    z[0] = -np.inf
    z[1, ::7] = np.nan
    for tau in (0.9, 1.0):
        with env.ctx():
            idx, counts, m, l_sel = kernels_cuda.threshold_select(env.t(z), tau)
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
@pytest.mark.parametrize("d", [32, 128, 96])
def test_emu_attend_exact_head_dims(d):
    check_attend(Env("emu", num_sms=132), 4, 2, d, 600, layout="nhd")


@emu_only
@pytest.mark.parametrize("order", EMU_ORDERS)
@pytest.mark.parametrize("P,Hq,d", [(1, 9, 64), (3, 9, 64), (5, 4, 128), (2, 3, 300)])
def test_emu_lse_merge(order, P, Hq, d):
    check_lse_merge(Env("emu", order=order), P, Hq, d)


@emu_only
@pytest.mark.parametrize("order", EMU_ORDERS)
@pytest.mark.parametrize(
    "d,g,c,n,kw",
    [
        (64, 16, 256, 0, {}),
        (64, 16, 256, 1, {}),
        (64, 16, 256, 1500, {"pool_extra": 7}),
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
        T = kernels_cuda.build_lut(env.t(q), env.t(cb), env.t(q2k))
        z, stats = kernels_cuda.approx_scores(T, P, env.t(q2k), n)
        idx, counts, m, l_sel = kernels_cuda.threshold_select(z, 0.9, stats=stats)
    zr = R.approx_scores_ref(R.build_lut_ref(q, cb, q2k), np_(P), q2k, n)
    np.testing.assert_allclose(np_(z), zr, rtol=1e-5, atol=2e-4)
    check_selection(np_(z), 0.9, idx, counts, m, l_sel)


@emu_only
def test_emu_argument_errors():
    env = Env("emu")
    with env.ctx():
        T = torch.zeros((2, 16, 300))
        with pytest.raises(ValueError):
            kernels_cuda.approx_scores(T, torch.zeros((1, 10, 16), dtype=torch.uint8), [0, 0], 5)  # c > 256
        with pytest.raises(TypeError):
            kernels_cuda.approx_scores(T, torch.zeros((1, 10, 16), dtype=torch.int32), [0, 0], 5)
        with pytest.raises(ValueError):
            kernels_cuda.approx_scores(T, torch.zeros((1, 10, 16), dtype=torch.int16), [0, 0], 11)  # n > n_cap
        with pytest.raises(ValueError):
            kernels_cuda.build_lut(torch.zeros((2, 64)), torch.zeros((1, 16, 8, 4)), [0, 1])  # q_to_kv >= Hkv
        with pytest.raises(TypeError):
            kernels_cuda.attend_exact(torch.zeros((2, 64)), torch.zeros((1, 4, 64)), torch.zeros((1, 4, 64)).half(),
                                      [0, 0], 4)  # fmt: skip
        with pytest.raises(ValueError):
            kernels_cuda.attend_exact(torch.zeros((2, 512)), torch.zeros((1, 4, 512)), torch.zeros((1, 4, 512)),
                                      [0, 0], 4)  # fmt: skip
        with pytest.raises(ValueError):
            kernels_cuda.encode_keys(torch.zeros((1, 4, 64)), torch.zeros((1, 16, 256, 4)),
                                     out=torch.zeros((1, 4, 16), dtype=torch.int16))  # fmt: skip
        with pytest.raises(ValueError):
            kernels_cuda.threshold_select(torch.zeros((2, 5)), float("nan"))
        # degenerate sizes: no launch with an empty grid
        z, (m, l) = kernels_cuda.approx_scores(torch.zeros((0, 16, 256)), torch.zeros((1, 9, 16), dtype=torch.uint8),
                                               torch.zeros(0, dtype=torch.int32), 9)  # fmt: skip
        assert z.shape == (0, 9) and m.shape == (0,)
        P = kernels_cuda.encode_keys(torch.zeros((0, 5, 64)), torch.zeros((0, 16, 256, 4)))
        assert P.shape == (0, 5, 16) and P.dtype == torch.uint8
        o, m, l = kernels_cuda.attend_exact(torch.zeros((0, 64)), torch.zeros((1, 4, 64)), torch.zeros((1, 4, 64)),
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
def test_gpu_threshold_select_on_scores():
    env = Env(GPU_KIND, num_sms=132)
    rng = np.random.default_rng(21)
    T, P = _pq_data(rng, 9, 3, 16, 256, 70000)
    with env.ctx():
        z, stats = kernels_cuda.approx_scores(env.t(T), env.t(P), env.t(q2k_for(9, 3)), 70000)
        idx, counts, m, l_sel = kernels_cuda.threshold_select(z, 0.9, stats=stats)
    check_selection(np_(z), 0.9, idx, counts, m, l_sel)


@gpu_only
@pytest.mark.parametrize("n", GPU_N)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_attend_exact(n, dtype):
    check_attend(Env(GPU_KIND, num_sms=132), 9, 3, 64, n, n_cap=n + 33, dtype=dtype)


@gpu_only
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_attend_exact_strided(d):
    check_attend(Env(GPU_KIND, num_sms=132), 9, 3, d, 5000, layout="nhd", dtype=torch.float16)


@gpu_only
@pytest.mark.parametrize("P,Hq,d", [(1, 9, 64), (2, 9, 64), (7, 9, 128), (64, 9, 64)])
def test_gpu_lse_merge(P, Hq, d):
    check_lse_merge(Env(GPU_KIND, num_sms=132), P, Hq, d)


@gpu_only
@pytest.mark.parametrize(
    "g,c,n,dtype",
    [
        (16, 256, 0, torch.float32),
        (16, 256, 1, torch.float32),
        (16, 256, 1000, torch.float32),
        (32, 256, 1000, torch.float16),
        (16, 1024, 1000, torch.bfloat16),
        (32, 1024, 1000, torch.float32),
        (16, 256, 70000, torch.float16),
    ],
)
def test_gpu_encode_keys(g, c, n, dtype):
    check_encode(Env(GPU_KIND, num_sms=132), 3, 64, g, c, n, dtype=dtype, pool_extra=5)


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
        o, m, l = kernels_cuda.attend_exact(qt, Kt, Vt, qk, n)
        o2 = o * 2  # torch work queued behind the kernels on the same stream
    s.synchronize()
    ro, _, _ = R.attend_exact_ref(q, K, V, q2k, n)
    np.testing.assert_allclose(np_(o2) / 2, ro, rtol=1e-4, atol=2e-5)
