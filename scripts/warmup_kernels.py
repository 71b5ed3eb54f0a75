"""Compile the CPU kernels once, so that the first chat answer runs at full speed.

Usage: python scripts/warmup_kernels.py      (`make setup` runs it)

Numba compiles a kernel on its first call and caches the machine code on disk (cache=True), keyed
by the kernel's source and argument types; without this, a newcomer's first answer pays ~8 s of
compilation and reports ~1 tok/s. This runs what a chat runs -- a prompt, decode steps, a second
turn that extends the cached prompt -- for dense and HCA (exact keys, and codebook keys with
int16 indices as the presets use, 4-bit codes, and rescore), dense with quantized weights (Q4_1
as the default model ships, Q8_0), in float32 and bfloat16, on a tiny random checkpoint: the
kernels see the argument types a real model gives them, so the cache entries serve it. The
settings are spread over the machine's cores, one process each (Numba compiles on one core).
"""
import contextlib
import io
import multiprocessing
import os
import sys
import tempfile
import time

from minirun import Engine
from minirun.checkpoint.random_checkpoint import write_random_checkpoint

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=False,
            model_type="llama")
MODES = [dict(kv="dense"), dict(kv="hca", kv_budget=0.5),
         # c = 1024 centroids (int16 indices, as the presets), fitted from the prompt's own keys
         dict(kv="hca", kv_budget=0.125, window=32, sinks=4, fit_min_tokens=1200),
         # 4-bit codes, one codebook per dimension (--kv-budget g64c16 on SmolLM2; kernels_cpu.fastscan)
         dict(kv="hca", groups=32, centroids=16, window=32, sinks=4, fit_min_tokens=1200),
         # rescore: the select-then-sum path, the selected tokens rescored from host keys
         dict(kv="hca", kv_budget=0.125, window=32, sinks=4, fit_min_tokens=1200, rescore=True),
         # quantized weights (minirun.quant): Q4_1 layers and a Q8_0 embedding, as the pulled SmolLM2
         # ships them, and Q8_0 throughout
         dict(kv="dense", weights="q4_1"), dict(kv="dense", weights="q8_0")]


def warm(job) -> None:
    """One (checkpoint, dtype, mode): load, a prompt, decode steps, a second turn."""
    path, dtype, mode = job
    with contextlib.redirect_stderr(io.StringIO()):   # the "no codebooks file" note
        eng = Engine.load(path, device="cpu", dtype=dtype, ctx=2048, **mode)
    prompt = [(7 * i) % 500 + 4 for i in range(1400)]
    r = eng.generate(prompt, max_new_tokens=4, ignore_eos=True)
    eng.generate(prompt + r.tokens + [5, 6, 7], max_new_tokens=4, ignore_eos=True)   # second turn


def main() -> None:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(TINY, tmp, seed=0)
        jobs = [(path, dtype, mode) for mode in MODES for dtype in ("float32", "bfloat16")]
        procs = max(1, min(len(jobs), len(os.sched_getaffinity(0))))
        # spawn: each process its own Numba and torch; the on-disk cache is what they share
        with multiprocessing.get_context("spawn").Pool(procs) as pool:
            pool.map(warm, jobs, chunksize=1)
    print(f"warmup_kernels: CPU kernels compiled and cached in {time.perf_counter() - t0:.0f}s "
          f"({procs} processes)", file=sys.stderr)


if __name__ == "__main__":
    main()
