"""One HCA decode step of one layer's attention in a single call.

The step is eight kernels (exact attention over sinks + ring, the new token's own score, lookup
table, its integer packing (kernels_cpu.packed), the integer scores (kernels_cpu.level_select),
each head's level cut and the value sum over the selection read from the levels
(kernels_cpu.level_sum), log-sum-exp merge). Called one by one from Python, their wrappers, checks and
small NumPy glue cost ~1 ms per layer on a 2-core CPU, as much as the scoring itself; here they run
back to back inside one compiled function.
Reference: hca_decode_attend_ref in tests/support/references/cpu.py (the composition of the kernels' references).
"""

import numba
import numpy as np
from numba import njit

from ._common import _NEG_INF, _as_f32, _as_pool, _ld
from .attention import _ALL_VALID, _k_lse_merge
from .level_select import _k_packed_levels, head_caps, level_hist
from .level_sum import _k_level_cuts, _k_level_value_sum
from .packed import _k_lut_pack


@njit(cache=True)
def _step_partials(q, k, v, q_to_kv):
    """The (o, m, l) partials of a one-call decode step, [3, Hq, d] / [3, Hq] / [3, Hq]: part 0 the
    exact tier and part 2 the store (empty here: m = -inf, l = 0), part 1 the new token itself
    (its own key k and value v [Hkv, d]: m = q . k, l = 1, o = v)."""
    Hq, d = q.shape
    os = np.zeros((3, Hq, d), np.float32)
    ms = np.full((3, Hq), _NEG_INF, np.float32)
    ls = np.zeros((3, Hq), np.float32)
    for h in range(Hq):
        kv = q_to_kv[h]
        s = np.float32(0.0)
        for i in range(d):
            s += q[h, i] * _ld(k[kv, i])
            os[1, h, i] = _ld(v[kv, i])
        ms[1, h] = s
        ls[1, h] = 1.0
    return os, ms, ls


@njit(cache=True)
def _k_hca_decode(step, exact, store, cbt, heads, lut, scratch, enc, host, tau, cap, out):
    # The arguments of hca_decode_attend by part: step (q, k, v) the token; exact (EK, EV, n_exact,
    # valid) sinks + ring; store (PT, n_store, V); cbt the transposed codebooks; heads (q_to_kv,
    # lanes); lut (T, tables, scale, offset, top, shift) the float and packed tables; scratch (lev,
    # hist, nt, z, idx, counts); enc (slot, cnorm, codes) the ring key encoded ahead (slot < 0:
    # none; EK[:, 0] is then not read); host (K, rescore) -> out [Hq, d].
    q, k, v = step
    PT, n_store, V = store
    q_to_kv, lanes = heads
    T, tables, scale, offset, top, shift = lut
    lev, hist, nt, z, idx, counts = scratch
    enc_slot, cnorm, codes = enc
    EK = exact[0]
    Hq = q.shape[0]
    parts = _step_partials(q, k, v, q_to_kv)                          # 2. the new token itself
    lcut = np.empty(Hq, np.int64)                                     # (not read when n_store = 0)
    mref = np.empty(Hq, np.float32)
    if n_store > 0:                                                   # 3. the store, approximately
        # LUT and its packing; also encodes the ring key that leaves next while this layer's
        # codebooks are in cache
        _k_lut_pack(q, cbt, lanes, T, tables, scale, offset, top, shift, enc_slot >= 0, EK[:, max(enc_slot, 0)],
                    cnorm, codes)
        _k_packed_levels(tables, lanes, top, shift, PT, n_store, lev, hist, nt)
        _k_level_cuts(lev, n_store, tau, scale, offset, top, shift, hist, nt, idx, z, lcut, mref, cap)
    _sum_and_merge((lev, lcut, scale, offset, mref), n_store, V, lanes, nt, counts, q, exact, host, parts, out)


@njit(inline="always")
def _sum_and_merge(sel, n_store, V, lanes, nt, counts, q, exact, host, parts, out):
    """The step's tail after the cuts: the value sum over the selection sel (level_sum's; none when
    n_store = 0; host (K, rescore): weighted by exact scores over the host keys K) and the exact
    tier exact (EK, EV, n_exact, valid: sinks + ring) as tasks of one parallel region, into parts 2
    and 0 of parts (os [3, Hq, d], ms / ls [3, Hq]), then the log-sum-exp merge of the three parts
    into out [Hq, d]."""
    os, ms, ls = parts
    _k_level_value_sum(sel, n_store, V, lanes, nt, counts, q, exact, host, (os[2], ms[2], ls[2]),
                       (os[0], ms[0], ls[0]))
    Hq = q.shape[0]
    m = np.empty(Hq, np.float32)
    l = np.empty(Hq, np.float32)
    out[:] = 0.0
    _k_lse_merge(os, ms, ls, out, m, l)                               # 4. exact merge


def hca_decode_attend(q, k, v, EK, EV, n_exact, codebooks_t, PT, n_store, V, tau, q_to_kv, packed,
                      lut, z, idx, counts=None, encode=None, levels=None, exact_valid=None, host_keys=None, cap=0):
    """Attention of one decode token over sinks + ring (exact), itself, and the store (HCA).

    q [Hq, d] f32 (pre-scaled by 1/sqrt(d)); k, v [Hkv, d] (the token's own key and value);
    EK, EV [Hkv, >=n_exact, d] the exact tier; codebooks_t [Hkv, g, ds, c] f32 (the codebooks
    [Hkv, g, c, ds] transposed, contiguous); PT [Hkv, g, >=n_store] uint8/int16 indices,
    group-major, C-contiguous; V [Hkv, >=n_store, d] the value pool (or its quantized rows, uint8
    [Hkv, >=n_store, width]: minirun/kv/value_codes.py). K/V arrays f32 or f16. Scratch (C-contiguous rows):
    packed (a PackedLUT of preallocated arrays, its lanes from lane_map), lut f32 [Hq, g, c],
    z f32 [Hq, >=n_store], idx int32 [Hq, >=n_store] (scratch of the selection's exact fallback),
    counts int32 [Hq]; levels optional (lev uint16 [Hq, >=n_store], level_hist(Hq)).
    -> o [Hq, d] f32, the log-sum-exp merge of exact attention over EK, EV, the token itself, and
    weighted_value_sum over the level selection (kernels_cpu.level_select) on q's lookup table
    (lut) packed as integers (kernels_cpu.packed; reference: packed_select_ref); the value sum
    reads the selection from the levels (kernels_cpu.level_sum). Afterwards counts holds the selection size
    per head, packed and lut the step's tables, levels (when given) the store's levels and counts.
    encode: optional (slot, cnorm [Hkv, g, c] f32, codes [Hkv, 1, g] of the index dtype): also
    writes encode_keys(EK[:, slot:slot + 1]) into codes (the ring key that leaves next; the cache
    encodes it here because the codebooks were just read for the LUT). Needs n_store > 0.
    exact_valid: optional uint8 [>= n_exact], 0 where an exact-tier slot holds no token (a ring
    not yet refilled after a truncate): that slot is not attended.
    host_keys: optional [Hkv, >=n_store, d] of V's type (rescore): the selected store tokens are
    weighted by their exact scores over these keys instead of the codebook scores.
    cap: > 0, at most that many store tokens per head (whole level buckets from the top: the
    selection's cap, level_select._bucket_cut); or per query head [Hq] (level_select.head_caps:
    0 no cap, < 0 the head skips the store).
    """
    counts, out, (lev, hist), nt = _step_scratch(q, n_store, counts, levels)
    host = _host_keys(host_keys, V, n_store, q.shape[1])
    slot, cnorm, codes = _encode_args(encode, (-1, _NO_CNORM, _NO_CODES[PT.dtype.itemsize]), n_exact, n_store)
    _k_hca_decode(_step_args(q, k, v), _exact_args(EK, EV, n_exact, exact_valid), (PT, int(n_store), _as_pool(V)),
                  codebooks_t, (q_to_kv, packed.lanes),
                  (lut, packed.tables, packed.scale, packed.offset, packed.top, packed.shift),
                  (lev, hist, nt, z, idx, counts), (int(slot), cnorm, codes), host, float(tau),
                  head_caps(cap, q.shape[0]), out)
    return out


def _step_args(q, k, v):
    """The step tuple the kernels take: (q f32, k, v as pools)."""
    return _as_f32(q), _as_pool(k), _as_pool(v)


def _exact_args(EK, EV, n_exact, valid):
    """The exact tier as the kernels take it: (EK, EV as pools, n_exact, the valid mask)."""
    return _as_pool(EK), _as_pool(EV), int(n_exact), _valid_mask(valid, n_exact)


def _host_keys(host_keys, V, n_store, d=None):
    """(K, rescore) as the steps take them: the host key pool (f32 or f16), or without rescoring V
    itself (unread; a quantized pool: a float stand-in), so both cases share one compiled kernel
    where they can. d: the head dim (V's row width for float rows)."""
    V = _as_pool(V)
    if host_keys is None:
        return (_NO_KEYS if V.dtype == np.uint8 else V), False
    K = _as_pool(host_keys)
    d = V.shape[2] if d is None else d
    if K.dtype == np.uint8 or K.ndim != 3 or K.shape[0] != V.shape[0] or K.shape[2] != d \
            or K.shape[1] < n_store or not K.flags.c_contiguous:
        raise ValueError(f"host_keys must be C-contiguous float [Hkv, >={n_store}, {d}], got {K.dtype} {K.shape}")
    return K, True


def _step_scratch(q, n_store, counts=None, levels=None):
    """The defaults the steps take: (counts int32 [Hq], out f32 [Hq, d], (lev, hist), threads),
    counts and levels made when not given (exact_step's levels: (None, hist), its scores are floats)."""
    Hq = q.shape[0]
    counts = np.zeros(Hq, np.int32) if counts is None else counts
    lev, hist = levels if levels is not None else (np.empty((Hq, max(1, n_store)), np.uint16), level_hist(Hq))
    return counts, np.empty(q.shape, np.float32), (lev, hist), min(numba.get_num_threads(), hist.shape[0])


def _encode_args(encode, unused, n_exact, n_store):
    """A step's encode tuple (slot, ...), or `unused` (slot -1) when None. The slot must hold a token
    of the exact tier, and a store must exist to take it."""
    if encode is None:
        return unused
    if not 0 <= encode[0] < n_exact or n_store <= 0:
        raise ValueError(f"encode slot {encode[0]} outside the exact tier [0, {n_exact}) or empty store")
    return encode


def _valid_mask(valid, n_exact):
    """exact_valid as the kernels take it: uint8 [>= n_exact], or empty for "every slot"."""
    if valid is None:
        return _ALL_VALID
    valid = np.ascontiguousarray(valid, np.uint8)
    if valid.ndim != 1 or valid.shape[0] < n_exact:
        raise ValueError(f"exact_valid must be [>= n_exact={n_exact}], got {valid.shape}")
    return valid


_NO_CNORM = np.zeros((1, 1, 1), np.float32)
_NO_KEYS = np.zeros((1, 1, 1), np.uint16)   # (rescore off over a quantized pool: K is not read)
_NO_CODES = {1: np.zeros((1, 1, 1), np.uint8), 2: np.zeros((1, 1, 1), np.int16)}
