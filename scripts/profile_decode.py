"""Where one decode step's time goes, at a given context depth, for dense or HCA.

Usage: python scripts/profile_decode.py MODEL --depth 16384 [--kv hca --kv-budget 0.125] [--steps 20]
The cache is filled with synthetic keys/values (random, through the cache's own append path), so
a deep context costs seconds instead of a long prefill; a decode step's cost does not depend on
the values. Prints ms/step and the top operators (torch profiler) or functions (cProfile).
"""
import argparse
import cProfile
import pstats
import time

import torch

from minirun import Engine
from minirun.kv.codebooks import Codebooks


@torch.inference_mode()
def fill_synthetic(eng: Engine, depth: int, chunk: int = 4096) -> None:
    """Make the cache hold `depth` tokens of random K/V (post-RoPE scale ~ real keys)."""
    a, cache = eng.args, eng.cache
    g = torch.Generator().manual_seed(0)
    if eng.config.kv == "dense":
        cache.k[:, :, :depth].normal_(generator=g)
        cache.v[:, :, :depth].normal_(generator=g)
        cache.offset = depth
    else:
        lay = cache.layout
        if not lay.exact_keys and cache.codebooks is None:
            shape = (a.num_hidden_layers, a.num_key_value_heads, lay.groups, lay.centroids, lay.sub_dim)
            cache.codebooks = Codebooks(torch.randn(shape, generator=g), "random")
        for p0 in range(0, depth, chunk):
            T = min(chunk, depth - p0)
            for layer in range(a.num_hidden_layers):
                kv = torch.randn(2, T, a.num_key_value_heads, a.head_dim, generator=g).to(eng.dtype)
                cache._staged[layer] = (kv[0], kv[1])
            cache.advance(T)
    eng._cached_ids = [0] * depth


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--depth", type=int, default=16384)
    ap.add_argument("--kv", default="dense", choices=["dense", "hca"])
    ap.add_argument("--kv-budget", type=float, default=0.125)
    ap.add_argument("--tau", type=float, default=0.9)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--profiler", default="torch", choices=["torch", "cprofile", "none"])
    a = ap.parse_args()
    eng = Engine.load(a.model, device="cpu", dtype=a.dtype, ctx=a.depth + a.steps * 3 + 8, kv=a.kv,
                      kv_budget=a.kv_budget, tau=a.tau, threads=a.threads)
    t0 = time.perf_counter()
    fill_synthetic(eng, a.depth)
    print(f"filled {a.depth} tokens in {time.perf_counter() - t0:.1f}s; kv_stats={eng.kv_stats()}")
    for _ in range(3):
        eng.step(1)                                   # warm-up (JIT, allocator)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        eng.step(1)
    dt = (time.perf_counter() - t0) / a.steps
    print(f"{a.kv} depth {a.depth} dtype {a.dtype} threads {torch.get_num_threads()}: "
          f"{dt * 1e3:.1f} ms/step = {1 / dt:.2f} tok/s")
    if a.profiler == "torch":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(a.steps):
                eng.step(1)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    elif a.profiler == "cprofile":
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.steps):
            eng.step(1)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
