"""4-bit codes scored with in-register table lookups ("fast scan", as FAISS's PQ4 fast scan): the
CPU's scoring path for codebooks of 16 centroids.

With c = 16, two groups' codes share a byte: PT [Hkv, P, n] uint8 (P = g / 2 "pair groups",
group-major like every index store), byte = code[2p] | code[2p + 1] << 4. That is the index of the
pair's product codebook (256 centroids over 2 sub-vectors, minirun.kv.codebooks.Codebooks.paired),
so every generic path (the packed tables / the GPU kernels) reads these codes unchanged;
here the product is used: a query head's table for one group is 16 bytes, which one AVX2 `pshufb`
looks up for 32 tokens at once (x86's byte shuffle, reached through llvm.x86.avx2.pshuf.b).

Tables (`_k_fs_lut`): T[h, i, c] = q_h[group i] . F[kv, i, c], quantized per head as in
kernels_cpu.packed with qmax = 127 (two entries, one per nibble, add in a byte without carry):
  lo[h, i] = min_c T[h, i, c];  s[h] = max_i (max_c T[h, i, c] - lo[h, i]) / 127
  Q[h, i, c] = floor((T[h, i, c] - lo[h, i]) / s[h] + 1/2) in [0, 127]
  level L[h, j] = sum_i Q[h, i, code_i(j)] (exact, in uint16);  z = s[h] * L + sum_i lo[h, i]
|z - z_float| <= g * s[h] / 2: coarser steps than the 16-bit tables (127 levels per group against
65535 / g), far below the codebooks' own error. The levels feed kernels_cpu.level_select's bucket
counts and cut and kernels_cpu.level_sum's value sum unchanged (PackedLUT's scale / offset / top /
shift semantics).

Block of 32 tokens, per pair group: one 32-byte load of codes, the two nibbles split by a shift and
a mask, per query head two pshufb and a byte add, then a 16-bit accumulate of the even and odd
bytes (FAISS's trick: a = sum of the bytes read as uint16 words, b = sum of the words >> 8; the odd
bytes' sums are b, the even ones' a - (b << 8)). Needs AVX2 (`available()`); elsewhere the cache
takes the generic path over the product codebook. Reference (tests/support/references/cpu.py): fs_lut_ref,
fs_levels_ref, hca_decode_attend_fs_ref.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._common import _as_pool, _prefetch
from .hca_step import _encode_args, _exact_args, _host_keys, _step_args, _step_partials, _step_scratch, _sum_and_merge
from .level_select import _count_levels, head_caps
from .level_sum import _k_level_cuts
from .packed import _head_step, _quantize
from .pq import _nearest

QMAX = 127          # largest table entry: two add in a byte
BLOCK = 32          # tokens per pshufb block (one AVX2 register of codes)
_CHUNK = 1024       # tokens per task (levels and bucket counts of a chunk stay in L1)
_MAX_NH = 4         # query heads per block call (more are done in calls of up to 4)
_AHEAD = 64         # tokens ahead that the levels' pass prefetches the codes of (P rows stream at once)


def available() -> bool:
    """Whether the code Numba makes here runs the pshufb kernels: AVX2 among its target's features
    (the host's, or NUMBA_CPU_NAME / NUMBA_CPU_FEATURES when set, e.g. for a portable cache)."""
    from numba.core import codegen, config
    features = config.CPU_FEATURES if config.CPU_NAME else codegen.get_host_cpu_features()
    return "+avx2" in (features or "").split(",")


def _make_block(nh):
    """The block kernel for nh query heads of one kv-head: levels of 32 tokens over P pair groups.

    Call: (PT flat uint8, c_off, stride, P, tabs flat uint8, t_off, lev flat uint16, l_off, l_stride):
    codes of pair p at PT[c_off + p * stride : + 32]; head e's table of group i at
    tabs[t_off + (e * 2P + i) * 16 : + 16]; head e's 32 levels to lev[l_off + e * l_stride : + 32]."""
    @intrinsic
    def block(typingctx, PT, c_off, stride, P, tabs, t_off, lev, l_off, l_stride):
        sig = types.void(PT, c_off, stride, P, tabs, t_off, lev, l_off, l_stride)

        def codegen(context, builder, signature, args):
            ir = cgutils.ir
            i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
            intp = context.get_value_type(types.intp)
            v32i8, v16i8, v16i16 = ir.VectorType(i8, 32), ir.VectorType(i8, 16), ir.VectorType(i16, 16)

            def ptr(k):
                return context.make_array(signature.args[k])(context, builder, args[k]).data

            def idx(k):
                return context.cast(builder, args[k], signature.args[k], types.intp)

            pt, tb, lv = ptr(0), ptr(4), ptr(6)
            c_off, stride, npair, t_off, l_off, l_stride = (idx(k) for k in (1, 2, 3, 5, 7, 8))
            pshufb = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32i8, [v32i8, v32i8]),
                                                    "llvm.x86.avx2.pshuf.b")
            zero = ir.Constant(v16i16, None)
            acc_a = [cgutils.alloca_once_value(builder, zero) for _ in range(nh)]
            acc_b = [cgutils.alloca_once_value(builder, zero) for _ in range(nh)]
            nib, four, eight = ir.Constant(v32i8, [0x0F] * 32), ir.Constant(v32i8, [4] * 32), ir.Constant(v16i16, [8] * 16)
            both_lanes = ir.Constant(ir.VectorType(i32, 32), list(range(16)) * 2)
            head_stride = builder.mul(npair, intp(32))             # 2P tables of 16 bytes
            with cgutils.for_range(builder, npair) as loop:
                p = loop.index
                src = builder.gep(pt, [builder.add(c_off, builder.mul(p, stride))])
                codes = builder.load(builder.bitcast(src, v32i8.as_pointer()), align=1)
                lo = builder.and_(codes, nib)
                hi = builder.and_(builder.lshr(codes, four), nib)
                for e in range(nh):
                    t0 = builder.add(builder.add(t_off, builder.mul(intp(e), head_stride)), builder.mul(p, intp(32)))
                    tl = builder.load(builder.bitcast(builder.gep(tb, [t0]), v16i8.as_pointer()), align=1)
                    th = builder.load(builder.bitcast(builder.gep(tb, [builder.add(t0, intp(16))]),
                                                      v16i8.as_pointer()), align=1)
                    # pshufb looks up within each 16-byte lane: the table in both lanes
                    tl, th = builder.shuffle_vector(tl, tl, both_lanes), builder.shuffle_vector(th, th, both_lanes)
                    r = builder.bitcast(builder.add(builder.call(pshufb, [tl, lo]), builder.call(pshufb, [th, hi])),
                                        v16i16)
                    builder.store(builder.add(builder.load(acc_a[e]), r), acc_a[e])
                    builder.store(builder.add(builder.load(acc_b[e]), builder.lshr(r, eight)), acc_b[e])
            # word k of the sums covers tokens 2k (even byte) and 2k + 1 (odd byte)
            interleave = ir.Constant(ir.VectorType(i32, 32), [x for k in range(16) for x in (k, k + 16)])
            for e in range(nh):
                a, b = builder.load(acc_a[e]), builder.load(acc_b[e])
                out = builder.shuffle_vector(builder.sub(a, builder.shl(b, eight)), b, interleave)
                dst = builder.gep(lv, [builder.add(l_off, builder.mul(intp(e), l_stride))])
                builder.store(out, builder.bitcast(dst, ir.VectorType(i16, 32).as_pointer()), align=2)
            return context.get_dummy_value()

        return sig, codegen

    return block


_block1, _block2, _block3, _block4 = (_make_block(nh) for nh in range(1, 5))


@njit(inline="always")
def _score_block(nh, ptf, c_off, cap, P, tbf, t_off, lvf, l_off, l_cap):
    """Levels of 32 tokens for nh heads, in calls of up to 4 heads."""
    e = 0
    while e < nh:
        k = min(nh - e, _MAX_NH)
        to, lo = t_off + e * 2 * P * 16, l_off + e * l_cap
        if k == 4:
            _block4(ptf, c_off, cap, P, tbf, to, lvf, lo, l_cap)
        elif k == 3:
            _block3(ptf, c_off, cap, P, tbf, to, lvf, lo, l_cap)
        elif k == 2:
            _block2(ptf, c_off, cap, P, tbf, to, lvf, lo, l_cap)
        else:
            _block1(ptf, c_off, cap, P, tbf, to, lvf, lo, l_cap)
        e += k


@njit(inline="always")
def _tail_levels(PT, kv, j0, j1, tabs, h0, nh, lev):
    """Levels of tokens j0 .. j1 (fewer than a block) one at a time."""
    P = PT.shape[1]
    for e in range(nh):
        Th, lh = tabs[h0 + e], lev[h0 + e]
        for j in range(j0, j1):
            s = 0
            for p in range(P):
                c = np.int64(PT[kv, p, j])
                s += np.int64(Th[2 * p, c & 15]) + np.int64(Th[2 * p + 1, c >> 4])
            lh[j] = np.uint16(s)


@njit(cache=True, parallel=True)
def _k_fs_levels(PT, n, tabs, nh, top, shift, lev, hist, nt):
    # PT [Hkv, P, cap] uint8, tabs [Hq, 2P, 16] uint8 (heads of kv-head kv: kv * nh .. + nh - 1),
    # lev [Hq, >=n] uint16, hist [threads, Hq, NB] int32: slot sl of nt does tasks sl, sl + nt, ...
    # (a task: one kv-head over a chunk of tokens) into its own counts.
    Hkv, P, cap = PT.shape
    lcap = lev.shape[1]
    ptf, tbf, lvf = PT.ravel(), tabs.ravel(), lev.ravel()
    nc = (n + _CHUNK - 1) // _CHUNK
    for sl in prange(nt):
        hist[sl] = 0
        bk = np.empty(_CHUNK, np.int32)
        for t in range(sl, nc * Hkv, nt):
            kv, ci = t % Hkv, t // Hkv
            j0 = ci * _CHUNK
            j1 = min(n, j0 + _CHUNK)
            h0 = kv * nh
            j = j0
            while j + BLOCK <= j1:
                if j + _AHEAD < j1:   # each pair row's bytes _AHEAD tokens on, every block: a row starts
                    for p in range(P):    # anywhere in a line, so a block's 32 bytes may span two
                        _prefetch(PT, (kv * P + p) * cap + j + _AHEAD)
                _score_block(nh, ptf, (kv * P) * cap + j, cap, P, tbf, h0 * 2 * P * 16, lvf, h0 * lcap + j, lcap)
                j += BLOCK
            _tail_levels(PT, kv, j, j1, tabs, h0, nh, lev)
            for h in range(h0, h0 + nh):
                _count_levels(lev[h, j0:j1], j1 - j0, top[h], shift[h], hist[sl, h], bk)


@njit(cache=True)
def _k_fs_lut(q, F, nh, T, tabs, scale, offset, top, shift):
    # q [Hq, d] f32, F [Hkv, G, ds, 16] f32 (factor codebooks, transposed) -> T [Hq, G, 16] f32,
    # tabs [Hq, G, 16] uint8, scale / offset f32 [Hq], top / shift int64 [Hq] (module docstring).
    Hq = q.shape[0]
    G, ds = F.shape[1], F.shape[2]
    lo = np.empty(G, np.float32)
    width = np.empty(G, np.float32)
    for h in range(Hq):
        kv = h // nh
        for i in range(G):
            Ti = T[h, i]
            Ti[:] = 0.0
            for k in range(ds):
                qk = q[h, i * ds + k]
                row = F[kv, i, k]
                for c in range(16):
                    Ti[c] += qk * row[c]
            a, b = Ti[0], Ti[0]
            for c in range(1, 16):
                a, b = min(a, Ti[c]), max(b, Ti[c])
            lo[i], width[i] = a, b - a
        scale[h], offset[h], top[h], shift[h], inv = _head_step(lo, width, QMAX)
        for i in range(G):
            for c in range(16):
                tabs[h, i, c] = np.uint8(_quantize(T[h, i, c], lo[i], inv, QMAX))


@njit(inline="always")
def _encode_pair_key(key, F, fnorm, kv, out, dist):
    """out[p] = the nibble pair of key [d] (f32 or half bits) over kv-head kv's factor codebooks."""
    P = F.shape[1] // 2
    for p in range(P):
        a = _nearest(key, 2 * p, F[kv, 2 * p], fnorm[kv, 2 * p], dist)
        b = _nearest(key, 2 * p + 1, F[kv, 2 * p + 1], fnorm[kv, 2 * p + 1], dist)
        out[p] = np.uint8(a | (b << 4))


@njit(cache=True, parallel=True)
def _k_encode_pairs(K, F, fnorm, out):
    # K [B, m, d] (f32 or half bits), F [B, G, ds, 16], fnorm [B, G, 16] -> out [B, m, G / 2] uint8
    B, m = K.shape[0], K.shape[1]
    for t in prange(B * m):
        b, j = t // m, t % m
        _encode_pair_key(K[b, j], F, fnorm, b, out[b, j], np.empty(16, np.float32))


@njit(cache=True)
def _k_hca_decode_fs(step, exact, store, F, heads, lut, scratch, enc, host, tau, cap, out):
    # kernels_cpu.hca_step._k_hca_decode with the fast-scan LUT and levels (and the ring key's
    # encode into nibble pairs) in place of the packed uint64 tables: F the transposed factor
    # codebooks, heads (nh, lanes), lut FastScanLUT.arrays, enc (slot, fnorm, codes).
    q, k, v = step
    PT, n_store, V = store
    nh, lanes = heads
    T, tabs, scale, offset, top, shift = lut
    lev, hist, nt, z, idx, counts = scratch
    enc_slot, fnorm, codes = enc
    EK = exact[0]
    Hq = q.shape[0]
    parts = _step_partials(q, k, v, np.arange(Hq).astype(np.int32) // nh)
    lcut = np.empty(Hq, np.int64)
    mref = np.empty(Hq, np.float32)
    if n_store > 0:
        _k_fs_lut(q, F, nh, T, tabs, scale, offset, top, shift)
        if enc_slot >= 0:
            dist = np.empty(16, np.float32)
            for kv in range(EK.shape[0]):
                _encode_pair_key(EK[kv, enc_slot], F, fnorm, kv, codes[kv, 0], dist)
        _k_fs_levels(PT, n_store, tabs, nh, top, shift, lev, hist, nt)
        _k_level_cuts(lev, n_store, tau, scale, offset, top, shift, hist, nt, idx, z, lcut, mref, cap)
    _sum_and_merge((lev, lcut, scale, offset, mref), n_store, V, lanes, nt, counts, q, exact, host, parts, out)


class FastScanLUT:
    """Scratch of one decode step: T f32 / tabs uint8 [Hq, G, 16], scale / offset f32 [Hq], top / shift
    int64 [Hq] (as PackedLUT's: z = scale * level + offset), lanes the lane_map of the value sum."""
    __slots__ = ("T", "tabs", "scale", "offset", "top", "shift", "lanes")

    def __init__(self, Hq: int, groups: int, lanes: np.ndarray):
        self.T = np.empty((Hq, groups, 16), np.float32)
        self.tabs = np.empty((Hq, groups, 16), np.uint8)
        self.scale, self.offset = np.empty(Hq, np.float32), np.empty(Hq, np.float32)
        self.top, self.shift = np.zeros(Hq, np.int64), np.zeros(Hq, np.int64)
        self.lanes = lanes

    @property
    def arrays(self) -> list:
        return [self.T, self.tabs, self.scale, self.offset, self.top, self.shift]


def heads_per_kv(q_to_kv) -> int:
    """nh for the kernels here, which take kv-head kv's query heads as kv * nh .. kv * nh + nh - 1."""
    q_to_kv = np.asarray(q_to_kv)
    Hkv = int(q_to_kv.max()) + 1
    nh = q_to_kv.shape[0] // Hkv
    if nh * Hkv != q_to_kv.shape[0] or not np.array_equal(q_to_kv, np.arange(q_to_kv.shape[0]) // nh):
        raise ValueError("fast scan needs the query heads of each kv-head to be consecutive")
    return nh


def factor_norms(F) -> np.ndarray:
    """F [..., G, ds, 16] transposed factor codebooks -> ||c||^2 [..., G, 16] f32 (encoder scratch)."""
    return np.ascontiguousarray((np.asarray(F, np.float32) ** 2).sum(-2), np.float32)


def encode_pairs(K, F, fnorm=None) -> np.ndarray:
    """K [B, m, d] f32 (or half bits), F [B, G, ds, 16] transposed factor codebooks -> nibble pairs
    [B, m, G / 2] uint8: byte p = nearest(group 2p) | nearest(group 2p + 1) << 4 (encode_keys' nearest)."""
    K, F = _as_pool(np.ascontiguousarray(K)), np.ascontiguousarray(F, np.float32)
    fnorm = factor_norms(F) if fnorm is None else fnorm
    out = np.empty((K.shape[0], K.shape[1], F.shape[1] // 2), np.uint8)
    if out.size:
        _k_encode_pairs(K, F, fnorm, out)
    return out


def hca_decode_attend_fs(q, k, v, EK, EV, n_exact, F, PT, n_store, V, tau, q_to_kv, lut: FastScanLUT, z, idx,
                         counts=None, fnorm=None, encode=None, levels=None, exact_valid=None, host_keys=None,
                         cap=0):
    """kernels_cpu.hca_step.hca_decode_attend for nibble-pair codes: F [Hkv, G, ds, 16] transposed
    factor codebooks (fnorm: factor_norms(F)), PT [Hkv, G/2, >=n_store] uint8, lut the FastScanLUT
    scratch; encode (slot, codes uint8 [Hkv, 1, G/2]) writes the nibble pairs of EK[:, slot].
    The rest (host_keys: rescore; cap) as hca_decode_attend. -> o [Hq, d] f32. Needs available()."""
    host = _host_keys(host_keys, V, n_store, q.shape[1])
    nh = heads_per_kv(q_to_kv)
    counts, out, (lev, hist), nt = _step_scratch(q, n_store, counts, levels)
    fnorm = factor_norms(F) if fnorm is None else fnorm
    slot, codes = _encode_args(encode, (-1, _NO_CODES), n_exact, n_store)
    _k_hca_decode_fs(_step_args(q, k, v), _exact_args(EK, EV, n_exact, exact_valid), (PT, int(n_store), _as_pool(V)),
                     F, (nh, lut.lanes), tuple(lut.arrays), (lev, hist, nt, z, idx, counts), (int(slot), fnorm, codes),
                     host, float(tau), head_caps(cap, q.shape[0]), out)
    return out


_NO_CODES = np.zeros((1, 1, 1), np.uint8)
