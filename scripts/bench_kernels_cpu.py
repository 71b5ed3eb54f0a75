#!/usr/bin/env python
"""Time each Numba CPU kernel against its NumPy reference.

SmolLM2-style shapes: Hq=9, Hkv=3, d=64, g=16, c=256; n = 16384 and 131072
by default.  Times are the best of several runs after a warm-up call (so Numba
compilation, or loading from the on-disk cache, is excluded).  The one-call
decode steps attend over 272 exact tokens besides the store of n.  References
that would take too long at large n (encode_keys_ref, hca_exact_decode_attend_ref)
are timed on a prefix of the tokens and scaled linearly; those rows are marked
with '*'.

    PYTHONPATH=. python scripts/bench_kernels_cpu.py [--n 16384 131072] [--tau 0.9] [--groups 16 --centroids 256]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

import kernels_cpu as kc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))   # the NumPy references live with the tests
import references as ref  # noqa: E402


def best_time(fn, reps, min_total=0.2):
    fn()  # warm-up (compile / cache load)
    best = float("inf")
    t_start = time.perf_counter()
    done = 0
    while done < reps or (time.perf_counter() - t_start < min_total and done < 50 * reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        done += 1
    return best


def fmt(t):
    if t >= 1.0:
        return f"{t:8.3f} s "
    if t >= 1e-3:
        return f"{t * 1e3:8.3f} ms"
    return f"{t * 1e6:8.1f} us"


def bench(n, tau, Hq=9, Hkv=3, d=64, g=16, c=256, seed=0, ref_cap=16384):
    rng = np.random.default_rng(seed)
    ds = d // g
    q2k = (np.arange(Hq) // (Hq // Hkv)).astype(np.int32)
    q = (rng.standard_normal((Hq, d)) / np.sqrt(d)).astype(np.float32) * 3
    cb = rng.standard_normal((Hkv, g, c, ds)).astype(np.float32)
    K = rng.standard_normal((Hkv, n, d)).astype(np.float32)
    V32 = rng.standard_normal((Hkv, n, d)).astype(np.float32)
    V16 = V32.astype(np.float16)
    rows = []

    def row(name, f_numba, f_ref, reps=5, ref_reps=1, ref_scale=1.0):
        tn = best_time(f_numba, reps)
        tr = best_time(f_ref, ref_reps, min_total=0.0) * ref_scale
        rows.append((name, tn, tr, ref_scale != 1.0))

    T = ref.build_lut_ref(q, cb, q2k)
    P = kc.encode_keys(K, cb)
    PT = ref.group_major(P)
    nr = min(n, ref_cap)
    # the one-call decode steps: sinks + ring (n_exact tokens), the token itself, the store of n
    n_exact = 272
    EK, EV = rng.standard_normal((2, Hkv, n_exact, d)).astype(np.float32)
    kn, vn = rng.standard_normal((2, Hkv, d)).astype(np.float32)
    lanes = kc.lane_map(q2k, Hkv)
    packed = kc.PackedLUT(np.empty((lanes.shape[0], g, c), np.uint64), lanes, np.empty(Hq, np.float32),
                          np.empty(Hq, np.float32))
    zbuf, ibuf, counts = np.empty((Hq, n), np.float32), np.empty((Hq, n), np.int32), np.zeros(Hq, np.int32)
    lut, hist = np.empty((Hq, g, c), np.float32), kc.level_hist(Hq)
    levels = (np.empty((Hq, n), np.uint16), hist)
    cbt = ref.codebooks_t(cb)
    row(f"hca_decode_attend f16 tau={tau}",
        lambda: kc.hca_decode_attend(q, kn, vn, EK, EV, n_exact, cbt, PT, n, V16, tau, q2k, packed, lut, zbuf, ibuf,
                                     counts, levels=levels),
        lambda: ref.hca_decode_attend_ref(q, kn, vn, EK, EV, n_exact, cb, P, n, V16, tau, q2k))
    row(f"hca_exact_decode_attend f16 tau={tau}",
        lambda: kc.hca_exact_decode_attend(q, kn, vn, EK, EV, n_exact, K, n, V16, tau, q2k, lanes, zbuf, hist, counts),
        lambda: ref.hca_exact_decode_attend_ref(q, kn, vn, EK, EV, n_exact, K[:, :nr], nr, V16, tau, q2k),
        ref_scale=n / nr)
    z = ref.packed_scores_ref(T, P, q2k, n)        # the store's scores as the codebook step makes them
    idx, cnt, m, l = ref.threshold_select_ref(z, tau)   # (the GPU cache's host value sum reads such a list)
    frac = cnt.mean() / n
    for name, V in (("f32", V32), ("f16", V16)):
        row(
            f"weighted_value_sum {name} ({frac:.0%} sel)",
            lambda V=V: kc.weighted_value_sum(z, idx, cnt, V, q2k),
            lambda V=V: ref.weighted_value_sum_ref(z, idx, cnt, V, q2k),
        )
    K16 = K.astype(np.float16)
    Kr = np.ascontiguousarray(K[:, :nr])
    row("encode_keys f32", lambda: kc.encode_keys(K, cb), lambda: ref.encode_keys_ref(Kr, cb), reps=3, ref_scale=n / nr)
    row("encode_keys f16", lambda: kc.encode_keys(K16, cb), lambda: ref.encode_keys_ref(K16[:, :nr], cb), reps=3, ref_scale=n / nr)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[16384, 131072])
    ap.add_argument("--tau", type=float, default=0.9)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--centroids", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None, help="numba threads (default: all)")
    args = ap.parse_args()
    import os

    import numba

    if args.threads:
        numba.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"numba {numba.__version__} (threads {numba.get_num_threads()}), "
        f"numpy {np.__version__}, half conversion: {kc.HALF_CONVERSION}, cpus {os.cpu_count()}, load {load:.2f}"
    )
    print(f"shapes: Hq=9 Hkv=3 d=64 g={args.groups} c={args.centroids}; times = best of several runs, "
          "compile excluded")
    for n in args.n:
        rows = bench(n, args.tau, g=args.groups, c=args.centroids)
        print(f"\nn = {n}")
        print(f"{'kernel':44s} {'numba':>11s} {'reference':>11s} {'speedup':>8s}")
        for name, tn, tr, extrap in rows:
            print(f"{name:44s} {fmt(tn)} {fmt(tr)}{'*' if extrap else ' '} {tr / tn:7.1f}x")
    print("\n* reference timed on the first 16384 tokens and scaled linearly")


if __name__ == "__main__":
    main()
