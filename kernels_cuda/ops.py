"""Thin CuPy wrappers around the kernels_cuda CUDA sources.

Every function takes and returns torch CUDA tensors (zero-copy through
DLPack: ``cupy.from_dlpack(t)``), allocates its outputs and temporaries with
torch (stream-ordered caching allocator) and launches on torch's current CUDA
stream of the input's device (``cupy.cuda.ExternalStream``).  Nothing
synchronizes the device or copies to the host; argument checks use shapes,
dtypes, strides and devices only (index *values*, e.g. q_to_kv entries on
the GPU, are not validated).

Kernel launch geometry is documented in each .cu file and in README.md.
cupy and torch are imported lazily: ``import kernels_cuda`` works without
either.  The launch layer (backends, launch geometry, one unchecked launch helper
per kernel) is kernels_cuda.launch: a small backend object, so that the tests can
run these same wrappers on the CPU emulator (tests/cuda_emu.py).
"""
from __future__ import annotations

import math

# (N_BINS, Z_RANGE: the histogram's defaults, public here as before)
from .launch import (N_BINS, Z_RANGE, _ATT_THREADS, _ENC_THREADS, _ENC_TOK, _KV_SUFFIX, _MAX_GRID_YZ,
                      _MERGE_THREADS, _SMEM_MARGIN, _attend_split, _backend, _cdiv, _check, _f32c, _i32, _i64,
                      _q2k, _rows, _score_blocks, _torch, select_mode, zcut_tau, launch_approx_scores, launch_attend_partial,
                      launch_build_lut, launch_zcompact, launch_zcut, launch_zhist, launch_zstats)  # noqa: F401

__all__ = ["build_lut", "approx_scores", "threshold_select", "attend_exact", "lse_merge", "encode_keys"]


# ---------------------------------------------------------------------------
# 1. build_lut
# ---------------------------------------------------------------------------


def build_lut(q, codebooks, q_to_kv):
    """q [Hq, d] f32 (pre-scaled), codebooks [Hkv, g, c, ds] f32, q_to_kv int32 [Hq]
    -> T [Hq, g, c] f32, T[h, j, k] = q[h, j*ds:(j+1)*ds] . codebooks[q_to_kv[h], j, k]."""
    torch = _torch()
    be = _backend()
    _check(be, q, "q", 2)
    _check(be, codebooks, "codebooks", 4, q.device)
    Hq, d = q.shape
    Hkv, g, c, ds = codebooks.shape
    if g * ds != d:
        raise ValueError(f"codebooks {tuple(codebooks.shape)} do not match d={d}")
    q2k = _q2k(be, q_to_kv, Hq, Hkv, q.device)
    qf, cb = _f32c(q), _f32c(codebooks)
    T = be.empty((Hq, g, c), torch.float32, q.device)
    total = Hq * g * c
    if total == 0:
        return T
    with be.session(q.device) as L:
        launch_build_lut(L, qf, cb, q2k, T)
    return T


# ---------------------------------------------------------------------------
# 2. approx_scores (+ fused softmax statistics)
# ---------------------------------------------------------------------------


def approx_scores(T, P, q_to_kv, n, out=None):
    """T [Hq, g, c] f32, P [Hkv, n_cap, g] uint8 (c <= 256) / int16 codes (first n valid),
    q_to_kv int32 [Hq], out optional f32 [Hq, >=n] with contiguous rows
    -> (z [Hq, n] f32 (a view of out when given), (m [Hq], l [Hq]))
    with z[h, t] = sum_j T[h, j, P[q_to_kv[h], t, j]], m = max_t z, l = sum_t exp(z - m)
    (NaN scores are left out of m and l).  n = 0 -> m = -inf, l = 0."""
    torch = _torch()
    be = _backend()
    _check(be, T, "T", 3)
    _check(be, P, "P", 3, T.device)
    Hq, g, c = T.shape
    Hkv, n_cap, g2 = P.shape
    if g2 != g:
        raise ValueError(f"P has {g2} groups, T has {g}")
    if P.dtype == torch.uint8:
        if c > 256:
            raise ValueError(f"uint8 codes cannot address c={c} centroids")
    elif P.dtype == torch.int16:
        if c > 32768:
            raise ValueError("at most 32768 centroids")
    else:
        raise TypeError(f"P must be uint8 or int16, got {P.dtype}")
    n = int(n)
    if not 0 <= n <= n_cap:
        raise ValueError(f"n={n} outside [0, {n_cap}]")
    if Hq > _MAX_GRID_YZ:
        raise ValueError(f"Hq={Hq} above {_MAX_GRID_YZ}")
    if out is None:
        z = be.empty((Hq, n), torch.float32, T.device)
    else:
        _check(be, out, "out", 2, T.device)
        if out.dtype != torch.float32 or out.shape[0] != Hq or out.shape[1] < n or (n > 1 and out.stride(1) != 1):
            raise ValueError("out must be float32 [Hq, >=n] with contiguous rows")
        z = out[:, :n]
    if n == 0 or Hq == 0:
        return z, (torch.full((Hq,), -math.inf, device=T.device), torch.zeros(Hq, device=T.device))
    q2k = _q2k(be, q_to_kv, Hq, Hkv, T.device)
    Tc = _f32c(T)
    if P.stride(2) != 1 or P.stride(1) != g:
        P = P.contiguous()
    num_sms, optin = be.device_info(T.device)
    _, nblk = _score_blocks(n, Hq, num_sms)
    part_m = be.empty((Hq, nblk), torch.float32, T.device)
    part_l = be.empty((Hq, nblk), torch.float32, T.device)
    m = be.empty((Hq,), torch.float32, T.device)
    l = be.empty((Hq,), torch.float32, T.device)
    with be.session(T.device) as L:
        launch_approx_scores(L, Tc, P, q2k, z, n, part_m, part_l, m, l, num_sms, optin)
    return z, (m, l)


# ---------------------------------------------------------------------------
# 3. threshold_select
# ---------------------------------------------------------------------------


def threshold_select(z, tau, out_idx=None, *, stats=None, n_bins=N_BINS, z_range=Z_RANGE, cap=None):
    """Per head, the tokens holding >= tau of the softmax mass of z, without a sort.

    z [Hq, n] f32 (contiguous rows), tau float, out_idx optional int32 [Hq, >=n]
    (contiguous rows), stats optional (m [Hq], l [Hq]) as returned by
    approx_scores for this z (skips one pass over z)
    cap: at most this many tokens per head, any tau > 0 (launch.select_mode): the
    top bins whose count stays <= cap and whose mass reaches tau, the top bin
    always (scores.cu, zcut); counts may then exceed cap only when the top bin
    alone does (take any cap of them)
    -> (idx int32 [Hq, n] (view of out_idx when given; the first counts[h] entries of
    row h are the selected token indices in unspecified order, the rest is
    scratch), counts int32 [Hq], m f32 [Hq] = max z[h] (the stats tensor when
    given), l_sel f32 [Hq] = sum of exp(z - m) over the selection).

    Histogram of the mass exp(z - m) over n_bins bins on [m - z_range, m]
    (scores below share bin 0), scan from the top bin to the cut bin where the
    cumulative mass first reaches tau * S, select every token whose bin >= cut.
    Bound: the selection contains the minimal set (the top-z tokens whose mass
    reaches tau * S, as threshold_select_ref) plus at most the other tokens of
    the cut bin, i.e. every extra token has z >= zcut_ref - z_range / n_bins
    (count <= minimal + tokens in the cut bin - 1), up to float32 rounding of
    the bin masses.  tau >= 1 selects all n, tau <= 0 selects nothing; n = 0 or
    m = -inf -> counts 0, l_sel 0; NaN scores are selected only by tau >= 1."""
    torch = _torch()
    be = _backend()
    _check(be, z, "z", 2)
    if z.dtype != torch.float32:
        raise TypeError(f"z must be float32, got {z.dtype}")
    z = _rows(z)
    Hq, n = z.shape
    tau = float(tau)
    if math.isnan(tau):
        raise ValueError("tau is NaN")
    n_bins = int(n_bins)
    z_range = float(z_range)
    if not (z_range > 0 and math.isfinite(z_range)) or n_bins < 1:
        raise ValueError("need n_bins >= 1 and a finite z_range > 0")
    if Hq > _MAX_GRID_YZ:
        raise ValueError(f"Hq={Hq} above {_MAX_GRID_YZ}")
    dev = z.device
    if out_idx is None:
        idx = be.empty((Hq, n), torch.int32, dev)
    else:
        _check(be, out_idx, "out_idx", 2, dev)
        if out_idx.dtype != torch.int32 or out_idx.shape[0] != Hq or out_idx.shape[1] < n or (
            n > 1 and out_idx.stride(1) != 1
        ):
            raise ValueError("out_idx must be int32 [Hq, >=n] with contiguous rows")
        idx = out_idx[:, :n]
    if n == 0 or Hq == 0:
        m = stats[0] if stats is not None else torch.full((Hq,), -math.inf, device=dev)
        return idx, torch.zeros(Hq, dtype=torch.int32, device=dev), m, torch.zeros(Hq, device=dev)
    num_sms, optin = be.device_info(dev)
    if n_bins * 4 * (2 if cap else 1) > optin - _SMEM_MARGIN:
        raise ValueError(f"n_bins={n_bins} does not fit in shared memory")
    tpb, nblk = _score_blocks(n, Hq, num_sms)
    mode = select_mode(tau, cap, n)
    cut = be.empty((Hq,), torch.int32, dev)
    l_sel = be.empty((Hq,), torch.float32, dev)
    counts = be.empty((Hq,), torch.int32, dev)  # zeroed by zcut
    with be.session(dev) as L:
        if stats is None:
            part_m = be.empty((Hq, nblk), torch.float32, dev)
            part_l = be.empty((Hq, nblk), torch.float32, dev)
            m = be.empty((Hq,), torch.float32, dev)
            l_all = be.empty((Hq,), torch.float32, dev)
            launch_zstats(L, z, n, part_m, part_l, m, l_all, num_sms)
        else:
            m, l_all = stats
            for t, w in ((m, "stats m"), (l_all, "stats l")):
                _check(be, t, w, 1, dev)
                if tuple(t.shape) != (Hq,) or t.dtype != torch.float32:
                    raise ValueError(f"{w} must be float32 [{Hq}]")
            m, l_all = m.contiguous(), l_all.contiguous()
        capped = mode == 0 and cap is not None and 0 < cap < n
        hists = be.empty((2, Hq, n_bins), torch.float32, dev)   # mass | token counts (int32 bits)
        hist, hcount = hists[0], hists[1].view(torch.int32)
        if mode == 0:
            hists.zero_()
            launch_zhist(L, z, n, tpb, m, z_range, n_bins, hist, hcount, capped)
        launch_zcut(L, hist, hcount, n_bins, zcut_tau(tau), mode, m, l_all, cut, l_sel, counts, cap if capped else 0)
        launch_zcompact(L, z, n, tpb, m, z_range, n_bins, cut, idx, counts)
    return idx, counts, m, l_sel


# ---------------------------------------------------------------------------
# 4. attend_exact (split-K)
# ---------------------------------------------------------------------------



def attend_exact(q, K, V, q_to_kv, n, valid=None):
    """q [Hq, d] f32 (pre-scaled), K, V [Hkv, n_cap, d] f32 / f16 / bf16 (same dtype; first
    n rows valid; any strides with a contiguous last axis), q_to_kv int32 [Hq],
    valid: optional uint8 [>= n] (0: that row holds no token and is left out, e.g. ring slots a
    truncate emptied) -> (o [Hq, d] f32 normalized, m [Hq] max score, l [Hq] sum exp(s - m)).
    n = 0 or no valid row -> o = 0, m = -inf, l = 0.  Split-K over token ranges, then an LSE merge."""
    torch = _torch()
    be = _backend()
    _check(be, q, "q", 2)
    _check(be, K, "K", 3, q.device)
    _check(be, V, "V", 3, q.device)
    Hq, d = q.shape
    Hkv, n_cap, dk = K.shape
    if dk != d or tuple(V.shape) != tuple(K.shape):
        raise ValueError(f"K {tuple(K.shape)} / V {tuple(V.shape)} do not match q {tuple(q.shape)}")
    if K.dtype != V.dtype or str(K.dtype) not in _KV_SUFFIX:
        raise TypeError(f"K and V must share a dtype among float32/float16/bfloat16, got {K.dtype}/{V.dtype}")
    if not 1 <= d <= _ATT_THREADS:
        raise ValueError(f"head dim {d} outside [1, {_ATT_THREADS}]")
    if Hq > _MAX_GRID_YZ:
        raise ValueError(f"Hq={Hq} above {_MAX_GRID_YZ}")
    n = int(n)
    if not 0 <= n <= n_cap:
        raise ValueError(f"n={n} outside [0, {n_cap}]")
    dev = q.device
    if valid is not None:
        _check(be, valid, "valid", 1, dev)
        if valid.dtype != torch.uint8 or valid.shape[0] < n:
            raise ValueError(f"valid must be uint8 [>= {n}], got {valid.dtype} {tuple(valid.shape)}")
        valid = valid.contiguous()
    if n == 0 or Hq == 0:
        return (torch.zeros((Hq, d), device=dev), torch.full((Hq,), -math.inf, device=dev),
                torch.zeros(Hq, device=dev))  # fmt: skip
    q2k = _q2k(be, q_to_kv, Hq, Hkv, dev)
    qf = _f32c(q)
    K, V = _rows(K), _rows(V)
    mask, has_mask = (valid, 1) if valid is not None else (q2k.view(torch.uint8)[:1], 0)   # never read
    num_sms, _ = be.device_info(dev)
    tps, nsplit = _attend_split(n, Hq, num_sms)
    o = be.empty((Hq, d), torch.float32, dev)
    m = be.empty((Hq,), torch.float32, dev)
    l = be.empty((Hq,), torch.float32, dev)
    if nsplit == 1:
        o_p, m_p, l_p = o, m, l  # [1, Hq, ...] == [Hq, ...]
    else:
        o_p = be.empty((nsplit, Hq, d), torch.float32, dev)
        m_p = be.empty((nsplit, Hq), torch.float32, dev)
        l_p = be.empty((nsplit, Hq), torch.float32, dev)
    with be.session(dev) as L:
        launch_attend_partial(L, qf, K, V, q2k, mask, has_mask, n, tps, nsplit, o_p, m_p, l_p)
        if nsplit > 1:
            L.launch("attention.cu", "lse_merge_f32", (Hq,), (_MERGE_THREADS,),
                     (o_p, m_p, l_p, _i32(nsplit), _i32(Hq), _i32(d), o, m, l))  # fmt: skip
    return o, m, l


# ---------------------------------------------------------------------------
# 5. lse_merge
# ---------------------------------------------------------------------------


def lse_merge(os, ms, ls):
    """os [P, Hq, d] f32 normalized partial outputs, ms [P, Hq], ls [P, Hq]
    -> (o [Hq, d], m [Hq], l [Hq]): M = max of the live m_p, w_p = exp(m_p - M) l_p,
    o = sum w_p o_p / sum w_p, l = sum w_p.  Parts with l_p <= 0 or m_p = -inf are
    empty and contribute nothing (their o_p is not read); none live -> (0, -inf, 0)."""
    torch = _torch()
    be = _backend()
    _check(be, os, "os", 3)
    _check(be, ms, "ms", 2, os.device)
    _check(be, ls, "ls", 2, os.device)
    P, Hq, d = os.shape
    if tuple(ms.shape) != (P, Hq) or tuple(ls.shape) != (P, Hq):
        raise ValueError(f"ms {tuple(ms.shape)} / ls {tuple(ls.shape)} must be [{P}, {Hq}]")
    if Hq > _MAX_GRID_YZ:
        raise ValueError(f"Hq={Hq} above {_MAX_GRID_YZ}")
    dev = os.device
    if P == 0 or Hq == 0 or d == 0:
        return (torch.zeros((Hq, d), device=dev), torch.full((Hq,), -math.inf, device=dev),
                torch.zeros(Hq, device=dev))  # fmt: skip
    o = be.empty((Hq, d), torch.float32, dev)
    m = be.empty((Hq,), torch.float32, dev)
    l = be.empty((Hq,), torch.float32, dev)
    with be.session(dev) as L:
        L.launch("attention.cu", "lse_merge_f32", (Hq,), (_MERGE_THREADS,),
                 (_f32c(os), _f32c(ms), _f32c(ls), _i32(P), _i32(Hq), _i32(d), o, m, l))  # fmt: skip
    return o, m, l


# ---------------------------------------------------------------------------
# 6. encode_keys
# ---------------------------------------------------------------------------


def encode_keys(K, codebooks, out=None):
    """K [Hkv, n, d] f32 / f16 / bf16 (any strides with a contiguous last axis),
    codebooks [Hkv, g, c, ds] f32, out optional [Hkv, >=n, g] of the code dtype with a
    contiguous last axis (e.g. a slice of the cache's code pool)
    -> P [Hkv, n, g] (view of out when given), uint8 if c <= 256 else int16 (c <= 32768):
    nearest centroid per group by squared L2, evaluated as argmax(x.c - |c|^2/2) in
    float32, ties -> lowest index."""
    torch = _torch()
    be = _backend()
    _check(be, K, "K", 3)
    _check(be, codebooks, "codebooks", 4, K.device)
    Hkv, n, d = K.shape
    Hkv2, g, c, ds = codebooks.shape
    if Hkv2 != Hkv or g * ds != d:
        raise ValueError(f"codebooks {tuple(codebooks.shape)} do not match K {tuple(K.shape)}")
    if str(K.dtype) not in _KV_SUFFIX:
        raise TypeError(f"K must be float32, float16 or bfloat16, got {K.dtype}")
    if not 1 <= c <= 32768:
        raise ValueError(f"c={c} outside [1, 32768]")
    if g > _MAX_GRID_YZ or Hkv > _MAX_GRID_YZ:
        raise ValueError("g and Hkv must be <= 65535")
    cdtype = torch.uint8 if c <= 256 else torch.int16
    dev = K.device
    if out is None:
        out = be.empty((Hkv, n, g), cdtype, dev)
    else:
        _check(be, out, "out", 3, dev)
        if out.dtype != cdtype or out.shape[0] != Hkv or out.shape[1] < n or out.shape[2] != g or (
            g > 1 and out.stride(2) != 1
        ):
            raise ValueError(f"out must be {cdtype} [Hkv, >=n, g] with a contiguous last axis")
    res = out[:, :n]
    if res.numel() == 0:
        return res
    _, optin = be.device_info(dev)
    smem = c * (ds + 1) * 4
    if smem > optin - _SMEM_MARGIN:
        raise ValueError(f"codebook of {c} x {ds} floats does not fit in shared memory")
    Kr = _rows(K)
    cb = _f32c(codebooks)
    kname = f"encode_keys_{_KV_SUFFIX[str(K.dtype)]}_{'u8' if c <= 256 else 'i16'}"
    grid = (_cdiv(n, _ENC_THREADS * _ENC_TOK), g, Hkv)
    with be.session(dev) as L:
        L.launch("pq.cu", kname, grid, (_ENC_THREADS,),
                 (Kr, _i64(Kr.stride(0)), _i64(Kr.stride(1)), cb, res, _i64(res.stride(0)), _i64(res.stride(1)),
                  _i32(n), _i32(d), _i32(g), _i32(c)),
                 shared_mem=smem)  # fmt: skip
    return res
