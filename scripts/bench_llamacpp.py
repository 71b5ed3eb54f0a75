"""The reference to beat: llama.cpp (llama-cpp-python) prefill and decode tokens/s on a GGUF.

Usage: python scripts/bench_llamacpp.py MODEL.gguf [-p 512] [-n 64] [-r 3] [--threads 2]
Needs `pip install llama-cpp-python` (builds llama.cpp from source; not a minirun dependency).
Random token ids as llama-bench uses; prefill in one batch of -p tokens, then -n single-token
decode steps after it. Prints mean +- std tokens/s over -r repetitions.
"""
import argparse
import statistics
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from llama_cpp import Llama
    llm = Llama(model_path=a.model, n_ctx=a.p + a.n + 16, n_batch=a.p, n_ubatch=a.p, n_threads=a.threads,
                n_threads_batch=a.threads, verbose=False, logits_all=False)
    rng = np.random.default_rng(0)
    toks = rng.integers(100, llm.n_vocab() - 100, a.p + a.n).tolist()
    pp, tg = [], []
    for rep in range(a.r + 1):                        # the first repetition warms up
        llm.reset()
        llm._ctx.kv_cache_clear() if hasattr(llm._ctx, "kv_cache_clear") else None
        t0 = time.perf_counter()
        llm.eval(toks[:a.p])
        t1 = time.perf_counter()
        for t in toks[a.p:a.p + a.n]:
            llm.eval([t])
        t2 = time.perf_counter()
        if rep:
            pp.append(a.p / (t1 - t0))
            tg.append(a.n / (t2 - t1))
    for name, xs, n in (("pp", pp, a.p), ("tg", tg, a.n)):
        sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
        print(f"llama.cpp {a.model.split('/')[-1]} threads {a.threads} {name}{n}: "
              f"{statistics.mean(xs):.2f} +- {sd:.2f} tok/s")


if __name__ == "__main__":
    main()
