"""The GPU's speed and memory figures in one run: dense and HCA decode of SmolLM2's shape at 8K, 128K
and 1M of context with every decode variant (where the selected values are summed, CUDA graphs,
the selection cap), prefill throughput at 1M, and Llama-3-8B's shape at 1M. Random weights: speed
and memory do not depend on their values (what HCA selects does: random weights attend diffusely).

    python scripts/bench_gpu.py run OUT [--device cuda] [--scale full|tiny] [--budget S] [--steps a,b]
    python scripts/bench_gpu.py summary OUT

`run` gives each step (STEPS) a process of its own under its own time limit, so a hang or a crash
costs that step only, and stops starting steps when --budget seconds are spent. Each step writes
OUT/<step>.log and OUT/<step>.json (minirun.tools.bench rows, rewritten after every row: a step cut short
keeps what it measured); `run` ends with OUT/summary.md, also printed. scripts/bench_gpu.sh runs it
after the environment and the GPU tests. `--scale tiny --device cpu --emulate` is the rehearsal:
the same steps on a tiny model, the GPU cache on the CUDA kernel emulator (tests/tools/test_bench_gpu.py).
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minirun.tools import bench as mb  # noqa: E402
from minirun.tools.bench_output import to_markdown_compact  # noqa: E402
from minirun.config import EngineConfig, ModelArgs, hca_setting  # noqa: E402
from minirun.engine import Engine  # noqa: E402
from minirun.tools.evaluate import selection_probe  # noqa: E402
from minirun.planner import plan_report  # noqa: E402
from minirun.checkpoint.random_checkpoint import write_random_checkpoint  # noqa: E402
from gpu_profiles import prefill_profile, profile_steps, sync  # noqa: E402  (scripts/, beside this file)

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
               rms_norm_eps=1e-5, max_position_embeddings=8192)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                 rms_norm_eps=1e-5, max_position_embeddings=8192,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
TINY = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True, rope_theta=10000.0,
            rms_norm_eps=1e-5, max_position_embeddings=512)
TINY_BIG = dict(TINY, num_hidden_layers=3, hidden_size=384, num_attention_heads=6, num_key_value_heads=2)

# depths, tokens per timed rep (each rep also stops after rep_s seconds, after 2 tokens at least),
# timed reps, the selection cap, the HCA settings (value_sum gpu: a mapped pool, so that one prefill
# serves both value sums). tiny, the CPU rehearsal on the kernel emulator: small exact tiers, codebooks
# fitted early, an anchor prefill past 512 tokens (its last `window` tokens take one-token HCA steps,
# a dozen emulated launches per layer each: hence a ring of 16), a trained context of 512 so that far
# positions are on as at 1M, a cap below what tau selects
SCALES = {
    "full": dict(small=SMOLLM2, big=LLAMA3_8B, short=8192, long=131072, deep=1 << 20, n=32, reps=2, rep_s=3.0,
                 cap=2048, dtype="bfloat16", hca=dict(value_sum="gpu"), prof_span=32768),
    "tiny": dict(small=TINY, big=TINY_BIG, short=256, long=1024, deep=1024, n=4, reps=1, rep_s=5.0,
                 cap=32, dtype="bfloat16", hca=dict(value_sum="gpu", window=16, sinks=4, fit_min_tokens=128, anchor_tokens=128,
                                                     exact_prefill_max=512, prefill_chunk=256), prof_span=768),
}
# (name, time limit in s at full scale): in the order they run, the most wanted first
STEPS = [("dense", 70), ("quant", 90), ("deep-g64c16", 240), ("hca-g64c16", 100), ("hca-0.125", 100), ("llama8b", 440),
         ("deep-0.125", 200)]
WARM = 3          # untimed steps first: graphs are captured and kernels compiled there


def log(*a):
    print(*a, flush=True)


# ---- measuring -------------------------------------------------------------------------------------
def decode_samples(eng, ids: list[int], n: int, reps: int, rep_s: float) -> list[float]:
    """tokens/s of `reps` runs of up to n greedy steps after the context `ids` (each run stopped after
    rep_s seconds once 2 tokens are done), after one untimed run of WARM steps; the cache is rewound
    to the context after each run, so the context is prefilled once (one token recomputed per run)."""
    samples = []
    for r in range(reps + 1):
        logits, _ = eng.prefill(ids)
        tok = int(logits[-1].argmax())
        sync(eng)
        t0, k, want = time.perf_counter(), 0, n if r else WARM
        while k < want:
            tok = int(eng.step(tok)[-1].argmax())       # (the int waits for the device)
            k += 1
            if r and k >= 2 and time.perf_counter() - t0 > rep_s:
                break
        sync(eng)
        if r:
            samples.append(k / (time.perf_counter() - t0))
        eng.rewind(len(ids))
    return samples


class Rows:
    """The step's BenchResult rows, rewritten to OUT/<step>.json after each one."""

    def __init__(self, path: Path):
        self.path, self.rows = path, []

    def add(self, row):
        self.rows.append(asdict(row))
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.rows, indent=1))
        tmp.replace(self.path)
        log(f"row: {row.test} {row.weights} {row.kv} {row.kv_budget or ''} value_sum={row.value_sum} graphs={row.cuda_graphs} "
            f"cap={row.max_select}: {row.tps_mean:.2f} tok/s" + (f", selected {100 * row.selected:.2f}%"
                                                               if row.selected is not None else ""))


def configure(eng, value_sum: str | None, graphs: bool, cap: int | None) -> bool:
    """Set a decode variant on a filled engine; False where this cache has no such variant."""
    cache = eng.cache
    if value_sum is not None:
        if not hasattr(cache, "set_value_sum"):
            return value_sum == "host"   # (the CPU cache sums on the host: its only variant)
        if value_sum == "gpu" and not cache.values.mapped:
            return False
        cache.set_value_sum(value_sum)
    if hasattr(cache, "max_select"):
        cache.max_select = cap
    eng.set_cuda_graphs(graphs)
    return True


def selected(eng, ids) -> float | None:
    """The share of the store the selection keeps in one step after `ids` (tau alone, no cap)."""
    cap = getattr(eng.cache, "max_select", None)
    eng.cache.max_select = None
    eng.prefill(ids)
    with selection_probe(eng) as sel:
        eng.step(0)
    eng.rewind(len(ids))
    eng.cache.max_select = cap
    return float(sel["fraction"].mean()) if "fraction" in sel else None


def tg_variants(eng, rows, model, kv, budget, ids, sc, variants, name_depth, prof=False):
    """One row per variant (value_sum, graphs, cap) of `tg n @ d` on the context ids (prefilled once)."""
    share = selected(eng, ids) if kv == "hca" else None
    for i, (vs, graphs, cap) in enumerate(variants):
        if not configure(eng, vs, graphs, cap):
            log(f"variant value_sum={vs} graphs={graphs} cap={cap}: not available here, skipped")
            continue
        if eng.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(eng.device)
        samples = decode_samples(eng, ids, sc["n"], sc["reps"], sc["rep_s"])
        rows.add(mb.result(eng, model, kv, budget, f"tg{sc['n']} @ d{name_depth}", "tg", sc["n"], name_depth,
                           "random", samples, selected=share, kv_stats=eng.kv_stats()))
        if prof and i == 0:
            with contextlib.suppress(Exception):
                log(profile_steps(eng, ids))


def prefill_row(eng, rows, model, kv, budget, ids):
    """pp N from an empty cache, with its progress in the log; one row (its mode in the log)."""
    eng.reset()
    mb._forget_fitted_codebooks(eng)
    t0, shown = time.perf_counter(), [0.0]

    def progress(done, total):
        t = time.perf_counter() - t0
        if t - shown[0] >= 10 or done == total:
            shown[0] = t
            log(f"prefill: {done}/{total} tokens in {t:.1f} s ({done / max(t, 1e-9):.0f} tok/s); {memory(eng)}")
    sync(eng)
    t0 = time.perf_counter()
    eng.prefill(ids, progress=progress)
    sync(eng)
    dt = time.perf_counter() - t0
    log(f"prefill mode {eng.last_prefill['mode']}: {len(ids)} tokens in {dt:.1f} s")
    rows.add(mb.result(eng, model, kv, budget, f"pp{len(ids)}", "pp", len(ids), 0, "random", [len(ids) / dt],
                       kv_stats=eng.kv_stats()))


def memory(eng) -> str:
    """The process's resident host memory and the device's allocated bytes now (a slow or stalled
    prefill's log says which grew)."""
    rss = next((int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith("VmRSS")), 0)
    dev = torch.cuda.memory_allocated(eng.device) if eng.device.type == "cuda" else 0
    return f"host RSS {rss / 2**30:.1f} GiB, device {dev / 2**30:.1f} GiB"


# ---- the steps -----------------------------------------------------------------------------------
def model_dir(work: Path, name: str, config: dict, dtype: str, weights: bool = True) -> Path:
    d = work / name
    if not (d / "config.json").is_file():
        write_random_checkpoint(config, d, dtype=dtype, weights=weights)
    return d


def ids_for(eng, n):
    return mb.random_ids(n, eng.args.vocab_size, seed=0)


HCA_VARIANTS = [("gpu", True, None), ("gpu", False, None), ("host", False, None)]


def step_dense(a, sc, rows):
    d = model_dir(a.work, "random-smollm2", sc["small"], sc["dtype"])
    eng = Engine.load(d, device=a.device, dtype=sc["dtype"], ctx=sc["long"] + sc["n"] + 64, kv="dense")
    for depth in (sc["short"], sc["long"]):
        eng.reset()
        ids = ids_for(eng, depth)
        tg_variants(eng, rows, d, "dense", None, ids, sc, [(None, True, None), (None, False, None)], depth,
                    prof=depth == sc["short"])


def step_quant(a, sc, rows):
    """Dense decode at the short depth with the weights as GGUF blocks (kernels_cuda/quant.cu's GEMV)
    against the float weights, graphs on."""
    d = model_dir(a.work, "random-smollm2", sc["small"], sc["dtype"])
    for weights in ("float", "q8_0", "q4_1"):
        eng = Engine.load(d, device=a.device, dtype=sc["dtype"], ctx=sc["short"] + sc["n"] + 64, kv="dense",
                          weights=weights)
        tg_variants(eng, rows, d, "dense", None, ids_for(eng, sc["short"]), sc, [(None, True, None)], sc["short"],
                    prof=weights == "q4_1")
        del eng


def step_hca(a, sc, rows, budget):
    d = model_dir(a.work, "random-smollm2", sc["small"], sc["dtype"])
    eng = Engine.load(d, device=a.device, dtype=sc["dtype"], ctx=sc["long"] + sc["n"] + 64, kv="hca",
                      **hca_setting(budget), **sc["hca"])
    for depth in (sc["short"], sc["long"]):
        eng.reset()
        mb._forget_fitted_codebooks(eng)
        ids = ids_for(eng, depth)
        t0 = time.perf_counter()
        eng.prefill(ids)
        log(f"prefill {depth} ({eng.last_prefill['mode']}): {time.perf_counter() - t0:.1f} s")
        tg_variants(eng, rows, d, "hca", budget, ids, sc, HCA_VARIANTS, depth, prof=depth == sc["long"])


def step_deep(a, sc, rows, budget, big=False):
    """1M of context: the prefill timed (anchor mode), then the variants, capped first."""
    cfg = sc["big"] if big else sc["small"]
    name = "random-llama3-8b" if big else "random-smollm2"
    d = model_dir(a.work, name, cfg, sc["dtype"], weights=not big)
    ctx = sc["deep"] + sc["n"] + 64
    kw = dict(device=a.device, dtype=sc["dtype"], ctx=ctx, kv="hca", **hca_setting(budget), **sc["hca"])
    if big:   # the plan before anything is allocated
        args = ModelArgs.from_path(d)
        cfg_e = EngineConfig(**{k: v for k, v in kw.items() if k != "device"}, device=a.device)
        report = plan_report(args, cfg_e, "cuda" if a.device.startswith("cuda") else "cpu")
        (a.out / "llama8b-plan.json").write_text(json.dumps(report, indent=1))
        log("plan: " + ", ".join(f"{t['tier']} {t['bytes'] / 2**30:.2f} GiB ({t['where']})" for t in report["tiers"]))
    t0 = time.perf_counter()
    eng = Engine.with_random_weights(d, **kw) if big else Engine.load(d, **kw)
    log(f"engine loaded in {time.perf_counter() - t0:.1f} s")
    ids = ids_for(eng, sc["deep"])
    if not big:   # (8B's shape: its profile, 32K tokens twice, took 2 of the step's 7 minutes)
        with contextlib.suppress(Exception):   # (a diagnosis: never the reason a step fails)
            log(prefill_profile(eng, ids[:sc["prof_span"]]))
    prefill_row(eng, rows, d, "hca", budget, ids)
    log("kv_stats: " + json.dumps(eng.kv_stats()))
    cap = sc["cap"]
    variants = [("gpu", True, cap), ("host", False, cap), ("gpu", True, None), ("host", False, None)]
    tg_variants(eng, rows, d, "hca", budget, ids, sc, variants[:3] if big else variants, sc["deep"], prof=True)


STEP_RUN = {
    "dense": step_dense,
    "quant": step_quant,
    "hca-g64c16": lambda a, sc, rows: step_hca(a, sc, rows, "g64c16"),
    "hca-0.125": lambda a, sc, rows: step_hca(a, sc, rows, "0.125"),
    "deep-g64c16": lambda a, sc, rows: step_deep(a, sc, rows, "g64c16"),
    "deep-0.125": lambda a, sc, rows: step_deep(a, sc, rows, "0.125"),
    "llama8b": lambda a, sc, rows: step_deep(a, sc, rows, "g64c16", big=True),
}


def run_step(a):
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # the runner asks for the stacks before a cut
    sc = SCALES[a.scale]
    rows = Rows(a.out / f"{a.step}.json")
    ctx = contextlib.nullcontext()
    if a.emulate:
        sys.path.insert(0, str(REPO / "tests" / "support"))   # the CPU kernel emulator lives with the tests
        from cuda_emu import emulated_hca_cuda
        ctx = emulated_hca_cuda()
    with ctx, torch.inference_mode():
        STEP_RUN[a.step](a, sc, rows)


# ---- the runner and the summary ----------------------------------------------------------------------
def run_all(a):
    a.out.mkdir(parents=True, exist_ok=True)
    names = [s for s in a.steps.split(",") if s] if a.steps else [s for s, _ in STEPS]
    unknown = [s for s in names if s not in STEP_RUN]
    if unknown:
        raise SystemExit(f"bench_gpu: unknown steps {unknown}: use {', '.join(s for s, _ in STEPS)}")
    deadline = time.time() + a.budget
    status = {}
    for name in names:
        limit = dict(STEPS)[name] * (1 if a.scale == "full" else 3)
        left = deadline - time.time()
        if left < 20:
            status[name] = "skipped (budget spent)"
            continue
        limit = int(min(limit, left))
        cmd = [sys.executable, __file__, "step", str(a.out), "--step", name, "--device", a.device, "--scale", a.scale,
               "--work", str(a.work)] + (["--emulate"] if a.emulate else [])
        log(f"== {name} (limit {limit} s)")
        t0 = time.time()
        with open(a.out / f"{name}.log", "w") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
            try:
                rc = p.wait(timeout=limit)
                status[name] = "ok" if rc == 0 else f"failed (exit {rc}, see {name}.log)"
            except subprocess.TimeoutExpired:   # where it was, into its log, then the cut
                p.send_signal(signal.SIGUSR1)
                time.sleep(2)
                p.kill()
                p.wait()
                status[name] = f"cut at its {limit} s limit (its stacks at the end of {name}.log)"
        status[name] += f", {time.time() - t0:.0f} s"
        log(f"   {status[name]}")
    (a.out / "steps.json").write_text(json.dumps(status, indent=1))
    print(summary(a.out))


def summary(out: Path) -> str:
    """OUT/summary.md: every row of the steps' JSON, the steps' status, and the targets."""
    status = json.loads((out / "steps.json").read_text()) if (out / "steps.json").is_file() else {}
    rows = []
    for name, _ in STEPS:
        p = out / f"{name}.json"
        if p.is_file():
            rows += [dict(r, step=name) for r in json.loads(p.read_text())]
    table = to_markdown_compact(rows).splitlines()
    lines = [table[0].replace("| model |", "| step | model |"), "|---" + table[1]]
    lines += [f"| {r['step']} " + line for r, line in zip(rows, table[2:])]
    dev_names = sorted({r.get("device_name", "") for r in rows} - {""})
    text = "\n".join([f"# bench_gpu: {', '.join(dev_names) or 'no rows'}", "", *lines, "",
                      "steps: " + "; ".join(f"{k} {v}" for k, v in status.items()), "", targets(rows)])
    (out / "summary.md").write_text(text + "\n")
    return text


def targets(rows) -> str:
    """The targets (one H100, bfloat16) against the best variant measured."""
    def best(pred):
        xs = [r["tps_mean"] for r in rows if r["n_gen"] and pred(r)]
        return max(xs) if xs else None
    def depth(steps, pick):   # a step's shallowest / deepest decode depth (steps: name prefixes)
        ds = [r["depth"] for r in rows if r["n_gen"] and r["step"].startswith(steps)]
        return pick(ds) if ds else None
    short, long_, deep = depth(("dense",), min), depth(("dense", "hca-"), max), depth(("deep-",), max)
    dense_s = best(lambda r: r["step"] == "dense" and r["depth"] == short and not r.get("weights", "").startswith("Q"))
    dense_l = best(lambda r: r["step"] == "dense" and r["depth"] == long_)
    hca_l = best(lambda r: r["step"].startswith("hca-") and r["depth"] == long_)
    hca_d = best(lambda r: r["step"].startswith("deep-") and r["depth"] == deep)
    big = best(lambda r: "llama3" in r["model"])

    def fmt(x):
        return "not measured" if x is None else f"{x:.1f}"
    short, long_, deep = (f"d{d}" if d else "(not run)" for d in (short, long_, deep))
    ratio = f"{hca_l / dense_l:.2f}x" if hca_l and dense_l else "not measured"
    return "\n".join(["targets (best variant):",
                      f"- dense decode @ {short}: {fmt(dense_s)} tok/s (target >= 800)",
                      f"- HCA decode @ {long_}: {ratio} dense (target >= 2x)",
                      f"- HCA decode @ {deep}: {fmt(hca_d)} tok/s (target >= 100)",
                      f"- Llama-3-8B shape, HCA g64c16 @ 1M: {fmt(big)} tok/s (target >= 20)"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["run", "step", "summary"])
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", choices=list(SCALES), default="full")
    ap.add_argument("--budget", type=float, default=420, help="run: seconds for all steps together")
    ap.add_argument("--steps", default="", help="run: comma-separated steps (default: all, in order)")
    ap.add_argument("--step", help="step: the one to run")
    ap.add_argument("--work", type=Path, default=None, help="where the random checkpoints go (default: OUT/work)")
    ap.add_argument("--emulate", action="store_true", help="the GPU cache on the kernel emulator (CPU rehearsal)")
    a = ap.parse_args()
    a.work = a.work or a.out / "work"
    if a.what == "run":
        run_all(a)
    elif a.what == "step":
        run_step(a)
    else:
        print(summary(a.out))


if __name__ == "__main__":
    main()
