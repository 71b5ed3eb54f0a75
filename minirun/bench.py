"""llama-bench-style measurements: `pp N` (prefill N tokens) and `tg N @ dD` (N decode steps after D).

Every test runs on random token ids (seeded), greedy, end-of-sequence ignored, for each KV mode;
repetitions give mean +- sample std. Timings come from the engine itself (`Engine.last_prefill`)
or from timing `Engine.step` calls; on CUDA the timed region ends with a stream sync.

JSON/CSV fields, one object/row per (mode, test):
  model, device, dtype, threads, kv, kv_budget, codebooks, test, n_prompt, n_gen, depth, reps,
  tps_mean, tps_std, samples, peak_host_bytes, peak_device_bytes, kv_stats (CSV: kv_<key>),
  date, version
"""
from __future__ import annotations

import csv
import io
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

import torch

from . import __version__
from .planner import format_bytes

FIELDS = ["model", "device", "dtype", "threads", "kv", "kv_budget", "codebooks", "test", "n_prompt", "n_gen",
          "depth", "reps", "tps_mean", "tps_std", "samples", "peak_host_bytes", "peak_device_bytes", "kv_stats",
          "date", "version"]


@dataclass
class BenchResult:
    model: str
    device: str
    dtype: str
    threads: int
    kv: str
    kv_budget: float | None
    codebooks: str
    test: str
    n_prompt: int
    n_gen: int
    depth: int
    reps: int
    tps_mean: float
    tps_std: float
    samples: list = field(default_factory=list)
    peak_host_bytes: int = 0
    peak_device_bytes: int = 0
    kv_stats: dict = field(default_factory=dict)
    date: str = ""
    version: str = __version__


def _reset_peak_host() -> None:
    try:   # Linux: "5" resets the peak resident set size (VmHWM) of this process
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_host() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _sync(eng) -> None:
    if eng.device.type == "cuda":
        torch.cuda.current_stream(eng.device).synchronize()


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(100, vocab // 4), vocab - 1, (n,), generator=g).tolist()


def measure_pp(eng, n: int, seed: int) -> float:
    """Prefill n fresh tokens; tokens/s."""
    eng.reset()
    ids = random_ids(n, eng.args.vocab_size, seed)
    _sync(eng)
    eng.prefill(ids)
    _sync(eng)
    return eng.last_prefill["tps"]


def measure_tg(eng, n: int, depth: int, seed: int) -> float:
    """Decode n tokens greedily after a context of `depth` tokens (prefill not timed); tokens/s."""
    ctx_ids = random_ids(max(depth, 1), eng.args.vocab_size, seed)
    logits, _ = eng.prefill(ctx_ids)   # reuses the cached context when the previous rep left it
    tok = int(logits[-1].argmax())
    _sync(eng)
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(eng.step(tok)[-1].argmax())
    _sync(eng)
    dt = time.perf_counter() - t0
    eng.rewind(len(ctx_ids))          # drop the generated tokens; the next rep reuses the context
    return n / dt


def run_bench(model, modes: list[tuple[str, float | None]], pp: list[int], tg: int, depths: list[int],
              reps: int, dtype: str = "float32", device: str = "auto", ctx: int | None = None,
              threads: int | None = None, log=print, **engine_kw) -> list[BenchResult]:
    """modes: [("dense", None), ("hca", 0.125), ...]. Returns one BenchResult per (mode, test)."""
    from .engine import Engine
    need = max([max(pp, default=0), max(depths, default=0) + tg]) + 8
    results = []
    for kv, budget in modes:
        kw = dict(engine_kw)
        if kv == "hca" and budget is not None:
            kw["kv_budget"] = budget
        eng = Engine.load(model, device=device, dtype=dtype, ctx=ctx or need, kv=kv, threads=threads, **kw)
        cb = getattr(eng.cache, "codebooks", None)
        tests = [("pp", n, 0) for n in pp] + ([("tg", tg, d) for d in depths] if tg else [])
        for kind, n, depth in tests:
            name = f"pp{n}" if kind == "pp" else f"tg{n} @ d{depth}"
            log(f"bench: {kv}{'' if budget is None or kv == 'dense' else f' {budget}'} {name} ...")
            _reset_peak_host()
            if eng.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(eng.device)
            samples = []
            for r in range(reps + 1):          # repetition 0 warms up (JIT, allocator, cache fill)
                tps = measure_pp(eng, n, seed=r) if kind == "pp" else measure_tg(eng, n, depth, seed=0)
                if r:
                    samples.append(tps)
            cb = getattr(eng.cache, "codebooks", None)
            results.append(BenchResult(
                model=str(model).rstrip("/").split("/")[-1], device=str(eng.device), dtype=dtype,
                threads=torch.get_num_threads(), kv=kv, kv_budget=budget if kv == "hca" else None,
                codebooks="-" if kv == "dense" or getattr(eng.cache.layout, "exact_keys", False)
                else ("calibrated" if cb is not None and cb.source.startswith("calibrated") else "fitted"),
                test=name, n_prompt=n if kind == "pp" else 0, n_gen=n if kind == "tg" else 0, depth=depth,
                reps=reps, tps_mean=statistics.mean(samples),
                tps_std=statistics.stdev(samples) if len(samples) > 1 else 0.0, samples=samples,
                peak_host_bytes=_peak_host(),
                peak_device_bytes=torch.cuda.max_memory_allocated(eng.device) if eng.device.type == "cuda" else 0,
                kv_stats=eng.kv_stats(), date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")))
        del eng
    return results


def _size(n: int) -> str:
    return format_bytes(n) if n else "-"


def to_markdown(results: list[BenchResult]) -> str:
    head = ["model", "device", "threads", "dtype", "kv", "budget", "test", "t/s", "peak host", "peak device",
            "kv device", "kv host"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        s = r.kv_stats
        dev = s.get("device_kv_bytes", 0) + sum(s.get(k, 0) for k in ("device_keys_bytes", "device_ring_sinks_bytes",
                                                                       "codebook_bytes", "scratch_bytes"))
        rows.append("| " + " | ".join([
            r.model, r.device, str(r.threads), r.dtype, r.kv, "-" if r.kv_budget is None else str(r.kv_budget),
            r.test, f"{r.tps_mean:.2f} ± {r.tps_std:.2f}", _size(r.peak_host_bytes), _size(r.peak_device_bytes),
            _size(dev), _size(s.get("host_values_bytes", 0))]) + " |")
    return "\n".join(rows)


def to_json(results: list[BenchResult]) -> str:
    return json.dumps([asdict(r) for r in results], indent=2)


def to_csv(results: list[BenchResult]) -> str:
    keys = sorted({k for r in results for k in r.kv_stats})
    cols = [f for f in FIELDS if f != "kv_stats"] + [f"kv_{k}" for k in keys]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    for r in results:
        row = {k: v for k, v in asdict(r).items() if k != "kv_stats"}
        row["samples"] = " ".join(f"{x:.3f}" for x in r.samples)
        row.update({f"kv_{k}": r.kv_stats.get(k, "") for k in keys})
        w.writerow(row)
    return buf.getvalue()


def plot(results: list[BenchResult], path: str) -> None:
    """tg tokens/s against depth, one line per mode."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from .errors import MiniRunError
        raise MiniRunError("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    modes = sorted({(r.kv, r.kv_budget) for r in results if r.n_gen}, key=str)
    for kv, b in modes:
        pts = sorted((r.depth, r.tps_mean, r.tps_std) for r in results if r.n_gen and (r.kv, r.kv_budget) == (kv, b))
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o",
                    label=kv if b is None else f"{kv} {b}")
    ax.set_xlabel("context depth (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
