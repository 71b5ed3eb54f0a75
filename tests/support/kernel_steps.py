"""The one-call HCA step kernels (kernels_cpu) run on small random cases: inputs and calls that
the kernel tests and the cache's tests share."""
import numba
import numpy as np

import kernels_cpu as kc
import references as ref
from kernels_cpu import fastscan as fs

HQ, HKV, D = 9, 3, 64
Q2K = (np.arange(HQ) // (HQ // HKV)).astype(np.int32)


def setup(rng, n_exact, n_store, g, c, pool_dtype):
    cap = n_store + 13                                      # wider buffers than the live tokens
    q = (rng.standard_normal((HQ, D)) / np.sqrt(D) * 3).astype(np.float32)
    k = rng.standard_normal((HKV, D)).astype(np.float32)
    v = rng.standard_normal((HKV, D)).astype(np.float32)
    EK = rng.standard_normal((HKV, n_exact + 5, D)).astype(pool_dtype)
    EV = rng.standard_normal((HKV, n_exact + 5, D)).astype(pool_dtype)
    C = rng.standard_normal((HKV, g, c, D // g)).astype(np.float32)
    P = rng.integers(0, c, size=(HKV, cap, g)).astype(np.int16 if c > 256 else np.uint8)
    V = rng.standard_normal((HKV, cap, D)).astype(pool_dtype)
    return q, k, v, EK, EV, C, P, V, cap


def run_fused(q, k, v, EK, EV, n_exact, C, P, n_store, V, tau, cap, host_keys=None):
    g, c = C.shape[1], C.shape[2]
    lanes = kc.lane_map(Q2K, HKV)
    packed = kc.PackedLUT(np.empty((lanes.shape[0], g, c), np.uint64), lanes, np.empty(HQ, np.float32),
                          np.empty(HQ, np.float32))
    lut = np.empty((HQ, g, c), np.float32)
    z = np.full((HQ, cap), np.nan, np.float32)
    idx = np.zeros((HQ, cap), np.int32)
    counts = np.zeros(HQ, np.int32)
    o = kc.hca_decode_attend(q, k, v, EK, EV, n_exact, ref.codebooks_t(C), ref.group_major(P), n_store, V,
                             tau, Q2K, packed, lut, z, idx, counts, host_keys=host_keys)
    return o, counts, packed, lut


def factors(rng, Hkv, G, ds):
    return rng.standard_normal((Hkv, G, ds, 16)).astype(np.float32)


def fastscan_store_step(q, F, PT, n, q2k):
    """One hca_decode_attend_fs call over the store PT (no exact tier, zero values) -> (lut, lev int64
    [Hq, n], bucket counts int64 [Hq, NB] summed over the threads): the step's tables and levels."""
    Hq, d = q.shape
    Hkv, cap = F.shape[0], PT.shape[2]
    lut = fs.FastScanLUT(Hq, F.shape[1], kc.lane_map(q2k, Hkv))
    lev, hist = np.zeros((Hq, cap), np.uint16), kc.level_hist(Hq)
    kv, E = np.zeros((Hkv, d), np.float32), np.zeros((Hkv, 1, d), np.float32)
    fs.hca_decode_attend_fs(q, kv, kv, E, E, 0, F, PT, n, np.zeros((Hkv, cap, d), np.float32), 0.9, q2k, lut,
                            np.zeros((Hq, cap), np.float32), np.zeros((Hq, cap), np.int32), levels=(lev, hist))
    nt = min(numba.get_num_threads(), hist.shape[0])
    return lut, lev[:, :n].astype(np.int64), hist[:nt].sum(0, dtype=np.int64)


def packed_store_step(q, C, P, n, q2k, tau=0.9, V=None):
    """One hca_decode_attend call over the store P [Hkv, n_cap, g] (token-major; no exact tier;
    values V, zeros by default) -> (o, counts, packed, T, lev int64 [Hq, n], bucket counts
    int64 [Hq, NB] summed over the threads): the step's tables, levels and selection sizes."""
    Hq, d = q.shape
    Hkv, g, c = C.shape[:3]
    cap = P.shape[1]
    lanes = kc.lane_map(q2k, Hkv)
    packed = kc.PackedLUT(np.empty((lanes.shape[0], g, c), np.uint64), lanes, np.empty(Hq, np.float32),
                          np.empty(Hq, np.float32))
    T = np.empty((Hq, g, c), np.float32)
    lev, hist = np.zeros((Hq, max(cap, 1)), np.uint16), kc.level_hist(Hq)
    counts = np.zeros(Hq, np.int32)
    kv = np.zeros((Hkv, d), np.float32)
    V = np.zeros((Hkv, cap, d), np.float32) if V is None else V
    o = kc.hca_decode_attend(q, kv, kv, np.zeros((Hkv, 1, d), np.float32), np.zeros((Hkv, 1, d), np.float32), 0,
                             ref.codebooks_t(C), ref.group_major(P), n, V, tau, q2k, packed, T,
                             np.zeros((Hq, cap), np.float32), np.zeros((Hq, cap), np.int32), counts,
                             levels=(lev, hist))
    nt = min(numba.get_num_threads(), hist.shape[0])
    return o, counts, packed, T, lev[:, :n].astype(np.int64), hist[:nt].sum(0, dtype=np.int64)
