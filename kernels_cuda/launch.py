"""The launch layer of kernels_cuda: backends, argument helpers, launch geometry, and one
launch helper per kernel without argument checks.

A backend compiles and launches (CuPy's RawModule on torch's current stream; the tests install
the CPU emulator of tests/support/cuda_emu.py as `_backend_override`). The checked wrappers of ops.py and the
decode step's persistent-buffer launches (decode.DecodeStep) both go through the `launch_*`
helpers here, so each kernel's argument list is written once.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np

from . import _sources

_THREADS = 256
_ENC_THREADS = _sources.constant("pq.cu", "MR_ENC_THREADS")
_ENC_TOK = _sources.constant("pq.cu", "MR_ENC_TOK")
_ATT_THREADS = _sources.constant("attention.cu", "MR_ATT_THREADS")
_ATT_TILE = _sources.constant("attention.cu", "MR_ATT_TILE")
_GQA_THREADS = _sources.constant("attention.cu", "MR_GQA_THREADS")
_GQA_UNIT = 128   # attend_gqa's tokens per split: a multiple of this (32 per warp and more)
_SMEM_DEFAULT = 48 * 1024  # dynamic shared memory available without opting in
_SMEM_MARGIN = 1024  # static __shared__ of every kernel here is < 1 KiB
_MAX_GRID_YZ = 65535

N_BINS = 2048  # threshold_select histogram bins
Z_RANGE = 32.0  # histogram covers [m - Z_RANGE, m]; lower scores share bin 0
_KV_SUFFIX = {"torch.float32": "f32", "torch.float16": "f16", "torch.bfloat16": "bf16"}


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


_backend_override = None   # a backend installed in place of CuPy's (the tests' emulator, tests/support/cuda_emu.py)


@functools.lru_cache(maxsize=1)
def _cupy_backend():
    return _CupyBackend()


def _backend():
    return _backend_override if _backend_override is not None else _cupy_backend()


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


def _tokens_per_block(n: int, rows: int, num_sms: int, lo: int, hi: int = 1 << 16) -> int:
    """Tokens per block (multiple of 256) for grids (nblk, rows): about 4 blocks per SM."""
    per_row = max(1, _cdiv(4 * num_sms, max(1, rows)))
    tpb = _cdiv(_cdiv(n, per_row), 256) * 256
    return int(min(max(tpb, lo), hi))


def gqa_group(Hq: int, Hkv: int, d: int) -> int:
    """The query heads per kv head that attend_gqa takes at once (0: the shape is attend_partial's):
    Hq = G Hkv with G <= 8, d = 8 * 2^k <= 256 (a token is d / 8 lanes of a warp)."""
    G = Hq // Hkv if Hkv and Hq % Hkv == 0 else 0
    return G if 1 <= G <= 8 and d in (8, 16, 32, 64, 128, 256) else 0


def _attend_plan(Hq: int, Hkv: int, d: int, num_sms: int) -> tuple[int, int]:
    """(tokens per split: a multiple of this, splits wanted) of the kernel that takes this shape:
    attend_gqa about 3 blocks of 4 warps per SM over Hkv rows (what its registers let stay resident), attend_partial about 2 blocks of 8
    warps per SM over Hq rows."""
    if gqa_group(Hq, Hkv, d):
        return _GQA_UNIT, _cdiv(3 * num_sms, Hkv)
    return _ATT_TILE, max(1, _cdiv(2 * num_sms, Hq))


def _attend_split(n: int, Hq: int, num_sms: int, Hkv: int = 0, d: int = 0) -> tuple[int, int]:
    """The decode attention's (tokens per split, nsplit) for n >= 1 tokens (Hkv = 0: attend_partial's)."""
    unit, want = _attend_plan(Hq, Hkv, d, num_sms)
    units = _cdiv(n, unit)
    tps = _cdiv(units, min(units, want)) * unit
    return tps, _cdiv(n, tps)


def _attend_split_max(capacity: int, Hq: int, num_sms: int, Hkv: int = 0, d: int = 0) -> int:
    """The most splits _attend_split gives for any n <= capacity (the partial buffers' size): one per
    unit while the units are fewer than the blocks wanted, never more than that number after."""
    unit, want = _attend_plan(Hq, Hkv, d, num_sms)
    return max(1, min(_cdiv(max(capacity, 1), unit), want))


def select_mode(tau: float, cap, n: int) -> int:
    """zcut's mode for a selection over n scores: 0 = the histogram cut (0 < tau < 1, or tau >= 1
    with a cap below n: whole bins from the top, at most cap tokens, the cap alone cutting; per-head
    caps, any array: always),
    1 = every token, 2 = none (tau <= 0). The one rule behind every GPU selection."""
    if tau <= 0.0:
        return 2
    if cap is not None and not np.isscalar(cap):    # per-head caps: each head cuts its histogram
        return 0
    return 0 if tau < 1.0 or (cap and 0 < cap < n) else 1


def zcut_tau(tau: float) -> float:
    """The tau zcut gets: tau >= 1 as 2, a mass no rounding of the histogram's sum reaches, so that
    only a cap cuts (tau 1 itself could stop a bin early and drop tokens of tiny mass)."""
    return 2.0 if tau >= 1.0 else tau


def _score_blocks(n: int, Hq: int, num_sms: int) -> tuple[int, int]:
    """(tokens per block, nblk) of the (nblk, Hq) grids over n scores (scores, stats, selection)."""
    tpb = _tokens_per_block(n, Hq, num_sms, lo=2048)
    return tpb, _cdiv(n, tpb)


# ---------------------------------------------------------------------------
# Launches without checks: kernels_cuda.decode.DecodeStep (and the tests' checked wrappers) use them
# ---------------------------------------------------------------------------


def launch_build_lut(L, q, codebooks, q2k, T):
    """q [Hq, d] f32, codebooks [Hkv, g, c, ds] f32 (contiguous) -> T [Hq, g, c]."""
    Hq, d = q.shape
    _, g, c, _ = codebooks.shape
    L.launch("pq.cu", "build_lut_f32", (min(_cdiv(Hq * g * c, _THREADS), 1 << 20),), (_THREADS,),
             (q, codebooks, q2k, T, _i32(Hq), _i32(d), _i32(g), _i32(c)))


def _live(n_live, dummy):
    """The (n_live, has_live) kernel arguments: an int32 [1] device count, or an unread dummy."""
    return (n_live, _i32(1)) if n_live is not None else (dummy, _i32(0))


def score_parts(n: int, Hq: int, num_sms: int) -> int:
    """The part_m / part_l entries per query head an approx_scores launch over n tokens writes."""
    return _score_blocks(n, Hq, num_sms)[1]


def launch_approx_scores(L, T, P, q2k, z, n, part_m, part_l, m, l, num_sms, optin, n_live=None):
    """z[:, :n] <- scores of T [Hq, g, c] over codes P (rows contiguous), m, l <- their stats;
    part_m, part_l hold >= Hq * score_parts(n) floats. n_live: int32 [1] on the device, the tokens
    actually scored (min(n, n_live[0])) when the grid is sized for a bucket n (a captured decode
    token)."""
    Hq, g, c = T.shape
    isz = P.element_size()
    vec16 = (g * isz) % 16 == 0 and P.data_ptr() % 16 == 0 and (P.stride(0) * isz) % 16 == 0
    tpb, nblk = _score_blocks(n, Hq, num_sms)
    smem = g * c * 4
    use_smem = smem <= optin - _SMEM_MARGIN
    L.launch("scores.cu", "approx_scores_u8" if isz == 1 else "approx_scores_i16", (nblk, Hq), (_THREADS,),
             (T, P, _i64(P.stride(0)), q2k, z, _i64(z.stride(0)), part_m, part_l, _i32(n), _i32(g), _i32(c),
              _i32(tpb), _i32(use_smem), _i32(vec16), *_live(n_live, q2k)), shared_mem=smem if use_smem else 0)  # fmt: skip
    L.launch("scores.cu", "ms_reduce", (Hq,), (_THREADS,), (part_m, part_l, _i32(nblk), m, l))


def launch_zhist(L, z, n, tpb, m, z_range, n_bins, hist, hcount, with_count, n_live=None):
    """zhist over z's first n columns (grid from tpb; n_live as launch_approx_scores); hist [Hq,
    n_bins] f32 and hcount [Hq, n_bins] int32 zeroed by the caller (hcount only written with_count)."""
    Hq = z.shape[0]
    L.launch("scores.cu", "zhist", (_cdiv(n, tpb), Hq), (_THREADS,),
             (z, _i64(z.stride(0)), _i32(n), _i32(tpb), m, np.float32(z_range), _i32(n_bins), hist, hcount,
              _i32(with_count), *_live(n_live, m.view(_torch().int32))),
             shared_mem=n_bins * 4 * (2 if with_count else 1))  # fmt: skip


def launch_zcut(L, hist, hcount, n_bins, tau, mode, m, l_all, cut, l_sel, counts, cap, caps=None):
    """caps: optional int32 [Hq] on the device, each head's cap in place of cap (< 0: none selected)."""
    L.launch("scores.cu", "zcut", (m.shape[0],), (_THREADS,),
             (hist, _i32(n_bins), np.float32(tau), _i32(mode), m, l_all, cut, l_sel, counts, hcount, _i32(cap),
              *((caps, _i32(1)) if caps is not None else (hcount, _i32(0)))))   # (unread dummy: an input)


def launch_zcompact(L, z, n, tpb, m, z_range, n_bins, cut, idx, counts, n_live=None):
    L.launch("scores.cu", "zcompact", (_cdiv(n, tpb), z.shape[0]), (_THREADS,),
             (z, _i64(z.stride(0)), _i32(n), _i32(tpb), m, np.float32(z_range), _i32(n_bins), cut,
              idx, _i64(idx.stride(0)), counts, *_live(n_live, cut)))  # fmt: skip


def _rows_aligned(t) -> bool:
    return t.stride(0) % 8 == 0 and t.stride(1) % 8 == 0 and t.data_ptr() % 16 == 0


def launch_attend_partial(L, q, K, V, q2k, mask, has_mask, n, tps, nsplit, o_p, m_p, l_p, grouped=False):
    """The decode attention's nsplit partials (tps tokens each, _attend_split) into o_p, m_p, l_p.
    grouped: q2k is h // G (every cache here has it): attend_gqa where the shape and the rows'
    alignment allow; else attend_partial (any q2k)."""
    Hq, d = q.shape
    Hkv = K.shape[0]
    G = gqa_group(Hq, Hkv, d) if grouped else 0
    sfx = _KV_SUFFIX[str(K.dtype)]
    if G and _rows_aligned(K) and _rows_aligned(V):
        maxg = 4 if G <= 4 else 8
        L.launch("attention.cu", f"attend_gqa_{sfx}_g{maxg}", (nsplit, Hkv), (_GQA_THREADS,),
                 (q, K, _i64(K.stride(0)), _i64(K.stride(1)), V, _i64(V.stride(0)), _i64(V.stride(1)), _i32(G),
                  mask, _i32(has_mask), _i32(n), _i32(d), _i32(tps), o_p, m_p, l_p),
                 shared_mem=(_GQA_THREADS // 32) * maxg * d * 4)  # fmt: skip
        return
    L.launch("attention.cu", "attend_partial_" + sfx, (nsplit, Hq), (_ATT_THREADS,),
             (q, K, _i64(K.stride(0)), _i64(K.stride(1)), V, _i64(V.stride(0)), _i64(V.stride(1)), q2k,
              mask, _i32(has_mask), _i32(n), _i32(d), _i32(tps), o_p, m_p, l_p),
             shared_mem=(d + _ATT_TILE + _ATT_THREADS) * 4)  # fmt: skip
