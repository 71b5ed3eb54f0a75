"""One HCA decode step's launches with persistent buffers (minirun/kv/hca_cuda.py's hot path).

On an H100 a decode step of SmolLM2 was bound by the host: ~10 kernels_cuda wrappers (argument
checks, torch allocations, a stream session each) and ~20 torch ops per layer and token
(docs/PROFILE.md). `DecodeStep` allocates every output and temporary once,
launches the scoring and selection kernels through launch.py's helpers (as ops.py does), and adds the
three kernels of decode.cu that replace torch glue: the step's query preparation (+ the new token
staged into the exact tier's spare row, + the histogram zeroed), the copy-back pack, and the merge
with the host's staged part written in the model's dtype.

The checked wrappers `decode_prep`, `pack_selection`, `lse_merge_staged` run the same launches on
fresh tensors (the tests compare them with tests/references/gpu.py).
"""

from __future__ import annotations

import numpy as np

from . import _sources
from .launch import (_ATT_THREADS, _ATT_TILE, _KV_SUFFIX, N_BINS, Z_RANGE, _attend_split, _backend, _cdiv, _check,
                     _i32, _i64, _q2k, _SMEM_MARGIN, _score_blocks, _torch, launch_approx_scores, select_mode, zcut_tau,
                     launch_attend_partial, launch_build_lut, launch_zcompact, launch_zcut, launch_zhist, launch_zstats)

__all__ = ["DecodeStep", "decode_prep", "pack_selection", "lse_merge_staged", "gather_value_sum", "store_rows",
           "gather_splits",
           "group_size", "grouped_layout", "host_pool_readable"]

_PREP_THREADS = _sources.constant("decode.cu", "MR_PREP_THREADS")
_PACK_THREADS = _sources.constant("decode.cu", "MR_PACK_THREADS")
_MERGE_THREADS = _sources.constant("decode.cu", "MR_MERGE_THREADS")
_GATHER_THREADS = _sources.constant("gather.cu", "MR_GATHER_THREADS")
_GATHER_MIN_SHARE = 64   # tokens a gather block takes at least (fewer: more blocks than work)
_GATHER_MAX_GROUP = _sources.constant("gather.cu", "MR_GATHER_MAX_GROUP")
_OUT_SUFFIX = {"torch.float32": "f32", "torch.bfloat16": "bf16"}


def _launch_prep(L, q, k, v, scale, cs, has_far, qs, qf, k_slot, v_slot, zero, n_zero):
    Hq, d = q.shape
    Hkv = k.shape[0]
    L.launch("decode.cu", "decode_prep_" + _KV_SUFFIX[str(q.dtype)], (Hq + 2 * Hkv,), (_PREP_THREADS,),
             (q, _i64(q.stride(0)), k, _i64(k.stride(0)), v, _i64(v.stride(0)), np.float32(scale), cs,
              _i32(has_far), _i32(Hq), _i32(Hkv), _i32(d), qs, qf, k_slot, _i64(k_slot.stride(0)), v_slot,
              _i64(v_slot.stride(0)), zero, _i64(n_zero)))  # fmt: skip


def _launch_pack(L, idx, z, counts, cap, n, w, pack):
    kname = "pack_selection_i64" if idx.dtype == _torch().int64 else "pack_selection_i32"
    L.launch("decode.cu", kname, (z.shape[0],), (_PACK_THREADS,),
             (idx, _i64(idx.stride(0)), z, _i64(z.stride(0)), counts, _i32(cap), _i32(n), _i32(w), pack))


def _launch_merge(L, os, ms, ls, P, stage, o):
    Hq, d = o.shape
    L.launch("decode.cu", "lse_merge_staged_" + _OUT_SUFFIX[str(o.dtype)], (Hq,), (_MERGE_THREADS,),
             (os, ms, ls, _i32(P), stage, _i32(Hq), _i32(d), o))


def _launch_store_rows(L, src, dst, row):
    kname = "store_rows_b32" if src.element_size() == 4 else "store_rows_b16"
    L.launch("decode.cu", kname, (src.shape[0],), (_PREP_THREADS,),
             (src, _i64(src.stride(0)), row, dst, _i64(dst.stride(0)), _i64(dst.stride(1)), _i32(src.shape[1])))


def gather_splits(width: int, Hq: int, num_sms: int) -> int:
    """nsplit of gather_value_sum for lists of at most `width` tokens: about 4 blocks per SM (every
    row read crosses the host bus, so many reads in flight), each block >= 64 tokens of a full list."""
    return max(1, min(_cdiv(4 * num_sms, max(1, Hq)), _cdiv(max(width, 1), _GATHER_MIN_SHARE)))


def group_size(Hq: int, Hkv: int) -> int:
    """Query heads per kv head the grouped gather takes (0: none, only the per-head gather)."""
    g = Hq // Hkv if Hkv and Hq % Hkv == 0 else 0
    return g if g <= _GATHER_MAX_GROUP else 0


def grouped_layout(q_to_kv, Hq: int, Hkv: int) -> bool:
    """Whether q_to_kv is the grouped gather's layout: query head h reads kv head h // g."""
    g = group_size(Hq, Hkv)
    return g > 0 and bool(np.array_equal(np.asarray(q_to_kv), np.arange(Hq) // g))


def _gather_nsplit(width: int, Hq: int, group: int, num_sms: int) -> int:
    """nsplit of a gather over lists of at most `width` tokens: per query head (group 0), or per kv
    group over its group * width entries (gather_value_sum_grouped)."""
    return gather_splits(width * group, Hq // group, num_sms) if group else gather_splits(width, Hq, num_sms)


def _launch_gather(L, idx, z, counts, cap, n, m, V, q2k, nsplit, o_p, m_p, l_p):
    kname = "gather_value_sum_%s_%s" % (_KV_SUFFIX[str(V.dtype)], "i64" if idx.dtype == _torch().int64 else "i32")
    L.launch("gather.cu", kname, (nsplit, z.shape[0]), (_GATHER_THREADS,),
             (idx, _i64(idx.stride(0)), z, _i64(z.stride(0)), counts, _i32(cap), _i32(n), m, V, _i64(V.stride(0)),
              _i64(V.stride(1)), q2k, _i32(V.shape[2]), o_p, m_p, l_p))  # fmt: skip


def _launch_gather_grouped(L, idx, z, counts, cap, n, m, cut, z_range, n_bins, g, V, nsplit, o_p, m_p, l_p):
    size = "g3" if g == 3 else ("g4" if g == 4 else "g8")   # (register arrays of the group's size)
    L.launch("gather.cu", f"gather_value_sum_grouped_{_KV_SUFFIX[str(V.dtype)]}_{size}", (nsplit, V.shape[0]),
             (_GATHER_THREADS,),
             (idx, _i64(idx.stride(0)), z, _i64(z.stride(0)), counts, _i32(cap), _i32(n), m, cut, np.float32(z_range),
              _i32(n_bins), _i32(g), V, _i64(V.stride(0)), _i64(V.stride(1)), _i32(V.shape[2]), o_p, m_p, l_p))  # fmt: skip


def host_pool_readable(device) -> bool:
    """Whether kernels on `device` may read page-locked host memory at its host address (CUDA's
    cudaDevAttrCanUseHostPointerForRegisteredMem): gather_value_sum's precondition on a GPU."""
    be = _backend()
    if be.name != "cupy":
        return True   # the emulator: every tensor is host memory
    dev = device.index if device.index is not None else _torch().cuda.current_device()
    return bool(be.cp.cuda.runtime.deviceGetAttribute(91, dev))


# ---------------------------------------------------------------------------
# Checked wrappers (fresh outputs; the tests' entry points)
# ---------------------------------------------------------------------------


def decode_prep(q, k, v, scale, k_slot, v_slot, cs=None, zero=None):
    """q [Hq, d], k, v [Hkv, d] of one dtype (f32 / f16 / bf16; contiguous rows), k_slot, v_slot
    [Hkv, d] views of that dtype (written), cs optional f32 [d] = [cos | sin] of the far turn, zero
    optional f32 tensor (contiguous; zeroed) -> (qs [Hq, d] f32 = q * scale, qf [Hq, d] f32 = qs
    turned by cs, or None without cs); k_slot <- k, v_slot <- v."""
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
    with be.session(dev) as L:
        _launch_prep(L, q, k, v, scale, cs_t, cs is not None, qs, qf, k_slot, v_slot, zero, n_zero)
    return qs, (qf if cs is not None else None)


def pack_selection(idx, z, counts, w, cap=None):
    """idx int32 / int64 [Hq, >= w'] (rows contiguous), z f32 [Hq, n] (rows contiguous), counts int32
    [Hq], w >= 1, cap optional -> pack int32 [Hq (2 w + 1)] = [c | idx rows | z bits rows], c =
    min(counts, cap), the rows' first min(c, w) entries written (indices clamped to [0, n))."""
    torch = _torch()
    be = _backend()
    _check(be, idx, "idx", 2)
    _check(be, z, "z", 2, idx.device)
    _check(be, counts, "counts", 1, idx.device)
    Hq, n = z.shape
    if idx.dtype not in (torch.int32, torch.int64) or idx.shape[0] != Hq or idx.stride(-1) != 1:
        raise ValueError("idx must be int32 / int64 [Hq, ...] with contiguous rows")
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


def gather_value_sum(idx, z, counts, m, V, q_to_kv, n, cap=None, nsplit=None, group=None):
    """idx int32 / int64 [Hq, >= c] and z f32 [Hq, >= n] (rows contiguous), counts int32 [Hq], m f32
    [Hq] (>= every z[h, :n]), V [Hkv, tokens, d] f32 / f16 / bf16 with contiguous rows -- on a GPU
    page-locked host memory (the value pool), under the emulator a CPU tensor --, q_to_kv [Hq]
    -> (os [nsplit, Hq, d], ms, ls [nsplit, Hq]) f32: gather_value_sum_ref's partials (c =
    min(counts, cap)); nsplit defaults to gather_splits of the widest list. group = (cut int32 [Hq],
    z_range, n_bins) of the threshold selection that made idx: the grouped kernel (each row read
    once per kv group; q_to_kv must be h // (Hq / Hkv), then unread), the same merged sums."""
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
    if idx.dtype not in (torch.int32, torch.int64) or idx.shape[0] != Hq or idx.stride(-1) != 1:
        raise ValueError("idx must be int32 / int64 [Hq, ...] with contiguous rows")
    if z.dtype != torch.float32 or z.stride(-1) != 1 or z.shape[1] < n or n < 1:
        raise ValueError("z must be float32 [Hq, >= n] with contiguous rows, n >= 1")
    if counts.dtype != torch.int32 or tuple(counts.shape) != (Hq,) or m.dtype != torch.float32 or m.shape[0] != Hq:
        raise ValueError("counts must be int32 [Hq], m float32 [Hq]")
    if (V.dim() != 3 or str(V.dtype) not in _KV_SUFFIX or V.stride(-1) != 1 or V.shape[2] % 2
            or not 2 <= V.shape[2] <= _GATHER_THREADS or V.stride(0) % 2 or V.stride(1) % 2
            or V.data_ptr() % (2 * V.element_size())):   # (the kernel loads two elements at a time)
        raise ValueError(f"V must be [Hkv, tokens, d] f32 / f16 / bf16, d even and <= {_GATHER_THREADS}, with "
                         "contiguous rows aligned to two elements")
    cap = 2**31 - 1 if cap is None else int(cap)
    Hkv = V.shape[0]
    g = 0
    if group is not None:
        cut, z_range, n_bins = group
        g = group_size(Hq, Hkv)
        if idx.dtype != torch.int32 or not g:
            raise ValueError(f"the grouped gather needs int32 idx and Hq = g Hkv, g <= {_GATHER_MAX_GROUP}")
        _check(be, cut, "cut", 1, dev)
        if not grouped_layout(q_to_kv.cpu() if isinstance(q_to_kv, torch.Tensor) else q_to_kv, Hq, Hkv):
            raise ValueError("the grouped gather reads kv head h // g for query head h: q_to_kv must be that")
    if nsplit is None:
        nsplit = _gather_nsplit(min(idx.shape[1], cap), Hq, g, be.device_info(dev)[0])
    os = be.empty((nsplit, Hq, V.shape[2]), torch.float32, dev)
    ms = be.empty((nsplit, Hq), torch.float32, dev)
    ls = be.empty((nsplit, Hq), torch.float32, dev)
    with be.session(dev) as L:
        if group is None:
            q2k = _q2k(be, q_to_kv, Hq, Hkv, dev)
            _launch_gather(L, idx, z, counts.contiguous(), cap, n, m.contiguous(), V, q2k, nsplit, os, ms, ls)
        else:   # (q_to_kv is h // g by the grid: not read)
            _launch_gather_grouped(L, idx, z, counts.contiguous(), cap, n, m.contiguous(), cut.contiguous(), z_range,
                                   n_bins, g, V, nsplit, os, ms, ls)
    return os, ms, ls


# ---------------------------------------------------------------------------
# The decode step's launches on persistent buffers
# ---------------------------------------------------------------------------


class DecodeStep:
    """Buffers and launches for the decode steps of one HCA cache (one query per step).

    Hq, Hkv, d: heads and head dim; capacity: store tokens; exact_rows: the most rows one
    attend launch reads (sinks + ring + the spare row); out_dtype: the model's dtype (float32 /
    bfloat16 merged in the kernel, others cast). Every method launches on the session's launcher L (`with be.session(device) as
    L`), in stream order, and returns views of the buffers (overwritten by the next step).
    """

    def __init__(self, device, Hq, Hkv, d, capacity, exact_rows, out_dtype, n_bins=N_BINS, z_range=Z_RANGE):
        torch = _torch()
        be = _backend()
        self.device, self.Hq, self.Hkv, self.d = device, Hq, Hkv, d
        self.n_bins, self.z_range = n_bins, z_range
        self.num_sms, self.optin = be.device_info(device)
        if 2 * n_bins * 4 > self.optin - _SMEM_MARGIN:
            raise ValueError(f"n_bins={n_bins} does not fit in shared memory")
        if not 2 <= d <= _ATT_THREADS or d % 2 or Hq > 65535:   # (attend_partial: a thread per element)
            raise ValueError(f"head dim {d} (even, <= {_ATT_THREADS}) or Hq={Hq} (<= 65535) out of range")
        f32 = torch.float32

        def new(*shape, dtype=f32):
            return torch.zeros(shape, dtype=dtype, device=device)
        nblk = max(_score_blocks(max(capacity, 1), Hq, self.num_sms)[1], _cdiv(4 * self.num_sms, max(1, Hq))) + 1
        self.qs, self.qf, self.cs = new(Hq, d), new(Hq, d), new(d)
        self.T = new(1)   # the LUT [Hq, g, c]: sized by the first codebooks scored
        self.part_m, self.part_l = new(Hq * nblk), new(Hq * nblk)
        self.m, self.l, self.l_sel = new(Hq), new(Hq), new(Hq)
        self.hists = new(2, Hq, n_bins)           # mass | token counts (int32 bits): prep zeroes both
        self.hist, self.hcount = self.hists[0], self.hists[1].view(torch.int32)
        self.cut, self.counts = new(Hq, dtype=torch.int32), new(Hq, dtype=torch.int32)
        # partials: the exact tier's attend launches (two with far positions), then the gather's
        self.group = group_size(Hq, Hkv)          # (0: no grouped gather)
        gmax = max(_gather_nsplit(capacity, Hq, g, self.num_sms) for g in (0, self.group))
        p_max = 2 * _cdiv(max(exact_rows, 1), _ATT_TILE) + 2 + gmax
        self.os, self.ms, self.ls = new(p_max, Hq, d), new(p_max, Hq), new(p_max, Hq)
        self.no_stage = new(Hq, d + 2)            # an empty host part (l = 0) for merge after a gather
        self.out_dtype = out_dtype if str(out_dtype) in _OUT_SUFFIX else f32
        self.o = new(Hq, d, dtype=self.out_dtype)
        self.pack = new(Hq * 3, dtype=torch.int32)

    def session(self):
        return _backend().session(self.device)

    def prep(self, L, q, k, v, scale, k_slot, v_slot, far: bool, zero_hist: bool):
        """q [Hq, d], k, v [Hkv, d] (model dtype, contiguous rows) -> (qs, qf or qs); the new token
        into k_slot / v_slot [Hkv, d]; the histogram zeroed when the selection will use it. With
        far, self.cs must hold this position's [cos | sin] (the caller copies it in)."""
        _launch_prep(L, q, k, v, scale, self.cs, far, self.qs, self.qf, k_slot, v_slot, self.hists,
                     self.hists.numel() if zero_hist else 0)
        return self.qs, (self.qf if far else self.qs)

    def scores(self, L, q, q2k, codebooks, P, n, z, n_live=None):
        """q [Hq, d] f32, codebooks [Hkv, g, c, ds] f32, P [Hkv, cap, g] codes (contiguous), z f32
        [Hq, >= n] (rows contiguous) <- approximate scores of the first n tokens; m, l <- their stats.
        n_live: int32 [1] on the device: only its first n_live[0] (<= n) tokens (a captured step)."""
        _, g, c, _ = codebooks.shape
        self.reserve_lut(g, c)
        launch_build_lut(L, q, codebooks, q2k, self.T)
        launch_approx_scores(L, self.T, P, q2k, z, n, self.part_m, self.part_l, self.m, self.l, self.num_sms,
                             self.optin, n_live)

    def reserve_lut(self, g, c):
        """The LUT T [Hq, g, c] for codebooks of g groups of c centroids (made again on a change)."""
        if tuple(self.T.shape) != (self.Hq, g, c):
            self.T = _torch().empty((self.Hq, g, c), dtype=_torch().float32, device=self.device)
        return self.T

    def stats(self, L, z, n):
        """m, l <- the stats of z's first n columns (when some were scored outside `scores`)."""
        launch_zstats(L, z, n, self.part_m, self.part_l, self.m, self.l, self.num_sms)

    def select(self, L, z, n, tau, idx, cap=0, n_live=None):
        """threshold_select of z's first n columns on the stats in m, l (ops.threshold_select's
        semantics, cap included: 0 = none; the histograms zeroed by prep when select_mode(tau, cap, n)
        is 0) -> counts [Hq]; idx
        int32 [Hq, >= n] rows <- the selected indices (first counts[h], unordered). n_live: as scores."""
        nb = self.n_bins
        tpb, _ = _score_blocks(n, self.Hq, self.num_sms)
        mode = select_mode(tau, cap, n)
        if mode == 0:
            launch_zhist(L, z, n, tpb, self.m, self.z_range, nb, self.hist, self.hcount, cap > 0, n_live)
        launch_zcut(L, self.hist, self.hcount, nb, zcut_tau(tau), mode, self.m, self.l, self.cut, self.l_sel,
                    self.counts, cap if mode == 0 else 0)
        launch_zcompact(L, z, n, tpb, self.m, self.z_range, nb, self.cut, idx, self.counts, n_live)
        return self.counts

    def pack_selection(self, L, idx, z, n, w, cap):
        """-> the pack [Hq (2 w + 1)] int32 of pack_selection (a view of a persistent buffer)."""
        size = self.Hq * (2 * w + 1)
        if self.pack.numel() < size:
            self.pack = _torch().empty(size, dtype=_torch().int32, device=self.device)
        pack = self.pack[:size]
        _launch_pack(L, idx, z, self.counts, cap, n, w, pack)
        return pack

    def attend(self, L, q, K, V, q2k, n, valid, part0):
        """attend_partial over K, V [Hkv, >= n, d] (rows contiguous) -> its nsplit partials into
        os / ms / ls [part0:]; returns part0 + nsplit. valid: uint8 [>= n] or None."""
        tps, nsplit = _attend_split(n, self.Hq, self.num_sms)
        mask, has_mask = (valid, 1) if valid is not None else (q2k.view(_torch().uint8)[:1], 0)  # (unread then)
        launch_attend_partial(L, q, K, V, q2k, mask, has_mask, n, tps, nsplit, self.os[part0:], self.ms[part0:],
                              self.ls[part0:])
        return part0 + nsplit

    def gather(self, L, idx, z, n, cap, V, q2k, part0, grouped=False):
        """The selection's value sum read from the host pool V [Hkv, >= n, d] (pinned, mapped) into
        os / ms / ls [part0:], on the stats in m and the counts `select` left; returns the next free
        part. idx: select's int32 rows; cap: 0 = none. grouped: the selection was select's
        histogram cut (select_mode 0) and q2k is h // group: each row is read once per kv group
        (gather_value_sum_grouped)."""
        cap = cap or 2**31 - 1
        g = self.group if grouped and idx.dtype == _torch().int32 else 0
        nsplit = _gather_nsplit(min(n, idx.shape[1], cap), self.Hq, g, self.num_sms)
        if part0 + nsplit > self.os.shape[0]:   # (sized in __init__ for the capacity: cannot happen)
            raise RuntimeError(f"gather: {part0} + {nsplit} partials > {self.os.shape[0]} allocated")
        if g:
            _launch_gather_grouped(L, idx, z, self.counts, cap, n, self.m, self.cut, self.z_range, self.n_bins,
                                   g, V, nsplit, self.os[part0:], self.ms[part0:], self.ls[part0:])
        else:
            _launch_gather(L, idx, z, self.counts, cap, n, self.m, V, q2k, nsplit, self.os[part0:], self.ms[part0:],
                           self.ls[part0:])
        return part0 + nsplit

    def store_rows(self, L, src, dst, row):
        """src [R, d] (rows contiguous) -> dst [R, cap, d] at row row[0] (int32 [1] on the device)."""
        _launch_store_rows(L, src, dst, row)

    def merge(self, L, P, stage):
        """The P device partials and stage [Hq, d + 2] f32 (the host's o | m | l) -> o [Hq, d]."""
        _launch_merge(L, self.os, self.ms, self.ls, P, stage, self.o)
        return self.o
