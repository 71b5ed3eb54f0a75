"""The checks shared by tests/kernels/test_kernels_cuda.py's emulated and GPU runs: each builds inputs,
runs one kernels_cuda wrapper in an Env (the CPU emulator or a CUDA device) and compares it with
the NumPy reference, within the tolerances listed in that file's docstring."""
from __future__ import annotations

import math

import numpy as np
import torch

import cuda_wrappers as cw
import kernels_cuda
import references



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
        import cuda_emu

        return cuda_emu.emulated(**self.emu_kw)

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
    return references


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
        T = cw.build_lut(env.t(q), env.t(cb), env.t(q2k))
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
        z, (m, l) = cw.approx_scores(env.t(T), Pt, env.t(q2k), n, out=out)
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
            idx, counts, m, l_sel = cw.threshold_select(zt, tau, out, stats=stats)
        check_selection(z_np, tau, idx, counts, m, l_sel)
        if out is not None:
            assert idx.data_ptr() == out.data_ptr()
            assert (np_(out)[:, n:] == -5).all()


def check_attend(env, Hq, Hkv, d, n, n_cap=None, dtype=torch.float32, layout="hnd", seed=2, valid=None,
                 kernel="auto"):
    """valid: None, or "ring" (a truncated ring: live sinks, then every third slot dead and a dead
    tile-sized run), or "none" (every slot dead). kernel: attend_exact's. Returns the emulator's
    launched kernel names (an empty set on a GPU)."""
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
    mask = None
    if valid is not None:
        mask = np.zeros(n_cap + 5, np.uint8)
        if valid == "ring":
            mask[:n_cap] = np.arange(n_cap) % 3 != 2
            mask[:4] = 1
            mask[300:600] = 0  # longer than a 256-token tile: a tile with no live token
    with env.ctx() as be:
        o, m, l = cw.attend_exact(env.t(q), Kt, Vt, env.t(q2k), n, valid=None if mask is None else env.t(mask),
                                  kernel=kernel)
    names = {x[0] for x in getattr(be, "launches", [])}
    Kr, Vr = np_(Kt), np_(Vt)  # exactly the (upcast) values the kernel saw
    ro, rm, rl = R.attend_exact_ref(q, Kr, Vr, q2k, n, valid=mask)
    assert o.shape == (Hq, d) and m.shape == (Hq,) and l.shape == (Hq,)
    o, m, l = np_(o), np_(m), np_(l)
    assert np.isfinite(o).all()
    np.testing.assert_allclose(o, ro, rtol=1e-4, atol=2e-5)
    if n == 0 or valid == "none":
        assert (m == -np.inf).all() and (l == 0).all() and (o == 0).all()
    else:
        np.testing.assert_allclose(m, rm, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(l, rl, rtol=1e-4)
    return names


def check_encode(env, Hkv, d, g, c, n, dtype=torch.float32, chunk=4096, seed=4):
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
    with env.ctx():
        P = kernels_cuda.encode_keys(Kt, env.t(cb))
    assert P.shape == (Hkv, n, g) and P.dtype == cdt
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


def check_threshold_cap(env, z_np, tau, cap, n_bins=2048, z_range=32.0):
    """threshold_select with a cap: per head a top set of whole bins (every token of a bin at or
    above the lowest selected bin is in), inside the uncapped selection, of at most cap tokens
    unless it is the top non-empty bin alone, and as large as whole bins allow (the next bin down
    would cross cap, or the uncapped selection is reached)."""
    with env.ctx():
        zt = env.t(z_np)
        idx, counts, m, _ = cw.threshold_select(zt, tau, cap=cap)
        idx0, counts0, _, _ = cw.threshold_select(zt, tau)
    idx, counts, m, idx0, counts0 = np_(idx), np_(counts), np_(m), np_(idx0), np_(counts0)
    for h in range(z_np.shape[0]):
        if not m[h] > -np.inf:
            assert counts[h] == 0
            continue
        lo, inv_w = np.float32(m[h] - np.float32(z_range)), np.float32(n_bins / z_range)
        x = np.clip((z_np[h] - lo) * inv_w, 0, n_bins - 1)
        b = np.where(np.isnan(z_np[h]), -1, np.floor(x)).astype(np.int64)
        sel = np.sort(idx[h, :counts[h]])
        full = set(idx0[h, :counts0[h]].tolist())
        assert set(sel.tolist()) <= full and len(set(sel.tolist())) == len(sel)
        assert (len(sel) > 0) == (len(full) > 0)
        if len(sel) == 0:
            continue
        cut = b[sel].min()
        np.testing.assert_array_equal(sel, np.flatnonzero(b >= cut))          # whole bins from the top
        top_bin = b.max()
        assert len(sel) <= cap or cut == top_bin, (h, len(sel), cap)
        below = b[(b < cut) & (b >= 0)]
        if len(sel) < len(full) and len(below):
            nxt = below.max()
            assert len(sel) + (b == nxt).sum() > cap, (h, len(sel), cap)   # the next bin would cross cap
