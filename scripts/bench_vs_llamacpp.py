"""minirun against llama.cpp on the same weights, in alternating rounds: the figures for issue 2.

Usage:
  python scripts/gguf_retype.py SmolLM2-135M-Instruct.Q4_1.gguf smollm2-bf16.gguf --type bf16
  python scripts/bench_vs_llamacpp.py models/SmolLM2-135M-Instruct smollm2-bf16.gguf --dtype bfloat16 \
      -p 512 -n 64 --rounds 9 --threads 2

Needs `pip install llama-cpp-python` (builds llama.cpp from source; not a minirun dependency).
Why rounds: on a shared VM the speed of both engines drifts by 10-40% within minutes (steal time),
so separate runs minutes apart compare the machine's moods, not the engines. Each round measures
minirun then llama.cpp back to back (pp N: prefill N random tokens; tg N: decode N tokens after
those N, both engines greedy over their own logits), and the report gives the median of each
engine and the median of the per-round ratios (paired), with min and max.
"""
import argparse
import statistics
import time

import torch

from minirun import Engine
from minirun.bench import measure_pp, measure_tg, random_ids


def llama_round(llm, ids: list[int], n_gen: int) -> tuple[float, float]:
    """Prefill ids in one batch, then n_gen single-token steps: (pp tok/s, tg tok/s)."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    tok = int(llm.scores[llm.n_tokens - 1].argmax())
    for _ in range(n_gen):
        llm.eval([tok])
        tok = int(llm.scores[llm.n_tokens - 1].argmax())
    t2 = time.perf_counter()
    return len(ids) / (t1 - t0), n_gen / (t2 - t1)


def summary(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} (min {min(xs):.2f}, max {max(xs):.2f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="minirun model directory")
    ap.add_argument("gguf", help="the same weights as a GGUF for llama.cpp (scripts/gguf_retype.py)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("-p", type=int, default=512, help="prompt tokens (pp test, and the tg test's depth)")
    ap.add_argument("-n", type=int, default=64, help="tokens decoded in the tg test")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from llama_cpp import Llama
    torch.set_num_threads(a.threads)
    eng = Engine.load(a.model, device="cpu", dtype=a.dtype, ctx=a.p + a.n + 8, threads=a.threads)
    llm = Llama(model_path=a.gguf, n_ctx=a.p + a.n + 16, n_batch=a.p, n_ubatch=a.p, n_threads=a.threads,
                n_threads_batch=a.threads, verbose=False, logits_all=True)
    ids = random_ids(a.p, eng.args.vocab_size, seed=0)
    rows = {"minirun pp": [], "minirun tg": [], "llama.cpp pp": [], "llama.cpp tg": []}
    for r in range(a.rounds + 1):                 # round 0 warms both up (JIT, caches) and is dropped
        pp_m = measure_pp(eng, a.p, seed=0)
        tg_m, _, _ = measure_tg(eng, a.n, a.p, seed=0)
        pp_l, tg_l = llama_round(llm, ids, a.n)
        if r:
            for k, v in zip(rows, (pp_m, tg_m, pp_l, tg_l)):
                rows[k].append(v)
            print(f"round {r}: minirun pp {pp_m:.1f} tg {tg_m:.2f} | llama.cpp pp {pp_l:.1f} tg {tg_l:.2f} "
                  f"| tg ratio {tg_m / tg_l:.2f}", flush=True)
    print(f"\n{a.dtype}, {a.threads} threads, pp{a.p} and tg{a.n} @ d{a.p}, {a.rounds} rounds; tok/s median:")
    for k, xs in rows.items():
        print(f"  {k:13s} {summary(xs)}")
    for t in ("pp", "tg"):
        ratios = [m / l for m, l in zip(rows[f"minirun {t}"], rows[f"llama.cpp {t}"])]
        print(f"  {t} minirun / llama.cpp, per round: {summary(ratios)}")


if __name__ == "__main__":
    main()
