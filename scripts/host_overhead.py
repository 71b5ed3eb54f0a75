"""Host time of one GPU HCA decode step of one layer, its kernels not run: what Python, torch
dispatch and the host value sum cost per layer and token, measured on any machine (no GPU).

On an H100 the HCA decode of SmolLM2 was bound by this host work (docs/BENCHMARKS.md, twelfth
session), so it can be compared between code versions here, before a GPU is lent. How: a cache of
SmolLM2's head shape (9 heads, 3 kv-heads, head dim 64; 2 layers of random weights) runs on the CPU
with kernels_cuda on the emulator for its prompt and one real decode step (real buffers, a real
copy-back), then kernels_cuda launches are replaced by a stub that only reads the arguments and the
same layer step (HCACacheCUDA.attend) is timed: the host value sum still sums the last real
selection. Not counted: the CUDA driver's own launch cost and waits for the GPU.

Usage: python scripts/host_overhead.py [--depth 600] [--far-positions off|on] [--steps 400] [--reps 5]
"""
import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernels_cuda.launch as klaunch  # noqa: E402
from kernels_cuda import _emu  # noqa: E402
from minirun import Engine  # noqa: E402
from minirun.random_checkpoint import write_random_checkpoint  # noqa: E402

SMOLLM2_HEADS = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=512,
                     max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


class StubLaunches:
    """A kernels_cuda backend whose launches only read their arguments (as a real launch does)."""
    name = "stub"

    def __init__(self):
        self.launches = 0

    def check_tensor(self, t, what):
        pass

    def device_info(self, device):
        return (132, 227 * 1024)      # an H100's SM count and shared memory

    def empty(self, shape, dtype, device):
        return torch.zeros(shape, dtype=dtype, device=device)

    @contextlib.contextmanager
    def session(self, device):
        yield self

    def launch(self, file, name, grid, block, args, shared_mem=0):
        self.launches += 1
        for a in args:
            if isinstance(a, torch.Tensor):
                a.data_ptr()

    def arg(self, a):
        return a


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=600, help="context tokens before the timed steps")
    ap.add_argument("--far-positions", default="off", choices=["off", "on"])
    ap.add_argument("--steps", type=int, default=400, help="layer steps per timed repetition")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    ids = torch.randint(4, 500, (a.depth,), generator=torch.Generator().manual_seed(7)).tolist()
    kw = dict(ctx=max(2048, 2 * a.depth), kv="hca", key_store="codebook", tau=0.9, window=64, sinks=4,
              prefill_mode="exact", fit_min_tokens=64, groups=16, centroids=256, far_positions=a.far_positions)
    g = torch.Generator().manual_seed(1)
    with tempfile.TemporaryDirectory() as tmp, _emu.emulated_hca_cuda():
        eng = Engine.load(write_random_checkpoint(SMOLLM2_HEADS, Path(tmp) / "m", seed=0), device="cpu", **kw)
        eng.prefill(ids)
        cache = eng.cache
        q, k, v = (torch.randn(1, h, cache.hd, generator=g) for h in (cache.Hq, cache.Hkv, cache.Hkv))
        with torch.inference_mode():
            cache.attend(0, q, k, v)             # allocates the step's buffers; a real copy-back
    stub = StubLaunches()
    prev = klaunch._set_backend(stub)
    try:
        with torch.inference_mode():
            for _ in range(20):
                cache.attend(0, q, k, v)
            stub.launches = 0
            us = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    cache.attend(0, q, k, v)
                us.append((time.perf_counter() - t0) / a.steps * 1e6)
    finally:
        klaunch._set_backend(prev)
    us.sort()
    r = {"us_per_layer_step_min": us[0], "us_per_layer_step_median": us[len(us) // 2],
         "launches_per_layer_step": stub.launches / (a.reps * a.steps), "store_tokens": cache.n_store}
    print(f"host time of one HCA decode layer step, kernels stubbed (depth {a.depth}, far positions "
          f"{a.far_positions}): min {r['us_per_layer_step_min']:.1f} us, median {r['us_per_layer_step_median']:.1f} us; "
          f"{r['launches_per_layer_step']:.0f} kernels_cuda launches per layer step")
    return r


if __name__ == "__main__":
    main()
