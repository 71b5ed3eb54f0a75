"""One HCA decode step's launches with persistent buffers (minirun/kv/hca_cuda.py's hot path).

On an H100 a decode step of SmolLM2 was bound by the host: ~10 kernels_cuda wrappers (argument
checks, torch allocations, a stream session each) and ~20 torch ops per layer and token
(docs/PROFILE.md). `DecodeStep` allocates every output and temporary once,
launches the scoring and selection kernels through launch.py's helpers, and adds the
three kernels of decode.cu that replace torch glue: the step's query preparation (+ the new token
staged into the exact tier's spare row, + the histogram zeroed), the copy-back pack, and the merge
with the host's staged part written in the model's dtype.
"""

from __future__ import annotations

import numpy as np

from . import _sources
from .launch import (_ATT_THREADS, _KV_SUFFIX, N_BINS, Z_RANGE, _attend_split, _attend_split_max, _backend, _cdiv, _i32, _i64,
                     _SMEM_MARGIN, _score_blocks, _torch, launch_approx_scores, score_parts, select_mode, zcut_tau,
                     launch_attend_partial, launch_build_lut, launch_zcompact, launch_zcut, launch_zhist)

__all__ = ["DecodeStep", "gather_splits", "group_size", "host_pool_readable"]

_PREP_THREADS = _sources.constant("decode.cu", "MR_PREP_THREADS")
_PACK_THREADS = _sources.constant("decode.cu", "MR_PACK_THREADS")
_MERGE_THREADS = _sources.constant("decode.cu", "MR_MERGE_THREADS")
_GATHER_THREADS = _sources.constant("gather.cu", "MR_GATHER_THREADS")
_GATHER_MIN_SHARE = 64   # tokens a gather block takes at least (fewer: more blocks than work)
_GATHER_MAX_GROUP = _sources.constant("gather.cu", "MR_GATHER_MAX_GROUP")
_OUT_SUFFIX = {"torch.float32": "f32", "torch.bfloat16": "bf16"}


def _launch_prep(L, q, k, v, scale, cs, has_far, qs, qf, k_slot, v_slot, zero, n_zero, rope=None):
    """rope: q, k before RoPE, turned by this [cos | sin] (their dtype: float32 / bfloat16) first."""
    Hq, d = q.shape
    Hkv = k.shape[0]
    L.launch("decode.cu", "decode_prep_" + _KV_SUFFIX[str(q.dtype)], (Hq + 2 * Hkv,), (_PREP_THREADS,),
             (q, _i64(q.stride(0)), k, _i64(k.stride(0)), v, _i64(v.stride(0)), np.float32(scale), cs,
              _i32(has_far), q if rope is None else rope, _i32(rope is not None), _i32(Hq), _i32(Hkv), _i32(d), qs, qf,
              k_slot, _i64(k_slot.stride(0)), v_slot,
              _i64(v_slot.stride(0)), zero, _i64(n_zero)))  # fmt: skip


def _launch_pack(L, idx, z, counts, cap, n, w, pack):
    L.launch("decode.cu", "pack_selection_i32", (z.shape[0],), (_PACK_THREADS,),
             (idx, _i64(idx.stride(0)), z, _i64(z.stride(0)), counts, _i32(cap), _i32(n), _i32(w), pack))


def _launch_merge(L, os, ms, ls, P, stage, o):
    Hq, d = o.shape
    L.launch("decode.cu", "lse_merge_staged_" + _OUT_SUFFIX[str(o.dtype)], (Hq,), (_MERGE_THREADS,),
             (os, ms, ls, _i32(P), stage, _i32(Hq), _i32(d), o))


def _launch_store_rows(L, src, dst, row):
    kname = "store_rows_b32" if src.element_size() == 4 else "store_rows_b16"
    L.launch("decode.cu", kname, (src.shape[0],), (_PREP_THREADS,),
             (src, _i64(src.stride(0)), row, dst, _i64(dst.stride(0)), _i64(dst.stride(1)), _i32(src.shape[1])))


def group_size(Hq: int, Hkv: int) -> int:
    """Query heads per kv head the GPU's gather takes (0: it cannot: the value sum is the host's)."""
    g = Hq // Hkv if Hkv and Hq % Hkv == 0 else 0
    return g if g <= _GATHER_MAX_GROUP else 0


def gather_splits(width: int, Hq: int, group: int, num_sms: int) -> int:
    """nsplit of gather_value_sum_grouped over lists of at most `width` tokens (each kv group's
    group * width entries): about 4 blocks per SM (every row read crosses the host bus, so many
    reads in flight), each block >= 64 entries of full lists."""
    return max(1, min(_cdiv(4 * num_sms, max(1, Hq // group)), _cdiv(max(width * group, 1), _GATHER_MIN_SHARE)))


def _launch_gather_grouped(L, idx, z, counts, cap, n, m, cut, z_range, n_bins, g, V, nsplit, o_p, m_p, l_p, d=None):
    """d: the head dim (V's row width for float rows; uint8 V: quantized rows, q8 when wider than d)."""
    size = "g3" if g == 3 else ("g4" if g == 4 else "g8")   # (register arrays of the group's size)
    d = V.shape[2] if d is None else d
    kind = ("q8" if V.shape[2] >= d else "q4") if V.element_size() == 1 else _KV_SUFFIX[str(V.dtype)]
    L.launch("gather.cu", f"gather_value_sum_grouped_{kind}_{size}", (nsplit, V.shape[0]),
             (_GATHER_THREADS,),
             (idx, _i64(idx.stride(0)), z, _i64(z.stride(0)), counts, _i32(cap), _i32(n), m, cut, np.float32(z_range),
              _i32(n_bins), _i32(g), V, _i64(V.stride(0)), _i64(V.stride(1)), _i32(d), o_p, m_p, l_p))  # fmt: skip


def host_pool_readable(device) -> bool:
    """Whether kernels on `device` may read page-locked host memory at its host address (CUDA's
    cudaDevAttrCanUseHostPointerForRegisteredMem): gather_value_sum's precondition on a GPU."""
    be = _backend()
    if be.name != "cupy":
        return True   # the emulator: every tensor is host memory
    dev = device.index if device.index is not None else _torch().cuda.current_device()
    return bool(be.cp.cuda.runtime.deviceGetAttribute(91, dev))


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
        nblk = max(score_parts(max(capacity, 1), Hq, self.num_sms), _cdiv(4 * self.num_sms, max(1, Hq))) + 1
        self.qs, self.qf, self.cs = new(Hq, d), new(Hq, d), new(d)
        self.T = new(1)   # the LUT [Hq, g, c]: sized by the first codebooks scored
        self.part_m, self.part_l = new(Hq * nblk), new(Hq * nblk)
        self.m, self.l, self.l_sel = new(Hq), new(Hq), new(Hq)
        self.hists = new(2, Hq, n_bins)           # mass | token counts (int32 bits): prep zeroes both
        self.hist, self.hcount = self.hists[0], self.hists[1].view(torch.int32)
        self.cut, self.counts = new(Hq, dtype=torch.int32), new(Hq, dtype=torch.int32)
        # partials: the exact tier's attend launches (two with far positions), then the gather's
        self.group = group_size(Hq, Hkv)          # (0: no GPU gather: the value sum is the host's)
        gmax = gather_splits(capacity, Hq, self.group, self.num_sms) if self.group else 0
        p_max = 2 * _attend_split_max(exact_rows, Hq, self.num_sms, Hkv, d) + 2 + gmax
        self.os, self.ms, self.ls = new(p_max, Hq, d), new(p_max, Hq), new(p_max, Hq)
        self.no_stage = new(Hq, d + 2)            # an empty host part (l = 0) for merge after a gather
        self.out_dtype = out_dtype if str(out_dtype) in _OUT_SUFFIX else f32
        self.o = new(Hq, d, dtype=self.out_dtype)
        self.pack = new(Hq * 3, dtype=torch.int32)

    def session(self):
        return _backend().session(self.device)

    def prep(self, L, q, k, v, scale, k_slot, v_slot, far: bool, zero_hist: bool, rope=None):
        """q [Hq, d], k, v [Hkv, d] (model dtype, contiguous rows) -> (qs, qf or qs); the new token
        into k_slot / v_slot [Hkv, d]; the histogram zeroed when the selection will use it. With
        far, self.cs must hold this position's [cos | sin] (the caller copies it in). rope: q, k
        are not turned yet, this [d] is their position's cos | sin (float32 / bfloat16)."""
        _launch_prep(L, q, k, v, scale, self.cs, far, self.qs, self.qf, k_slot, v_slot, self.hists,
                     self.hists.numel() if zero_hist else 0, rope)
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

    def select(self, L, z, n, tau, idx, cap=0, n_live=None, caps=None):
        """threshold_select of z's first n columns on the stats in m, l (ops.threshold_select's
        semantics, cap included: 0 = none; the histograms zeroed by prep when select_mode(tau, cap, n)
        is 0) -> counts [Hq]; idx
        int32 [Hq, >= n] rows <- the selected indices (first counts[h], unordered). n_live: as scores.
        caps: int32 [Hq] on the device, per-head caps in place of cap (< 0: the head selects none)."""
        nb = self.n_bins
        tpb, _ = _score_blocks(n, self.Hq, self.num_sms)
        mode = select_mode(tau, cap if caps is None else caps, n)
        if mode == 0:
            launch_zhist(L, z, n, tpb, self.m, self.z_range, nb, self.hist, self.hcount, cap > 0 or caps is not None,
                         n_live)
        launch_zcut(L, self.hist, self.hcount, nb, zcut_tau(tau), mode, self.m, self.l, self.cut, self.l_sel,
                    self.counts, cap if mode == 0 else 0, caps)
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
        tps, nsplit = _attend_split(n, self.Hq, self.num_sms, self.Hkv, self.d)
        mask, has_mask = (valid, 1) if valid is not None else (q2k.view(_torch().uint8)[:1], 0)  # (unread then)
        launch_attend_partial(L, q, K, V, q2k, mask, has_mask, n, tps, nsplit, self.os[part0:], self.ms[part0:],
                              self.ls[part0:], grouped=True)
        return part0 + nsplit

    def gather(self, L, idx, z, n, cap, V, part0):
        """The selection's value sum read from the host pool V [Hkv, >= n, d] (pinned, mapped; or its
        quantized rows, uint8 [Hkv, >= n, width], dequantized on the device) into
        os / ms / ls [part0:], on the stats in m and the cut and counts `select` left (query head h
        on kv head h // group); returns the next free part. idx: select's int32 rows; cap: 0 = none."""
        cap = cap or 2**31 - 1
        nsplit = gather_splits(min(n, idx.shape[1], cap), self.Hq, self.group, self.num_sms)
        if part0 + nsplit > self.os.shape[0]:   # (sized in __init__ for the capacity: cannot happen)
            raise RuntimeError(f"gather: {part0} + {nsplit} partials > {self.os.shape[0]} allocated")
        _launch_gather_grouped(L, idx, z, self.counts, cap, n, self.m, self.cut, self.z_range, self.n_bins,
                               self.group, V, nsplit, self.os[part0:], self.ms[part0:], self.ls[part0:], self.d)
        return part0 + nsplit

    def store_rows(self, L, src, dst, row):
        """src [R, d] (rows contiguous) -> dst [R, cap, d] at row row[0] (int32 [1] on the device)."""
        _launch_store_rows(L, src, dst, row)

    def merge(self, L, P, stage):
        """The P device partials and stage [Hq, d + 2] f32 (the host's o | m | l) -> o [Hq, d]."""
        _launch_merge(L, self.os, self.ms, self.ls, P, stage, self.o)
        return self.o
