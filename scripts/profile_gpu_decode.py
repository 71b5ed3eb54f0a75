"""How much of the GPU HCA decode's host work the GPU hides (issue 4: "measure how much of the CPU
time is hidden").

Usage: python scripts/profile_gpu_decode.py MODEL --depth 131072 [--steps 32] [--kv-budget 0.125]
           [--max-select N] [--far-positions off] [--context text|random|FILE] [--dtype bfloat16]
After one prefill of `depth` context tokens the same greedy steps run three times (the cache
rewound to the context between runs, as `minirun bench` does): as they are (twice: wall W, of which
T in the host's value sums, timed around kernels_cpu.weighted_value_sum) and with the value sum
replaced by an empty result (W0: wrong logits, but the GPU path's own time). exposed = W - W0 is the
host sum's time on the critical path, hidden = T - exposed what ran while the GPU was busy.
--emulate runs the GPU cache on the CPU kernel emulator (a smoke test of this script, no timing).
"""
import argparse
import contextlib
import statistics
import sys
import time

import numpy as np

import kernels_cpu as kc
from kernels_cuda import _emu
from minirun import Engine
from minirun.bench import Context, measure_tg
from minirun.config import hca_setting


def empty_value_sum(z, idx, counts, V, q_to_kv, compact=False):
    """weighted_value_sum's shapes with nothing selected: (o 0, m -inf, l 0), which the merge ignores."""
    Hq, d = len(counts), V.shape[-1]
    return np.zeros((Hq, d), np.float32), np.full(Hq, -np.inf, np.float32), np.zeros(Hq, np.float32)


def run(a) -> dict:
    eng = Engine.load(a.model, device="cpu" if a.emulate else "cuda", dtype=a.dtype, ctx=a.depth + a.steps + 256,
                      kv="hca", max_select=a.max_select, far_positions=a.far_positions, **hca_setting(a.kv_budget))
    if type(eng.cache).__name__ != "HCACacheCUDA":
        raise SystemExit("profile_gpu_decode: the engine did not get the GPU cache (no CUDA device or no cupy?)")
    context = Context(a.context)
    measure_tg(eng, 2, a.depth, 0, context)                 # prefill + warm-up steps, untimed
    real, spent = kc.weighted_value_sum, [0.0]

    def timed(*args, **kw):
        t0 = time.perf_counter()
        out = real(*args, **kw)
        spent[0] += time.perf_counter() - t0
        return out

    runs = {}
    try:
        for name, fn in (("as is", timed), ("value sum skipped", empty_value_sum), ("as is", timed)):
            kc.weighted_value_sum, spent[0] = fn, 0.0
            tps, _, share = measure_tg(eng, a.steps, a.depth, 0, context, probe=name == "as is")
            runs.setdefault(name, []).append((1e3 / tps, 1e3 * spent[0] / a.steps, share))
    finally:
        kc.weighted_value_sum = real
    W = statistics.mean(r[0] for r in runs["as is"])
    T = statistics.mean(r[1] for r in runs["as is"])
    W0 = runs["value sum skipped"][0][0]
    exposed = max(0.0, W - W0)
    return {"depth": a.depth, "steps": a.steps, "ms_per_token": W, "ms_per_token_without_value_sum": W0,
            "value_sum_ms_per_token": T, "exposed_ms": exposed, "hidden_ms": max(0.0, T - exposed),
            "selected": runs["as is"][0][2], "runs": runs}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--depth", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--kv-budget", default="0.125")
    ap.add_argument("--max-select", type=int, default=None)
    ap.add_argument("--far-positions", default="off", choices=["auto", "on", "grouped", "off"])
    ap.add_argument("--context", default="text")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--emulate", action="store_true", help="the GPU cache on the CPU kernel emulator (smoke test)")
    a = ap.parse_args(argv)
    with _emu.emulated_hca_cuda() if a.emulate else contextlib.nullcontext():   # (the GPU cache on the CPU)
        r = run(a)
    T = r["value_sum_ms_per_token"]
    print(f"| depth | ms/token | without the value sum | value sum (host) | exposed | hidden | selected |\n"
          f"|---|---|---|---|---|---|---|\n"
          f"| {r['depth']} | {r['ms_per_token']:.2f} | {r['ms_per_token_without_value_sum']:.2f} | {T:.2f} | "
          f"{r['exposed_ms']:.2f} | {r['hidden_ms']:.2f} ({100 * r['hidden_ms'] / T if T else 0:.0f}%) | "
          f"{100 * (r['selected'] or 0):.1f}% |")
    sys.stdout.flush()
    return r


if __name__ == "__main__":
    main()
