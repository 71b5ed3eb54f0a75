"""Launches per decode token on a GPU, counted without one.

A decode token of a small model on a GPU costs about as much per launch as per byte, so this
counts them: a model of SmolLM2's shape (random weights; 2 and 4 layers,
the difference gives the per-layer count) runs its GPU code path on the CPU, kernels_cuda on the
emulator, and one decode step is recorded at the torch dispatch level. Counted: torch ops that
launch device work (views, reshapes and allocations are not) and kernels_cuda launches. Dense and
HCA (g16 c256 codes, tau 0.9), each with the layer kernels (kernels_cuda.layer,
the default on a GPU) and without; and the step a CUDA graph captures (run eagerly: its kernels, and
the launches left per token).

Usage: python scripts/count_launches.py [--depth 400]
"""
import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))   # the CPU kernel emulator lives with the tests
import cuda_emu  # noqa: E402
from kernels_cuda import launch as klaunch  # noqa: E402
from kernels_cuda.dense_decode import DenseDecodeAttention  # noqa: E402
from minirun import Engine  # noqa: E402
from minirun.model.cuda_graph import GraphedDecode  # noqa: E402
from minirun.checkpoint.random_checkpoint import write_random_checkpoint  # noqa: E402

# aten ops that launch nothing on a GPU
NO_LAUNCH = {"view", "slice", "select", "unsqueeze", "t", "transpose", "alias", "detach", "detach_", "_unsafe_view", "expand",
             "as_strided", "empty", "empty_like", "resolve_conj", "resolve_neg", "lift_fresh", "split", "chunk",
             "reshape", "squeeze", "unbind", "_reshape_alias"}
HCA = dict(key_store="codebook", tau=0.9, window=64, sinks=4, prefill_mode="exact", fit_min_tokens=64, groups=16,
           centroids=256, value_sum="gpu")
SMOLLM2_HEADS = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=512,
                     max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


class Record(TorchDispatchMode):
    """The aten ops dispatched, except inside an emulated launch (the emulator's own copies)."""

    def __init__(self):
        super().__init__()
        self.ops = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        noop = name == "to" and isinstance(out, torch.Tensor) and out.data_ptr() == args[0].data_ptr() and \
            out.dtype == args[0].dtype    # (e.g. inside .numpy(): nothing runs)
        if not self.paused and not noop:
            self.ops.append(name)
        return out

    def around(self, launch):
        def run(*a, **kw):
            self.paused = True
            try:
                return launch(*a, **kw)
            finally:
                self.paused = False
        return run


def count_step(model, kv, layer_kernels, depth, graphs=False) -> tuple[int, int]:
    """(torch ops that launch, kernels_cuda launches) of one decode step after `depth` tokens;
    graphs: of the step a CUDA graph captures (minirun/model/cuda_graph.py, run eagerly), and also the
    torch ops outside it (the copies before a replay) -> (torch, kernels_cuda, outside)."""
    with cuda_emu.emulated_hca_cuda():   # (a dense engine stays dense)
        # (HCA in float32: on the CPU a bfloat16 model's exact tier is float16, which a GPU's is not,
        # and the GPU's step leaves RoPE to decode_prep only where the tier has the model's dtype)
        dtype = "bfloat16" if kv == "dense" else "float32"
        eng = Engine.load(model, device="cpu", dtype=dtype, ctx=max(2048, 2 * depth), kv=kv, **(HCA if kv == "hca" else {}))
        eng.model.use_torch_ops()                    # (not the CPU's numpy token)
        if kv == "dense":
            eng.cache._k_np = None                   # (the CPU's numpy step)
        if layer_kernels:
            eng.model.use_cuda_layer_kernels(force=True)
            if kv == "dense":                        # (its GPU attention, as on a GPU: SDPA otherwise)
                a = eng.args
                eng.cache._gpu_attn = DenseDecodeAttention(eng.device, a.num_attention_heads, a.num_key_value_heads,
                                                           a.head_dim, eng.cache.capacity, eng.model.dtype)
        eng.prefill(list(range(5, 5 + depth)))
        step = eng.step
        if graphs:
            gd = GraphedDecode(eng.model, eng.cache, capture=False)
            step = gd.step
        step(7)                                      # first-step allocations
        be = klaunch._backend()
        be.launches.clear()
        rec = Record()
        be.launch = rec.around(be.launch)
        if graphs:   # what the graph holds: the ops inside decode_at
            inside = []
            run = gd._run

            def marked(nk):
                n0 = len(rec.ops)
                try:
                    return run(nk)
                finally:
                    inside.extend(range(n0, len(rec.ops)))
            gd._run = marked
            eng.cache.graph_advance = rec.around(eng.cache.graph_advance)   # (host bookkeeping: CPU tensors)
        with rec, torch.inference_mode():
            step(8)
        if graphs:
            assert gd.eager_steps == 0, "the step was not capturable"
            ins = set(inside)
            t_in = sum(o not in NO_LAUNCH for i, o in enumerate(rec.ops) if i in ins)
            t_out = sum(o not in NO_LAUNCH for i, o in enumerate(rec.ops) if i not in ins)
            return t_in, len(be.launches), t_out
        return sum(o not in NO_LAUNCH for o in rec.ops), len(be.launches)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=400)
    ap.add_argument("--layers", type=int, default=30, help="layers of the model the per-token figure is for")
    a = ap.parse_args(argv)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = {n: write_random_checkpoint(SMOLLM2_HEADS | dict(num_hidden_layers=n), Path(tmp) / f"m{n}", seed=0)
                  for n in (2, 4)}
        for kv in ("dense", "hca"):
            for lk in (False, True):
                (t2, k2), (t4, k4) = (count_step(models[n], kv, lk, a.depth) for n in (2, 4))
                per_t, per_k = (t4 - t2) / 2, (k4 - k2) / 2
                once = t2 - 2 * per_t + k2 - 2 * per_k
                r = {"torch_per_layer": per_t, "kernels_cuda_per_layer": per_k, "per_token_once": once,
                     "per_token": a.layers * (per_t + per_k) + once}
                out[f"{kv}, layer kernels {'on' if lk else 'off'}"] = r
        # CUDA graphs (layer kernels on; HCA with the GPU value sum): the graph's kernels, and the
        # launches per token: one replay, the copies before it, the logits' clone after it
        for kv in ("dense", "hca"):
            (t2, k2, o2), (t4, k4, o4) = (count_step(models[n], kv, True, a.depth, graphs=True) for n in (2, 4))
            per_t, per_k = (t4 - t2) / 2, (k4 - k2) / 2
            once = t2 - 2 * per_t + k2 - 2 * per_k
            out[f"{kv}, cuda graphs"] = {"torch_per_layer": per_t, "kernels_cuda_per_layer": per_k,
                                           "per_token_once": once, "graph_nodes": a.layers * (per_t + per_k) + once,
                                           "per_token": 1 + o2 + 1}
    print(f"| decode step | torch ops / layer | kernels_cuda / layer | once per token | launches per token ({a.layers} layers) |")
    print("|---|---|---|---|---|")
    for name, r in out.items():
        total = f"{r['per_token']:.0f}"
        if "graph_nodes" in r:
            total += f" (a graph of {r['graph_nodes']:.0f} kernels, the copies and the logits' clone)"
        print(f"| {name} | {r['torch_per_layer']:.0f} | {r['kernels_cuda_per_layer']:.0f} | {r['per_token_once']:.0f} | "
              f"{total} |")
    return out


if __name__ == "__main__":
    main()
