"""Where one decode step's time goes, at a given context depth, for dense or HCA.

Usage: python scripts/profile_decode.py MODEL --depth 16384 [--kv hca --kv-budget 0.125] [--steps 20]
           [--fill text|random|tokens] [--profiler torch|cprofile|none] [--breakdown] [--attention-time]
The cache is filled through its own append path with the K/V of a dense prefill over natural text
(computed once, cached in /tmp) or with random K/V, or by prefilling random token ids through the
engine ("tokens", what `minirun bench` does); then decode steps are timed. Prints ms/step and the
top operators (torch profiler) or functions (cProfile). --breakdown (HCA, CPU): captures the
arguments of every layer's fused HCA call in one real step and times parts of that step on them
(the lookup table and its packing alone (the step's LUT kernel), sinks + ring (the fused call with
an empty store: the exact tier, the token itself and the merge), the fused call itself (with the
ring-key encode the real step does) and the store's part as the difference), summed over the
layers, with the selected fraction beside the exact minimal sets on the same scores (the call's
levels).
--attention-time: the attention kernel's own time inside the timed steps (dense or HCA), so the
two modes' attention can be compared apart from the rest of the step, which both share.
PROFILE_ROWS=N prints N rows of the cProfile table.
"""
import argparse
import cProfile
import os
import pstats
import time

import torch

from minirun import Engine
from minirun.kv.codebooks import Codebooks


def real_kv(model: str, depth: int, dtype: str) -> tuple:
    """K, V [L, Hkv, depth, hd] of a dense prefill over natural text (cached in /tmp between runs)."""
    import os
    path = f"/tmp/minirun-kv-{os.path.basename(model.rstrip('/'))}-{depth}-{dtype}.pt"
    if os.path.exists(path):
        return torch.load(path)
    import pydoc_data.topics
    text = "\n\n".join(pydoc_data.topics.topics.values())
    eng = Engine.load(model, device="cpu", dtype=dtype, ctx=depth)
    ids = (eng.tokenize(text) * 4)[:depth]
    t0 = time.perf_counter()
    eng.prefill(ids)
    print(f"dense prefill of {depth} tokens of text: {time.perf_counter() - t0:.1f}s")
    kv = (eng.cache.k[:, :, :depth].clone(), eng.cache.v[:, :, :depth].clone())
    torch.save(kv, path)
    return kv


@torch.inference_mode()
def fill(eng: Engine, depth: int, source: str, chunk: int = 4096) -> None:
    """Make the cache hold `depth` tokens: random K/V ("random": worst case for selection, since
    attention is diffuse) or the K/V of real text ("text"), through the cache's own append path."""
    a, cache = eng.args, eng.cache
    if source == "tokens":
        from minirun.tools.bench import random_ids
        eng.prefill(random_ids(depth, a.vocab_size, seed=0))
        return
    g = torch.Generator().manual_seed(0)
    if source == "text":
        K, V = real_kv(str(eng.path), depth, eng.config.dtype)
    else:
        K = torch.randn(a.num_hidden_layers, a.num_key_value_heads, depth, a.head_dim, generator=g)
        V = torch.randn(K.shape, generator=g)
    if eng.config.kv == "dense":
        cache.k[:, :, :depth] = K
        cache.v[:, :, :depth] = V
        cache.offset = depth
    else:
        if source == "random" and not cache.layout.exact_keys and cache.codebooks is None:
            lay = cache.layout
            shape = (a.num_hidden_layers, a.num_key_value_heads, lay.groups, lay.centroids, lay.sub_dim)
            cache.codebooks = Codebooks(torch.randn(shape, generator=g), "random")
        cache.begin_prefill("exact")     # text: keys stay exact until end_prefill fits codebooks on them
        for p0 in range(0, depth, chunk):
            T = min(chunk, depth - p0)
            for layer in range(a.num_hidden_layers):
                cache._staged[layer] = (K[layer, :, p0:p0 + T].transpose(0, 1).to(eng.dtype),
                                        V[layer, :, p0:p0 + T].transpose(0, 1).to(eng.dtype))
            cache.advance(T)
        cache.end_prefill()
    eng._cached_ids = [0] * depth


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--depth", type=int, default=16384)
    ap.add_argument("--kv", default="dense", choices=["dense", "hca"])
    ap.add_argument("--kv-budget", type=float, default=0.125)
    ap.add_argument("--groups", type=int, default=None, help="HCA: explicit groups (with --centroids)")
    ap.add_argument("--centroids", type=int, default=None, help="HCA: explicit centroids (16: nibble pairs)")
    ap.add_argument("--tau", type=float, default=0.9)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--profiler", default="torch", choices=["torch", "cprofile", "none"])
    ap.add_argument("--fill", default="text", choices=["text", "random", "tokens"],
                    help="cache contents: K/V of real text (realistic selection sizes), random K/V, or "
                         "random token ids prefilled through the model (as minirun bench)")
    ap.add_argument("--breakdown", action="store_true", help="HCA: time each kernel of one real step")
    ap.add_argument("--attention-time", action="store_true",
                    help="time the cache's one-token attention kernel (hca_decode_attend, "
                         "hca_exact_decode_attend or dense_attend) inside the timed steps: ms per call "
                         "and per step; the rest of the step is the rest")
    ap.add_argument("--far-positions", default="auto", choices=["auto", "on", "grouped", "off"],
                    help="HCA: far positions (auto: on past the model's trained context)")
    ap.add_argument("--cold", action="store_true",
                    help="with --breakdown: evict the caches (read 64 MB) before each timed call, as the "
                         "layer's weight GEMVs do in a real step")
    a = ap.parse_args()
    eng = Engine.load(a.model, device="cpu", dtype=a.dtype, ctx=a.depth + a.steps * 3 + 8, kv=a.kv,
                      kv_budget=a.kv_budget, groups=a.groups, centroids=a.centroids, tau=a.tau,
                      threads=a.threads, far_positions=a.far_positions)
    t0 = time.perf_counter()
    fill(eng, a.depth, a.fill)
    print(f"filled {a.depth} tokens in {time.perf_counter() - t0:.1f}s; kv_stats={eng.kv_stats()}")
    for _ in range(3):
        eng.step(1)                                   # warm-up (JIT, allocator)
    timer = AttentionTimer(a.kv, getattr(eng.cache, "layout", None)) if a.attention_time else None
    t0 = time.perf_counter()
    for _ in range(a.steps):
        eng.step(1)
    dt = (time.perf_counter() - t0) / a.steps
    print(f"{a.kv} depth {a.depth} dtype {a.dtype} threads {torch.get_num_threads()}: "
          f"{dt * 1e3:.1f} ms/step = {1 / dt:.2f} tok/s")
    if timer is not None and timer.calls == 0:
        timer.restore()
        print(f"  attention kernel: {timer.name} was not called (this cache's one-token step takes another path)")
    elif timer is not None:
        timer.restore()
        print(f"  attention kernel: {timer.total / timer.calls * 1e3:.3f} ms per call (layer), "
              f"{timer.total / a.steps * 1e3:.1f} ms/step; rest of the step {(dt - timer.total / a.steps) * 1e3:.1f} ms")
    if a.profiler == "torch":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(a.steps):
                eng.step(1)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    if a.breakdown:
        breakdown(eng, a.cold)
    elif a.profiler == "cprofile":
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.steps):
            eng.step(1)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(int(os.environ.get("PROFILE_ROWS", 15)))


class AttentionTimer:
    """Wraps the one-token attention kernel the cache calls (kernels_cpu.hca_decode_attend for HCA,
    hca_exact_decode_attend for HCA with exact keys, fastscan.hca_decode_attend_fs for nibble
    pairs, kernels_cpu.dense_attend for dense) with a
    timer: total seconds and calls."""

    def __init__(self, kv: str, layout=None):
        import kernels_cpu as kc
        import minirun.kv.dense as dense
        from kernels_cpu import fastscan as fs
        from minirun.kv.hca_layout import fast_scan
        if kv == "hca" and layout.pairs and fast_scan(layout):     # nibble pairs: kernels_cpu.fastscan
            self.mod, self.name = fs, "hca_decode_attend_fs"
        elif kv == "hca":
            self.mod, self.name = kc, ("hca_exact_decode_attend" if layout.exact_keys else "hca_decode_attend")
        else:
            self.mod, self.name = dense.kernels_cpu, "dense_attend"
        self.real = getattr(self.mod, self.name)
        self.total, self.calls = 0.0, 0

        def timed(*args, **kw):
            t = time.perf_counter()
            out = self.real(*args, **kw)
            self.total += time.perf_counter() - t
            self.calls += 1
            return out
        setattr(self.mod, self.name, timed)

    def restore(self) -> None:
        setattr(self.mod, self.name, self.real)


def breakdown(eng: Engine, cold: bool = False) -> None:
    """Time each kernel of one real HCA decode step on its captured per-layer arguments (cold: with
    the caches evicted before each call, as in a real step, where the weights stream through)."""
    import kernels_cpu as kc
    calls, real = [], kc.hca_decode_attend

    def capture(*args, **kw):
        calls.append((args, kw))
        return real(*args, **kw)
    kc.hca_decode_attend = capture    # (the key store calls it through the module: kv/key_store_cpu.py)
    try:
        eng.step(1)
    finally:
        kc.hca_decode_attend = real

    import numpy as np
    from numba import njit, prange

    @njit(parallel=True)
    def evict(x):    # on the kernels' own threads, as a GEMV would (a serial NumPy pass lets them sleep);
        s = 0.0      # reading, as the GEMVs do: written lines would be written back during the timed call
        for i in prange(x.shape[0] // 8):
            s += x[i * 8]
        return s
    junk = np.ones(8 << 20)                           # 64 MB: more than the last-level cache

    def ms(f, k=10):
        f()
        if not cold:
            t0 = time.perf_counter()
            for _ in range(k):
                f()
            return (time.perf_counter() - t0) / k * 1e3
        t = 0.0
        for _ in range(k):
            evict(junk)
            t0 = time.perf_counter()
            f()
            t += time.perf_counter() - t0
        return t / k * 1e3
    from kernels_cpu._common import _as_f32, _as_pool
    from kernels_cpu.hca_step import _NO_CNORM, _NO_CODES
    from kernels_cpu.packed import _k_lut_pack

    def minimal_fraction(zs, tau):
        """The mean over heads of the fraction of zs's tokens in the smallest set holding tau of the
        head's softmax mass (a full sort)."""
        w = -np.sort(-np.exp(zs - zs.max(axis=1, keepdims=True)).astype(np.float64), axis=1)
        cum = np.cumsum(w, axis=1)
        k = [min(int(np.searchsorted(c, tau * c[-1])) + 1, zs.shape[1]) for c in cum]
        return float(np.mean(k)) / zs.shape[1]
    tot = dict.fromkeys(["lut", "sinks+ring", "fused call"], 0.0)
    sel = []
    for args, kw in calls:
        q, k, v, EK, EV, n_exact, cbt, PT, n, V, tau, q2k, packed, lut, z, idx, counts = args
        qf, ek0, codes = _as_f32(q), _as_pool(EK)[:, 0], _NO_CODES[PT.dtype.itemsize]   # (no encode)
        tot["lut"] += ms(lambda: _k_lut_pack(qf, cbt, packed.lanes, lut, packed.tables, packed.scale, packed.offset,
                                             packed.top, packed.shift, False, ek0, _NO_CNORM, codes))
        no_store = {key: val for key, val in kw.items() if key != "encode"}   # (an encode needs a store)
        tot["sinks+ring"] += ms(lambda: real(q, k, v, EK, EV, n_exact, cbt, PT, 0, V, tau, q2k, packed, lut, z, idx,
                                             counts, **no_store))
        tot["fused call"] += ms(lambda: real(*args, **kw))
        # what the last call selected, and the exact minimal sets on its scores (levels as floats)
        zs = kw["levels"][0][:, :n].astype(np.float32) * packed.scale[:, None] + packed.offset[:, None]
        sel.append((counts.mean() / n, minimal_fraction(zs, tau)))
    tot["store (rest)"] = tot["fused call"] - tot["sinks+ring"]
    print(f"parts of one step, summed over {len(calls)} layers (store of {calls[0][0][8]} tokens, "
          f"mean selected fraction {sum(a for a, _ in sel) / len(sel):.4f}; exact minimal sets on the same "
          f"scores {sum(b for _, b in sel) / len(sel):.4f}):")
    for name, t in tot.items():
        print(f"  {name:15s} {t:7.1f} ms  ({t / len(calls):.3f} ms per layer)")


if __name__ == "__main__":
    main()
