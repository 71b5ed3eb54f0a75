"""Kernel variants timed alone (CUDA events) at SmolLM2's HCA decode shapes (9 query heads on 3 kv
heads, g64c16 codes: 32 nibble-pair bytes a token), where the decode step chooses between two
kernels: the codes' scores (per query head over the pairs' 256-entry tables, or per kv head over the
groups' 16-entry tables: approx_scores_nibbles) and zhist's adds (once per bin and warp, or per
lane), the latter on scores spread as random weights give them and peaked as text gives them.

    python scripts/gpu_kernels.py [--n 1048576 131072] [--reps 20]

scripts/bench_gpu.py runs it as its step "kernels" (log lines only); the two zhist variants' mass
histograms are compared too (a GPU check of the per-lane adds).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels_cuda.launch import (N_BINS, Z_RANGE, _backend, _score_blocks, launch_approx_scores,  # noqa: E402
                                 launch_zhist, score_parts)


def timed(fn, reps: int, device) -> float:
    """Mean microseconds of fn() over reps calls, after one untimed call (compiles)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize(device)
        return a.elapsed_time(b) * 1000 / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e6 / reps


def kernel_variants(device: torch.device, n: int, reps: int, log=print, Hq: int = 9, Hkv: int = 3) -> dict:
    """Time the variants over n tokens; returns {name: microseconds}."""
    g = torch.Generator().manual_seed(0)
    be = _backend()
    num_sms, optin = be.device_info(device)
    P = torch.randint(0, 256, (Hkv, n, 32), generator=g, dtype=torch.uint8).to(device)
    T16 = (torch.randn(Hq, 64, 16, generator=g) * 0.5).to(device)
    T256 = (T16[:, 0::2, None, :] + T16[:, 1::2, :, None]).reshape(Hq, 32, 256).contiguous()
    q2k = (torch.arange(Hq) // (Hq // Hkv)).to(torch.int32).to(device)
    z = torch.empty(Hq, n, device=device)
    parts = score_parts(n, Hq, Hkv, num_sms)
    pm, pl = torch.empty(Hq * parts, device=device), torch.empty(Hq * parts, device=device)
    m, l = torch.empty(Hq, device=device), torch.empty(Hq, device=device)

    def scores(T, nibbles):
        with be.session(device) as L:
            launch_approx_scores(L, T, P, q2k, z, n, pm, pl, m, l, num_sms, optin, nibbles=nibbles)
    out = {"scores pair tables": timed(lambda: scores(T256, False), reps, device)}
    z_pairs = z.clone()
    out["scores nibbles"] = timed(lambda: scores(T16, True), reps, device)
    err = (z - z_pairs).abs().max().item()
    log(f"approx_scores @ {n}: pair tables per query head {out['scores pair tables']:.1f} us, "
        f"nibbles per kv head {out['scores nibbles']:.1f} us (max |difference| {err:.2e})")

    peaked = torch.randn(Hq, n, generator=g)
    peaked[:, ::1000] += 12.0   # a few tokens far above the rest: most scores in the clamped bin 0
    tpb, _ = _score_blocks(n, Hq, num_sms)
    hist = torch.zeros(Hq, N_BINS, device=device)
    hcount = torch.zeros(Hq, N_BINS, dtype=torch.int32, device=device)
    for name, zz in (("spread", z.clone()), ("peaked", peaked.to(device))):
        mz = zz.max(1).values.contiguous()
        masses = {}
        for by_match in (True, False):
            def hist_once():
                hist.zero_()
                with be.session(device) as L:
                    launch_zhist(L, zz, n, tpb, mz, Z_RANGE, N_BINS, hist, hcount, False, by_match=by_match)
            key = f"zhist {name} {'by match' if by_match else 'per lane'}"
            out[key] = timed(hist_once, reps, device)
            masses[by_match] = hist.clone()
        rel = ((masses[True] - masses[False]).abs().sum() / masses[True].abs().sum()).item()
        log(f"zhist @ {n}, {name} scores: by match {out[f'zhist {name} by match']:.1f} us, per lane "
            f"{out[f'zhist {name} per lane']:.1f} us (histograms differ by {rel:.1e} of the mass; a zeroing included)")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, nargs="+", default=[1 << 20, 1 << 17])
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    for n in a.n:
        kernel_variants(torch.device(a.device), n, a.reps)


if __name__ == "__main__":
    main()
