"""Checked entry points to kernels_cuda's kernels, for the tests: each takes fresh torch tensors,
checks shapes, dtypes, strides and devices (index *values*, e.g. q_to_kv entries on the GPU, are not
validated), allocates its outputs through the backend and runs the same launch helpers the
runtime's persistent-buffer steps use (kernels_cuda.launch.launch_*, kernels_cuda.decode's
_launch_*), on a GPU or on the CPU emulator (cuda_emu). The tests compare them with the NumPy
references (tests/support/references). The runtime's own checked wrapper is kernels_cuda.encode_keys.
"""
from __future__ import annotations

import math

import numpy as np

from kernels_cuda.decode import (_GATHER_MAX_GROUP, _GATHER_THREADS, _OUT_SUFFIX, gather_splits,
                                 _launch_gather_grouped, _launch_merge, _launch_pack, _launch_prep, _launch_store_rows,
                                 group_size)
from kernels_cuda.launch import (N_BINS, Z_RANGE, _ATT_THREADS, _KV_SUFFIX, _MAX_GRID_YZ, _SMEM_MARGIN, _attend_split,
                                 _backend, _check, _f32c, _rows, _score_blocks, _torch, launch_approx_scores,
                                 launch_attend_partial, launch_build_lut, launch_zcompact, launch_zcut, launch_zhist,
                                 score_parts, select_mode, zcut_tau)

__all__ = ["build_lut", "approx_scores", "threshold_select", "attend_exact", "decode_prep", "pack_selection",
           "lse_merge_staged", "store_rows", "gather_value_sum"]


_Q2K_CACHE: dict = {}


def _q2k(be, q_to_kv, Hq: int, Hkv: int, device):
    """q_to_kv as an int32 tensor on `device`.  A tensor already there is used as is
    (its values are not checked: that would need a device sync); host input (list,
    numpy, CPU tensor) is validated and its device copy cached."""
    torch = _torch()
    if isinstance(q_to_kv, torch.Tensor) and q_to_kv.device == device:
        if tuple(q_to_kv.shape) != (Hq,):
            raise ValueError(f"q_to_kv must have shape [{Hq}], got {tuple(q_to_kv.shape)}")
        return q_to_kv.to(torch.int32).contiguous()
    a = np.asarray(q_to_kv.cpu() if isinstance(q_to_kv, torch.Tensor) else q_to_kv).astype(np.int64)
    if a.shape != (Hq,):
        raise ValueError(f"q_to_kv must have shape [{Hq}], got {a.shape}")
    if Hq and (a.min() < 0 or a.max() >= Hkv):
        raise ValueError(f"q_to_kv values must lie in [0, {Hkv})")
    key = (be.name, str(device), tuple(a.tolist()))
    t = _Q2K_CACHE.get(key)
    if t is None:
        # never evicted (a handful of maps per process): a cached tensor may still be
        # read by a kernel queued on another stream
        t = torch.as_tensor(a.astype(np.int32)).to(device)
        _Q2K_CACHE[key] = t
    return t


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
    nblk = score_parts(n, Hq, num_sms)
    part_m = be.empty((Hq, nblk), torch.float32, T.device)
    part_l = be.empty((Hq, nblk), torch.float32, T.device)
    m = be.empty((Hq,), torch.float32, T.device)
    l = be.empty((Hq,), torch.float32, T.device)
    with be.session(T.device) as L:
        launch_approx_scores(L, Tc, P, q2k, z, n, part_m, part_l, m, l, num_sms, optin)
    return z, (m, l)


def threshold_select(z, tau, out_idx=None, *, stats=None, n_bins=N_BINS, z_range=Z_RANGE, cap=None, caps=None):
    """Per head, the tokens holding >= tau of the softmax mass of z, without a sort.

    z [Hq, n] f32 (contiguous rows), tau float, out_idx optional int32 [Hq, >=n]
    (contiguous rows), stats optional (m [Hq], l [Hq]) as returned by
    approx_scores for this z (skips one pass over z)
    cap: at most this many tokens per head, any tau > 0 (launch.select_mode): the
    top bins whose count stays <= cap and whose mass reaches tau, the top bin
    always (scores.cu, zcut); counts may then exceed cap only when the top bin
    alone does (take any cap of them)
    caps: int32 [Hq] on z's device, each head's own cap in place of cap (0: none, < 0: the head
    selects nothing)
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
    if n_bins * 4 * (2 if cap or caps is not None else 1) > optin - _SMEM_MARGIN:
        raise ValueError(f"n_bins={n_bins} does not fit in shared memory")
    tpb, nblk = _score_blocks(n, Hq, num_sms)
    mode = select_mode(tau, cap if caps is None else caps, n)
    cut = be.empty((Hq,), torch.int32, dev)
    l_sel = be.empty((Hq,), torch.float32, dev)
    counts = be.empty((Hq,), torch.int32, dev)  # zeroed by zcut
    with be.session(dev) as L:
        if stats is None:            # the softmax stats of z's first n columns, NaN and -inf ignored
            zf = z[:, :n]
            live = (zf == zf) & (zf != float("-inf"))
            m = torch.where(live, zf, float("-inf")).amax(1)
            l_all = torch.where(live, torch.exp(zf - m[:, None]), 0.0).sum(1)
        else:
            m, l_all = stats
            for t, w in ((m, "stats m"), (l_all, "stats l")):
                _check(be, t, w, 1, dev)
                if tuple(t.shape) != (Hq,) or t.dtype != torch.float32:
                    raise ValueError(f"{w} must be float32 [{Hq}]")
            m, l_all = m.contiguous(), l_all.contiguous()
        capped = mode == 0 and (caps is not None or (cap is not None and 0 < cap < n))
        hists = be.empty((2, Hq, n_bins), torch.float32, dev)   # mass | token counts (int32 bits)
        hist, hcount = hists[0], hists[1].view(torch.int32)
        if mode == 0:
            hists.zero_()
            launch_zhist(L, z, n, tpb, m, z_range, n_bins, hist, hcount, capped)
        launch_zcut(L, hist, hcount, n_bins, zcut_tau(tau), mode, m, l_all, cut, l_sel, counts,
                    cap if capped and caps is None else 0, caps)
        launch_zcompact(L, z, n, tpb, m, z_range, n_bins, cut, idx, counts)
    return idx, counts, m, l_sel


def attend_exact(q, K, V, q_to_kv, n, valid=None, kernel="auto"):
    """q [Hq, d] f32 (pre-scaled), K, V [Hkv, n_cap, d] f32 / f16 / bf16 (same dtype; first
    n rows valid; any strides with a contiguous last axis), q_to_kv int32 [Hq],
    valid: optional uint8 [>= n] (0: that row holds no token and is left out, e.g. ring slots a
    truncate emptied) -> (o [Hq, d] f32 normalized, m [Hq] max score, l [Hq] sum exp(s - m)).
    n = 0 or no valid row -> o = 0, m = -inf, l = 0.  Split-K over token ranges (as the decode steps
    launch it: attend_gqa where q_to_kv is h // G and the shape allows, else attend_partial; kernel
    "partial" forces attend_partial), then an LSE merge."""
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
    G = Hq // Hkv if Hq % Hkv == 0 else 0
    grouped = kernel != "partial" and G > 0 and torch.equal(
        q2k.cpu().long(), torch.arange(Hq) // G)
    tps, nsplit = _attend_split(n, Hq, num_sms, Hkv if grouped else 0, d)
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
        launch_attend_partial(L, qf, K, V, q2k, mask, has_mask, n, tps, nsplit, o_p, m_p, l_p, grouped=grouped)
        if nsplit > 1:   # o: the runtime's merge (decode.cu, an empty staged part); m, l from the partials
            _launch_merge(L, o_p, m_p, l_p, nsplit, torch.zeros((Hq, d + 2), device=dev), o)
    if nsplit > 1:
        live = (l_p > 0) & (m_p > -math.inf)
        M = torch.where(live, m_p, -math.inf).max(dim=0).values
        l.copy_(torch.where(live, torch.exp(m_p - M) * l_p, 0.0).sum(dim=0))
        m.copy_(torch.where(l > 0, M, -math.inf))
    return o, m, l


def decode_prep(q, k, v, scale, k_slot, v_slot, cs=None, zero=None, rope=None):
    """q [Hq, d], k, v [Hkv, d] of one dtype (f32 / f16 / bf16; contiguous rows), k_slot, v_slot
    [Hkv, d] views of that dtype (written), cs optional f32 [d] = [cos | sin] of the far turn, zero
    optional f32 tensor (contiguous; zeroed) -> (qs [Hq, d] f32 = q * scale, qf [Hq, d] f32 = qs
    turned by cs, or None without cs); k_slot <- k, v_slot <- v. rope: optional [d] of q's dtype
    (f32 / bf16), the position's [cos | sin]: q and k are turned by it first (as layer.rope_)."""
    torch = _torch()
    be = _backend()
    _check(be, q, "q", 2)
    for t, w in ((k, "k"), (v, "v"), (k_slot, "k_slot"), (v_slot, "v_slot")):
        _check(be, t, w, 2, q.device)
        if t.dtype != q.dtype or tuple(t.shape) != tuple(k.shape) or t.stride(-1) != 1:
            raise ValueError(f"{w} must be {q.dtype} {tuple(k.shape)} with contiguous rows")
    Hq, d = q.shape
    if q.stride(-1) != 1 or k.shape[1] != d or d % 2:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)}: need contiguous rows, one even d")
    dev = q.device
    qs = be.empty((Hq, d), torch.float32, dev)
    qf = be.empty((Hq, d), torch.float32, dev)
    if cs is None:
        cs_t = be.empty((d,), torch.float32, dev)
    else:
        _check(be, cs, "cs", 1, dev)
        cs_t = cs.to(torch.float32).contiguous()
        if cs_t.shape[0] != d:
            raise ValueError(f"cs must have {d} entries")
    if zero is None:
        zero = be.empty((1,), torch.float32, dev)
        n_zero = 0
    else:
        _check(be, zero, "zero", zero.dim(), dev)
        if zero.dtype != torch.float32 or not zero.is_contiguous():
            raise ValueError("zero must be a contiguous float32 tensor")
        n_zero = zero.numel()
    if rope is not None:
        _check(be, rope, "rope", 1, dev)
        if rope.dtype != q.dtype or q.dtype not in (torch.float32, torch.bfloat16) or rope.shape[0] != d:
            raise ValueError(f"rope must be float32 / bfloat16 [{d}] of q's dtype")
    with be.session(dev) as L:
        _launch_prep(L, q, k, v, scale, cs_t, cs is not None, qs, qf, k_slot, v_slot, zero, n_zero,
                     None if rope is None else rope.contiguous())
    return qs, (qf if cs is not None else None)


def pack_selection(idx, z, counts, w, cap=None):
    """idx int32 [Hq, >= w'] (rows contiguous), z f32 [Hq, n] (rows contiguous), counts int32
    [Hq], w >= 1, cap optional -> pack int32 [Hq (2 w + 1)] = [c | idx rows | z bits rows], c =
    min(counts, cap), the rows' first min(c, w) entries written (indices clamped to [0, n))."""
    torch = _torch()
    be = _backend()
    _check(be, idx, "idx", 2)
    _check(be, z, "z", 2, idx.device)
    _check(be, counts, "counts", 1, idx.device)
    Hq, n = z.shape
    if idx.dtype != torch.int32 or idx.shape[0] != Hq or idx.stride(-1) != 1:
        raise ValueError("idx must be int32 [Hq, ...] with contiguous rows")
    if z.dtype != torch.float32 or z.stride(-1) != 1 or counts.dtype != torch.int32 or counts.shape[0] != Hq:
        raise ValueError("z must be float32 with contiguous rows, counts int32 [Hq]")
    if n < 1 or w < 1:
        raise ValueError("need n >= 1 and w >= 1")
    pack = be.empty((Hq * (2 * w + 1),), torch.int32, idx.device)
    with be.session(idx.device) as L:
        _launch_pack(L, idx, z, counts.contiguous(), 2**31 - 1 if cap is None else cap, n, w, pack)
    return pack


def lse_merge_staged(os, ms, ls, stage, out_dtype=None):
    """os [P, Hq, d], ms, ls [P, Hq] f32 (contiguous), stage f32 [Hq, d + 2] (o | m | l per row)
    -> o [Hq, d] in out_dtype (float32 default, or bfloat16): lse_merge of the P + 1 parts."""
    torch = _torch()
    be = _backend()
    _check(be, os, "os", 3)
    _check(be, stage, "stage", 2, os.device)
    P, Hq, d = os.shape
    if tuple(ms.shape) != (P, Hq) or tuple(ls.shape) != (P, Hq) or tuple(stage.shape) != (Hq, d + 2):
        raise ValueError("ms, ls must be [P, Hq], stage [Hq, d + 2]")
    out_dtype = out_dtype or torch.float32
    if str(out_dtype) not in _OUT_SUFFIX:
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    o = be.empty((Hq, d), out_dtype, os.device)
    f = [t.to(torch.float32).contiguous() for t in (os, ms, ls, stage)]
    with be.session(os.device) as L:
        _launch_merge(L, f[0], f[1], f[2], P, f[3], o)
    return o


def store_rows(src, dst, row):
    """src [R, d] (f32 / f16 / bf16, rows contiguous), dst [R, tokens, d] of src's dtype (contiguous
    rows; on a GPU device memory or mapped host memory: the value pool), row int32 [1] on src's
    device -> dst[:, row[0]] = src (in place; reference store_rows_ref)."""
    torch = _torch()
    be = _backend()
    _check(be, src, "src", 2)
    _check(be, row, "row", 1, src.device)
    if be.name != "cupy":
        _check(be, dst, "dst", 3)
    if str(src.dtype) not in _KV_SUFFIX or dst.dtype != src.dtype or src.stride(-1) != 1 or dst.stride(-1) != 1:
        raise ValueError("src and dst must be one of f32 / f16 / bf16 with contiguous rows")
    if dst.dim() != 3 or dst.shape[0] != src.shape[0] or dst.shape[2] != src.shape[1]:
        raise ValueError(f"dst {tuple(dst.shape)} must be [R, tokens, d] for src {tuple(src.shape)}")
    if row.dtype != torch.int32 or row.numel() != 1:
        raise ValueError("row must be int32 [1]")
    with be.session(src.device) as L:
        _launch_store_rows(L, src, dst, row)
    return dst


def gather_value_sum(idx, z, counts, m, V, q_to_kv, n, group, cap=None, nsplit=None, head_dim=None):
    """idx int32 [Hq, >= c] and z f32 [Hq, >= n] (rows contiguous), counts int32 [Hq], m f32
    [Hq] (>= every z[h, :n]), V [Hkv, tokens, d] f32 / f16 / bf16 with contiguous rows -- on a GPU
    page-locked host memory (the value pool), under the emulator a CPU tensor --, q_to_kv [Hq]
    h // (Hq / Hkv) (checked, then unread), group = (cut int32 [Hq], z_range, n_bins) of the
    threshold selection that made idx (a cut of n_bins: each head's list alone)
    -> (os [nsplit, Hq, d], ms, ls [nsplit, Hq]) f32: partials whose merge is each head's weighted
    sum over its first min(counts, cap) entries; nsplit defaults to gather_splits of the widest list.
    V uint8 [Hkv, tokens, width]: quantized rows (minirun/kv/value_codes.py) of head_dim channels."""
    torch = _torch()
    be = _backend()
    _check(be, idx, "idx", 2)
    dev = idx.device
    for t, w, nd in ((z, "z", 2), (counts, "counts", 1), (m, "m", 1)):
        _check(be, t, w, nd, dev)
    if be.name == "cupy":
        if V.is_cuda or not V.is_pinned():
            raise ValueError("V must be page-locked host memory (the value pool)")
    else:
        _check(be, V, "V", 3)
    Hq = z.shape[0]
    if idx.dtype != torch.int32 or idx.shape[0] != Hq or idx.stride(-1) != 1:
        raise ValueError("idx must be int32 [Hq, ...] with contiguous rows")
    if z.dtype != torch.float32 or z.stride(-1) != 1 or z.shape[1] < n or n < 1:
        raise ValueError("z must be float32 [Hq, >= n] with contiguous rows, n >= 1")
    if counts.dtype != torch.int32 or tuple(counts.shape) != (Hq,) or m.dtype != torch.float32 or m.shape[0] != Hq:
        raise ValueError("counts must be int32 [Hq], m float32 [Hq]")
    quantized = V.dtype == torch.uint8
    d = head_dim if quantized else V.shape[2]
    if quantized and (d is None or d % 32 or V.shape[2] not in (d + d // 16, d // 2 + d // 8)):
        raise ValueError("quantized V needs head_dim (a multiple of 32) and rows of q8 or q4 width")
    if (V.dim() != 3 or (str(V.dtype) not in _KV_SUFFIX and not quantized) or V.stride(-1) != 1 or d % 2
            or not 2 <= d <= _GATHER_THREADS or V.stride(0) % 2 or V.stride(1) % 2
            or V.data_ptr() % (2 * V.element_size())):   # (the kernel loads two elements at a time)
        raise ValueError(f"V must be [Hkv, tokens, d] f32 / f16 / bf16, d even and <= {_GATHER_THREADS}, with "
                         "contiguous rows aligned to two elements")
    cap = 2**31 - 1 if cap is None else int(cap)
    Hkv = V.shape[0]
    cut, z_range, n_bins = group
    g = group_size(Hq, Hkv)
    if not g:
        raise ValueError(f"the gather needs Hq = g Hkv, g <= {_GATHER_MAX_GROUP}")
    _check(be, cut, "cut", 1, dev)
    q2k = np.asarray(q_to_kv.cpu() if isinstance(q_to_kv, torch.Tensor) else q_to_kv)
    if not np.array_equal(q2k, np.arange(Hq) // g):
        raise ValueError("the gather reads kv head h // g for query head h: q_to_kv must be that")
    if nsplit is None:
        nsplit = gather_splits(min(idx.shape[1], cap), Hq, g, be.device_info(dev)[0])
    os = be.empty((nsplit, Hq, d), torch.float32, dev)
    ms = be.empty((nsplit, Hq), torch.float32, dev)
    ls = be.empty((nsplit, Hq), torch.float32, dev)
    with be.session(dev) as L:
        _launch_gather_grouped(L, idx, z, counts.contiguous(), cap, n, m.contiguous(), cut.contiguous(), z_range,
                               n_bins, g, V, nsplit, os, ms, ls, d)
    return os, ms, ls
