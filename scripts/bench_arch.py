"""CPU decode speed of an architecture against a Llama of the same shape: random weights written
once (bfloat16 files, quantized at load by --weights), then `minirun bench` on each in alternating
rounds, each run a fresh process, so drift of the machine falls on both.

Usage:
  python scripts/bench_arch.py --shape qwen3-0.6b --weights q8_0 --rounds 4 [--dir DIR] [--json OUT]
  python scripts/bench_arch.py --shape gemma3-270m --memory 128K [--json OUT]

--memory CTX: the KV cache's bytes at a context of CTX instead: the architecture with --kv dense
and --kv hca g64c16 (a sliding layer keeps a ring of its window beside them: kv/layer_kinds.py)
against the Llama twin with --kv dense (every layer the whole context). The figure compared is
what `minirun plan` declares at CTX (prefill-only buffers included), the tiers each cache
allocates; beside it what the cache holds after `minirun bench` prefilled 2K tokens and decoded 8
(dense caches allocate their whole context at load, HCA's value pool grows).

The twin is the same config.json with model_type llama: the same matrices, without the
architecture's extras (Qwen2's Q/K/V biases, the heads' norms; Gemma 3's norms after attention and
MLP, GeGLU, scales, sliding windows and second RoPE base). Reports each side's mean
tokens/s over the rounds after the first (a warm-up: Numba's cache, the page cache) and the
ratio architecture / Llama.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = {   # the published config.json of each model's shape (the parts minirun reads)
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       max_position_embeddings=40960),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         max_position_embeddings=32768),
    "gemma3-270m": dict(model_type="gemma3_text", hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                        tie_word_embeddings=True, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                        rms_norm_eps=1e-6, max_position_embeddings=32768, sliding_window=512,
                        sliding_window_pattern=6, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh"),
}
# what only the architecture reads: left out of the Llama twin's config.json
ARCH_ONLY = ("rope_local_base_freq", "sliding_window", "sliding_window_pattern", "query_pre_attn_scalar",
             "hidden_activation")


def checkpoint(root: Path, name: str, config: dict) -> Path:
    """The random checkpoint of `config` under root/name, written once."""
    out = root / name
    if not (out / "model.safetensors").is_file():
        sys.path.insert(0, str(REPO))
        from minirun.checkpoint.random_checkpoint import write_random_checkpoint
        write_random_checkpoint(config, out, dtype="bfloat16")
    return out


def bench(model: Path, bench_args: list[str]) -> float:
    """One `minirun bench ... -o json` in a fresh process -> the tg row's tokens/s."""
    return bench_rows(model, bench_args)[0]["tps_mean"]


def bench_rows(model: Path, bench_args: list[str]) -> list[dict]:
    """`minirun bench ... -o json` in a fresh process -> its rows."""
    cmd = [sys.executable, "-m", "minirun", "bench", str(model), *bench_args, "-o", "json"]
    p = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"bench_arch: {model.name}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}")
    return json.loads(p.stdout)


def planned(model: Path, ctx: str, kv: str, weights: str) -> int:
    """`minirun plan`'s bytes of every cache tier at ctx (prefill-only ones included), weights left out."""
    cmd = [sys.executable, "-m", "minirun", "plan", str(model), "--ctx", ctx, "--kv", kv, "--weights", weights,
           "-o", "json"] + (["--kv-budget", "g64c16"] if kv == "hca" else [])
    p = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                       check=True)
    return sum(t["bytes"] for t in json.loads(p.stdout)["tiers"] if t["tier"] != "weights")


def memory(models: dict, shape: str, ctx: str, a) -> dict:
    """The cache's bytes at ctx: the architecture's dense and HCA caches against the twin's dense one."""
    base = ["-p", "", "-n", "8", "-d", "2048", "--ctx", ctx, "--threads", str(a.threads), "-r", "1",
            "--weights", a.weights]
    rows = bench_rows(models[shape], base + ["--kv", "dense,hca", "--kv-budget", "g64c16"])
    rows += bench_rows(models["llama"], base + ["--kv", "dense"])
    out = [{"model": name, "kv": r["kv"], "held_bytes": r["kv_stats"]["total_bytes"],
            "planned_bytes": planned(models[name], ctx, r["kv"], a.weights), "peak_rss_bytes": r.get("peak_host_bytes")}
           for name, r in zip([shape, shape, "llama"], rows)]
    all_dense = out[-1]["planned_bytes"]
    for r in out:
        r["of_all_dense"] = r["planned_bytes"] / all_dense
        print(f"{r['model']} {r['kv']}: {r['planned_bytes'] / 2**20:.1f} MiB planned at {ctx} "
              f"({100 * r['of_all_dense']:.1f}% of all-dense), {r['held_bytes'] / 2**20:.1f} MiB held at 2K",
              file=sys.stderr)
    return {"shape": shape, "ctx": ctx, "weights": a.weights, "rows": out,
            "command": "python scripts/bench_arch.py " + " ".join(sys.argv[1:])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--weights", default="q8_0")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where the random checkpoints go (default: ~/.cache/minirun/bench-arch)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--memory", default=None, metavar="CTX", help="the KV cache's bytes at this context instead")
    a = ap.parse_args()
    root = Path(a.dir or Path.home() / ".cache" / "minirun" / "bench-arch")
    shape = SHAPES[a.shape]
    twin = {k: v for k, v in shape.items() if k not in ARCH_ONLY} | {"model_type": "llama"}
    models = {a.shape: checkpoint(root, a.shape, shape), "llama": checkpoint(root, a.shape + "-llama", twin)}
    if a.memory:
        report = memory(models, a.shape, a.memory, a)
        if a.json:
            Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
        return 0
    args = ["-p", "", "-n", str(a.n), "-d", "0", "--kv", "dense", "--threads", str(a.threads), "-r", "3",
            "--weights", a.weights]
    runs = {k: [] for k in models}
    for r in range(a.rounds):
        for name, path in models.items():
            runs[name].append(bench(path, args))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} tok/s" for k, v in runs.items()), file=sys.stderr)
    mean = {k: statistics.mean(v[1:] if len(v) > 1 else v) for k, v in runs.items()}
    report = {"shape": a.shape, "weights": a.weights, "test": f"tg{a.n}", "threads": a.threads, "rounds": runs,
              "mean_ts": mean, "ratio": mean[a.shape] / mean["llama"],
              "command": "python scripts/bench_arch.py " + " ".join(sys.argv[1:])}
    print(f"{a.shape} {mean[a.shape]:.2f} tok/s, llama twin {mean['llama']:.2f} tok/s: {report['ratio']:.3f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
