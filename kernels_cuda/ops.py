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
either.  The launch layer is a small backend object so that the tests can run
these same wrappers on the CPU emulator (``kernels_cuda._emu``).
"""

from __future__ import annotations

import contextlib
import functools
import math

import numpy as np

from . import _sources

__all__ = ["build_lut", "approx_scores", "threshold_select", "attend_exact", "lse_merge", "encode_keys"]

_THREADS = 256
_ENC_THREADS = _sources.constant("pq.cu", "MR_ENC_THREADS")
_ENC_TOK = _sources.constant("pq.cu", "MR_ENC_TOK")
_ATT_THREADS = _sources.constant("attention.cu", "MR_ATT_THREADS")
_ATT_TILE = _sources.constant("attention.cu", "MR_ATT_TILE")
_MERGE_THREADS = 128
_SMEM_DEFAULT = 48 * 1024  # dynamic shared memory available without opting in
_SMEM_MARGIN = 1024  # static __shared__ of every kernel here is < 1 KiB
_MAX_GRID_YZ = 65535

N_BINS = 2048  # threshold_select histogram bins
Z_RANGE = 32.0  # histogram covers [m - Z_RANGE, m]; lower scores share bin 0


def _torch():
    import torch

    return torch


# ---------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _cupy_module(file: str, dev: int):
    import cupy

    with cupy.cuda.Device(dev):
        return cupy.RawModule(code=_sources.source(file), options=_sources.OPTIONS[file])


@functools.lru_cache(maxsize=None)
def _cupy_kernel(file: str, name: str, dev: int):
    import cupy

    with cupy.cuda.Device(dev):
        return _cupy_module(file, dev).get_function(name)


class _CupyLauncher:
    def __init__(self, backend: "_CupyBackend", dev: int):
        self.be = backend
        self.dev = dev

    def launch(self, file, name, grid, block, args, shared_mem=0):
        k = _cupy_kernel(file, name, self.dev)
        if shared_mem > _SMEM_DEFAULT:
            key = (file, name, self.dev)
            if self.be.smem_set.get(key, 0) < shared_mem:
                k.max_dynamic_shared_size_bytes = int(shared_mem)
                self.be.smem_set[key] = int(shared_mem)
        k(tuple(grid), tuple(block), tuple(self.be.arg(a) for a in args), shared_mem=int(shared_mem))


class _CupyBackend:
    name = "cupy"

    def __init__(self):
        import cupy

        self.cp = cupy
        self.smem_set: dict = {}
        self._info: dict = {}
        self._streams: dict = {}

    def check_tensor(self, t, what):
        if not t.is_cuda:
            raise ValueError(f"{what} must be a CUDA tensor (got device {t.device})")

    def device_info(self, device):
        dev = device.index if device.index is not None else _torch().cuda.current_device()
        if dev not in self._info:
            rt = self.cp.cuda.runtime
            # cudaDevAttrMultiProcessorCount = 16, cudaDevAttrMaxSharedMemoryPerBlockOptin = 97
            self._info[dev] = (int(rt.deviceGetAttribute(16, dev)), int(rt.deviceGetAttribute(97, dev)))
        return self._info[dev]

    def empty(self, shape, dtype, device):
        return _torch().empty(shape, dtype=dtype, device=device)

    @contextlib.contextmanager
    def session(self, device):
        torch = _torch()
        cp = self.cp
        dev = device.index if device.index is not None else torch.cuda.current_device()
        ptr = torch.cuda.current_stream(dev).cuda_stream
        key = (dev, ptr)
        if key not in self._streams:   # one CuPy handle per torch stream (made once: a decode step launches ~10)
            self._streams[key] = (cp.cuda.Device(dev), cp.cuda.ExternalStream(ptr, dev), _CupyLauncher(self, dev))
        device_ctx, stream, launcher = self._streams[key]
        with device_ctx, stream:
            yield launcher

    def arg(self, a):
        """A tensor goes as its device address (what a RawKernel passes for an array anyway): a
        DLPack round trip per argument cost more than the kernels of a decode step."""
        if isinstance(a, _torch().Tensor):
            return np.uint64(a.data_ptr())
        return a  # numpy scalar of the kernel's parameter type


_backend_override = None


@functools.lru_cache(maxsize=1)
def _cupy_backend():
    return _CupyBackend()


def _backend():
    return _backend_override if _backend_override is not None else _cupy_backend()


def _set_backend(be):
    """Install a launch backend (tests: kernels_cuda._emu); returns the previous one."""
    global _backend_override
    prev = _backend_override
    _backend_override = be
    return prev


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _i32(x) -> np.int32:
    x = int(x)
    if not -(2**31) <= x < 2**31:
        raise ValueError(f"{x} does not fit in int32")
    return np.int32(x)


def _i64(x) -> np.int64:
    return np.int64(int(x))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check(be, t, what, ndim, device=None):
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch tensor, got {type(t).__name__}")
    be.check_tensor(t, what)
    if t.dim() != ndim:
        raise ValueError(f"{what} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{what} is on {t.device}, expected {device}")


def _f32c(t):
    """float32 with a contiguous layout (no copy if already so)."""
    return t.to(dtype=_torch().float32).contiguous()


def _rows(t):
    """Make the last axis contiguous (stride 1) without touching other strides if possible."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


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


def _tokens_per_block(n: int, rows: int, num_sms: int, lo: int, hi: int = 1 << 16) -> int:
    """Tokens per block (multiple of 256) for grids (nblk, rows): about 4 blocks per SM."""
    per_row = max(1, _cdiv(4 * num_sms, max(1, rows)))
    tpb = _cdiv(_cdiv(n, per_row), 256) * 256
    return int(min(max(tpb, lo), hi))


def _attend_split(n: int, Hq: int, num_sms: int) -> tuple[int, int]:
    """attend_partial's (tokens per split, nsplit) for n >= 1 tokens: about 2 blocks per SM."""
    tiles = _cdiv(n, _ATT_TILE)
    want = max(1, _cdiv(2 * num_sms, Hq))
    tps = _cdiv(tiles, min(tiles, want)) * _ATT_TILE
    return tps, _cdiv(n, tps)


def _score_blocks(n: int, Hq: int, num_sms: int) -> tuple[int, int]:
    """(tokens per block, nblk) of the (nblk, Hq) grids over n scores (scores, stats, selection)."""
    tpb = _tokens_per_block(n, Hq, num_sms, lo=2048)
    return tpb, _cdiv(n, tpb)


# ---------------------------------------------------------------------------
# Launches without checks: the wrappers below and kernels_cuda.decode.DecodeStep share them
# ---------------------------------------------------------------------------


def launch_build_lut(L, q, codebooks, q2k, T):
    """q [Hq, d] f32, codebooks [Hkv, g, c, ds] f32 (contiguous) -> T [Hq, g, c]."""
    Hq, d = q.shape
    _, g, c, _ = codebooks.shape
    L.launch("pq.cu", "build_lut_f32", (min(_cdiv(Hq * g * c, _THREADS), 1 << 20),), (_THREADS,),
             (q, codebooks, q2k, T, _i32(Hq), _i32(d), _i32(g), _i32(c)))


def launch_approx_scores(L, T, P, q2k, z, n, part_m, part_l, m, l, num_sms, optin):
    """z[:, :n] <- scores of T over codes P (rows contiguous), m, l <- their stats; part_m, part_l
    hold >= Hq * nblk floats (_score_blocks)."""
    Hq, g, c = T.shape
    tpb, nblk = _score_blocks(n, Hq, num_sms)
    smem = g * c * 4
    use_smem = smem <= optin - _SMEM_MARGIN
    isz = P.element_size()
    vec16 = (g * isz) % 16 == 0 and P.data_ptr() % 16 == 0 and (P.stride(0) * isz) % 16 == 0
    L.launch("scores.cu", "approx_scores_u8" if isz == 1 else "approx_scores_i16", (nblk, Hq), (_THREADS,),
             (T, P, _i64(P.stride(0)), q2k, z, _i64(z.stride(0)), part_m, part_l, _i32(n), _i32(g), _i32(c),
              _i32(tpb), _i32(use_smem), _i32(vec16)), shared_mem=smem if use_smem else 0)  # fmt: skip
    L.launch("scores.cu", "ms_reduce", (Hq,), (_THREADS,), (part_m, part_l, _i32(nblk), m, l))


def launch_zstats(L, z, n, part_m, part_l, m, l, num_sms):
    """m, l <- the softmax stats of z's first n columns (part_m, part_l as launch_approx_scores)."""
    Hq = z.shape[0]
    tpb, nblk = _score_blocks(n, Hq, num_sms)
    L.launch("scores.cu", "zstats_partial", (nblk, Hq), (_THREADS,),
             (z, _i64(z.stride(0)), _i32(n), _i32(tpb), part_m, part_l))
    L.launch("scores.cu", "ms_reduce", (Hq,), (_THREADS,), (part_m, part_l, _i32(nblk), m, l))


def launch_zhist(L, z, n, tpb, m, z_range, n_bins, hist, hcount, with_count):
    """zhist over z's first n columns (grid from tpb); hist [Hq, n_bins] f32 and hcount [Hq,
    n_bins] int32 zeroed by the caller (hcount only written with_count)."""
    Hq = z.shape[0]
    L.launch("scores.cu", "zhist", (_cdiv(n, tpb), Hq), (_THREADS,),
             (z, _i64(z.stride(0)), _i32(n), _i32(tpb), m, np.float32(z_range), _i32(n_bins), hist, hcount,
              _i32(with_count)), shared_mem=n_bins * 4 * (2 if with_count else 1))  # fmt: skip


def launch_zcut(L, hist, hcount, n_bins, tau, mode, m, l_all, cut, l_sel, counts, cap):
    L.launch("scores.cu", "zcut", (m.shape[0],), (_THREADS,),
             (hist, _i32(n_bins), np.float32(tau), _i32(mode), m, l_all, cut, l_sel, counts, hcount, _i32(cap)))


def launch_zcompact(L, z, n, tpb, m, z_range, n_bins, cut, idx, counts):
    L.launch("scores.cu", "zcompact", (_cdiv(n, tpb), z.shape[0]), (_THREADS,),
             (z, _i64(z.stride(0)), _i32(n), _i32(tpb), m, np.float32(z_range), _i32(n_bins), cut,
              idx, _i64(idx.stride(0)), counts))  # fmt: skip


def launch_attend_partial(L, q, K, V, q2k, mask, has_mask, n, tps, nsplit, o_p, m_p, l_p):
    """attend_partial's nsplit partials (tps tokens each, _attend_split) into o_p, m_p, l_p."""
    Hq, d = q.shape
    L.launch("attention.cu", "attend_partial_" + _KV_SUFFIX[str(K.dtype)], (nsplit, Hq), (_ATT_THREADS,),
             (q, K, _i64(K.stride(0)), _i64(K.stride(1)), V, _i64(V.stride(0)), _i64(V.stride(1)), q2k,
              mask, _i32(has_mask), _i32(n), _i32(d), _i32(tps), o_p, m_p, l_p),
             shared_mem=(d + _ATT_TILE + _ATT_THREADS) * 4)  # fmt: skip


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
    cap: at most this many tokens per head (0 < tau < 1 only): the top bins whose
    count stays <= cap, the top bin always (scores.cu, zcut); counts may then
    exceed cap only when the top bin alone does (take any cap of them)
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
    mode = 1 if tau >= 1.0 else (2 if tau <= 0.0 else 0)
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
        launch_zcut(L, hist, hcount, n_bins, tau, mode, m, l_all, cut, l_sel, counts, cap if capped else 0)
        launch_zcompact(L, z, n, tpb, m, z_range, n_bins, cut, idx, counts)
    return idx, counts, m, l_sel


# ---------------------------------------------------------------------------
# 4. attend_exact (split-K)
# ---------------------------------------------------------------------------

_KV_SUFFIX = {"torch.float32": "f32", "torch.float16": "f16", "torch.bfloat16": "bf16"}


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
