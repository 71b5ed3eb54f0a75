"""The one-token CPU kernels at SmolLM2 shapes: weight GEMVs per step, and dense attention vs SDPA.

Usage: python scripts/bench_decode_kernels.py [--depths 512 4096 16384] [--rounds 9] [--threads 2]
       git worktree add /tmp/old REV && PYTHONPATH=/tmp/old python scripts/bench_decode_kernels.py --depths

- GEMV: every weight matrix of a decode step (QKV, o, gate/up, down per layer; LM head) through
  the public kernels_cpu.norm_gemv, 30 copies of each layer matrix so the weights come from memory
  as in a real step. The same script runs against an older kernels_cpu (git checkout REV --
  kernels_cpu) to compare kernel versions.
- Attention: one decode token over a dense cache of each depth, 30 layers: kernels_cpu.dense_attend
  against torch SDPA with 4-D GQA inputs (what the dense cache used before), in alternating rounds.
Medians over rounds (after a warm-up round), ms per step of 30 layers.
"""
import argparse
import math
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

import kernels_cpu as kc

D, F_, HQ, HKV, HD, L, VOCAB = 576, 1536, 9, 3, 64, 30, 49152   # SmolLM2-135M
SHAPES = {"qkv": ((HQ + 2 * HKV) * HD, D), "o": (D, HQ * HD), "gate_up": (2 * F_, D), "down": (D, F_)}


def bits(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return a
    return torch.from_numpy(a).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def median_ms(fns: dict, rounds: int) -> dict:
    """Alternate the functions round by round; median ms of each (round 0 dropped)."""
    ts = {k: [] for k in fns}
    for r in range(rounds + 1):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            if r:
                ts[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in ts.items()}


def gemv_step(dtype: str, rounds: int, rng) -> tuple[float, float]:
    """(ms per step, GB/s) of all weight GEMVs of one decode step."""
    mats = [bits(rng.standard_normal(s).astype(np.float32) * 0.05, dtype) for s in SHAPES.values() for _ in range(L)]
    mats.append(bits(rng.standard_normal((VOCAB, D)).astype(np.float32) * 0.05, dtype))
    vecs = {I: (bits(rng.standard_normal(I).astype(np.float32), dtype), bits(np.ones(I, np.float32), dtype))
            for I in {m.shape[1] for m in mats}}

    def step():
        for w in mats:
            x, nw = vecs[w.shape[1]]
            kc.norm_gemv(x, nw, 1e-5, w)
    ms = median_ms({"gemv": step}, rounds)["gemv"]
    return ms, sum(w.nbytes for w in mats) / ms / 1e6


def attention_step(dtype: str, n: int, rounds: int, rng) -> dict:
    tdt = torch.float32 if dtype == "float32" else torch.bfloat16
    Ks = [torch.randn(HKV, n, HD).to(tdt) for _ in range(L)]
    Vs = [torch.randn(HKV, n, HD).to(tdt) for _ in range(L)]
    q = torch.randn(HQ, HD).to(tdt)
    np_ = (lambda t: t.numpy()) if dtype == "float32" else (lambda t: t.view(torch.int16).numpy().view(np.uint16))
    Kn, Vn, qn = [np_(k) for k in Ks], [np_(v) for v in Vs], np_(q)
    out = np.empty((HQ, HD), qn.dtype)
    scale = 1.0 / math.sqrt(HD)

    def ours():
        for K, V in zip(Kn, Vn):
            kc.dense_attend(qn, K, V, n, scale, out=out)

    def sdpa():
        qg = q.view(1, HKV, HQ // HKV, HD)
        for K, V in zip(Ks, Vs):
            F.scaled_dot_product_attention(qg, K[None], V[None])
    return median_ms({"dense_attend": ours, "sdpa": sdpa}, rounds)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="*", default=[512, 4096, 16384],
                    help="attention depths (none: GEMVs only, e.g. against an older kernels_cpu)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    kc.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    print(f"SmolLM2 shapes, {a.threads} threads, {a.rounds} rounds; ms per decode step (30 layers), median")
    for dtype in ("float32", "bfloat16"):
        ms, gbs = gemv_step(dtype, a.rounds, rng)
        print(f"{dtype:8s} weight GEMVs: {ms:7.2f} ms ({gbs:.1f} GB/s)")
        with torch.inference_mode():
            for n in a.depths:
                r = attention_step(dtype, n, a.rounds, rng)
                print(f"{dtype:8s} attention @ {n:6d} keys: dense_attend {r['dense_attend']:7.2f} ms, "
                      f"SDPA {r['sdpa']:7.2f} ms (x{r['sdpa'] / r['dense_attend']:.2f})")


if __name__ == "__main__":
    main()
