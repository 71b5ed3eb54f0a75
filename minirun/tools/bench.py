"""llama-bench-style measurements: `pp N` (prefill N tokens) and `tg N @ dD` (N decode steps after D).

Every test runs greedy, end-of-sequence ignored, once per KV mode (dense, and HCA at each budget);
one Engine per mode. The context's tokens (`context`): "random" ids (seeded, llama-bench's way),
"text" (the stdlib's pydoc topics, the evaluation half: natural text every Python install has,
not the half codebooks are calibrated on) or a text file's tokens (a file named text: ./text),
repeated when shorter than a test. What the context holds matters to HCA: on natural text a few
percent of the tokens carry 90% of a head's attention mass, on random ids attention is diffuse and
the selection is several times larger (docs/BENCHMARKS.md), so the decode speed differs. Each test
runs one warm-up repetition (Numba JIT, allocator, cache fill), then `reps` timed ones: mean +-
sample std of tokens/s.

- pp N: the cache is reset, N fresh tokens are prefilled; tokens/s is the engine's own prefill
  timing (`Engine.last_prefill`; on CUDA, a wall-clock time between two stream syncs instead).
- tg N @ dD: D tokens of context are prefilled (not timed; d0 means a single token), then N
  `Engine.step` calls, each fed the argmax of the previous logits, are timed. The context is kept
  for the next repetition by rewinding to D tokens (re-prefilled, untimed, when the cache cannot).
- HCA codebooks: "calibrated" when the model directory has a codebook file for the layout;
  otherwise "fitted": the cache fits them from the context itself, and the bench drops fitted
  codebooks before every pp repetition and at the start of every tg test, so each test fits on
  its own tokens (pp timings then include the fit, as a first prompt without calibration does).
  "-" for dense and for exact-key layouts (budget 0.5).

JSON/CSV fields, one object/row per (mode, test):
  model (directory name), model_bytes (the weights' bytes as held: float ones in this dtype,
  quantized ones at their block format's size), model_params, device, dtype,
  threads (torch CPU threads), ctx (cache size), kv ("dense" | "hca"), kv_budget (None for dense),
  codebooks ("calibrated" | "fitted" | "-"), test ("pp512", "tg32 @ d4096"), n_prompt, n_gen,
  depth, context ("random" | "text" | the file's name), reps, tps_mean, tps_std (sample std; 0
  with one rep), selected (HCA tg: the share of the store tokens the selection keeps in the first
  step after the context, mean over layers and heads, from an untimed step; None otherwise),
  samples (tokens/s of each rep; CSV: space-separated), peak_host_bytes (VmHWM during the test), peak_host_scope ("test" when the peak
  was reset before the test, "process" when /proc/self/clear_refs refused and it is the process
  peak so far), peak_device_bytes (torch.cuda.max_memory_allocated during the test; 0 on CPU),
  kv_stats (the cache's stats() at the end of the last rep: tokens and bytes per tier; CSV: one
  kv_<key> column per key), date (UTC), version (minirun's), cuda_graphs ("token" when tg steps
  were whole tokens replayed from CUDA graphs, "off" when they ran eagerly), rescore (HCA with
  rescore: the selected tokens weighted by exact scores from keys kept on the host; markdown: "hca
  rescore"), device_name (the GPU's or the CPU's model name), value_sum (HCA on a GPU: "gpu" or
  "host", where the selected values were summed), max_select (the selection's cap, or None),
  weights (how the weight matrices are held: the dtype, or a block format such as "Q4_1"; markdown:
  the weights column, "Q4_1 (float32)" for quantized weights and float32 activations), values (HCA:
  the store's values on the host, "float", "q8" or "q4"; None for dense).
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from .. import __version__
from ..config import hca_setting
from ..errors import MiniRunError
from .evaluate import selection_probe
from ..planner import param_count, weight_bytes
from ..quant.sizes import weights_label

FIELDS = ["model", "model_bytes", "model_params", "device", "dtype", "threads", "ctx", "kv", "kv_budget",
          "codebooks", "test", "n_prompt", "n_gen", "depth", "context", "reps", "tps_mean", "tps_std", "selected",
          "samples", "peak_host_bytes", "peak_host_scope", "peak_device_bytes", "kv_stats", "date", "version", "cuda_graphs",
          "rescore", "device_name", "value_sum", "max_select", "weights", "values", "parallel"]
CTX_ROUND = 256


@dataclass
class BenchResult:
    model: str
    model_bytes: int
    model_params: int
    device: str
    dtype: str
    threads: int
    ctx: int
    kv: str
    kv_budget: float | str | None   # a preset, or gGcC codebooks (config.hca_setting)
    codebooks: str
    test: str
    n_prompt: int
    n_gen: int
    depth: int
    context: str
    reps: int
    tps_mean: float
    tps_std: float
    selected: float | None = None
    samples: list = field(default_factory=list)
    peak_host_bytes: int = 0
    peak_host_scope: str = "test"
    peak_device_bytes: int = 0
    kv_stats: dict = field(default_factory=dict)
    date: str = ""
    version: str = __version__
    cuda_graphs: str = "off"
    rescore: bool = False           # HCA with rescore (exact weights from host keys)
    device_name: str = ""           # the GPU's or CPU's model name (device_name)
    value_sum: str | None = None    # HCA on a GPU: where the selected values are summed ("cpu" | "gpu" | ...)
    max_select: int | None = None   # HCA: the selection's cap per head and step (None: tau alone)
    weights: str = ""               # how the weight matrices are held: the dtype, or a block format ("Q4_1")
    values: str | None = None       # HCA: the store's values on the host ("float" | "q8" | "q4"; kv_values)
    parallel: int = 1               # tg: sequences decoding together (tps_mean: their tokens/s in all)


def device_name(device: torch.device) -> str:
    """The GPU's name (torch), or the CPU's model name (/proc/cpuinfo), for the rows' device_name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def result(eng, model, kv: str, budget, name: str, kind: str, n: int, depth: int, context: str, samples: list,
           **fields) -> BenchResult:
    """One row: the engine's setting and the test's samples (tokens/s of each timed rep); fields:
    any other BenchResult field (selected, peak_host_bytes, peak_host_scope, kv_stats, ...)."""
    cache = eng.cache
    fields.setdefault("peak_device_bytes",
                      torch.cuda.max_memory_allocated(eng.device) if eng.device.type == "cuda" else 0)
    return BenchResult(
        model=str(model).rstrip("/").split("/")[-1],
        model_bytes=weight_bytes(eng.args, eng.config.dtype, eng.config.weights),
        weights=weights_label(eng.args, eng.config.weights, eng.config.dtype),
        model_params=param_count(eng.args), device=str(eng.device), dtype=eng.config.dtype,
        threads=torch.get_num_threads(), ctx=eng.config.ctx, kv=kv,
        kv_budget=budget if kv == "hca" else None, codebooks=fields.pop("codebooks", None) or codebook_source(eng),
        test=name,
        n_prompt=n if kind == "pp" else 0, n_gen=n if kind == "tg" else 0, depth=depth,
        context=context, reps=len(samples), tps_mean=statistics.mean(samples),
        tps_std=statistics.stdev(samples) if len(samples) > 1 else 0.0, samples=list(samples),
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), cuda_graphs=eng.cuda_graphs_mode(),
        rescore=getattr(cache, "host_keys", None) is not None, device_name=device_name(eng.device),
        value_sum=getattr(cache, "value_sum", None) if kv == "hca" else None,
        max_select=getattr(cache, "max_select", None) if kv == "hca" else None,
        values=getattr(getattr(cache, "value_codes", None), "kind", eng.config.kv_values) if kv == "hca" else None,
        **fields)


def _reset_peak_host() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: "5" to clear_refs). False when refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


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
    """n ids drawn away from the low (special) ids of the vocabulary, like llama-bench's."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(100, vocab // 4), vocab - 1, (n,), generator=g).tolist()


def codebook_source(eng) -> str:
    """'calibrated' | 'fitted' | '-' (dense, or HCA keeping exact keys), as the engine was loaded."""
    cache = eng.cache.full_layers
    if eng.config.kv != "hca" or getattr(cache.layout, "exact_keys", False):
        return "-"
    cb = cache.codebooks
    return "calibrated" if cb is not None and str(cb.source).startswith("calibrated") else "fitted"


def _forget_fitted_codebooks(eng) -> None:
    """Drop codebooks the cache fitted from an earlier context (calibrated ones stay)."""
    cb = getattr(eng.cache.full_layers, "codebooks", None)
    if cb is not None and not str(cb.source).startswith("calibrated"):
        eng.reset()
        eng.cache.full_layers.codebooks = None


class Context:
    """The tokens a test's prompt or context is made of: random ids, or a text's tokens.

    source: "random", "text" (the built-in evaluation text) or a text file's path; a file that
    cannot be read is a one-line MiniRunError here, before any engine is loaded."""

    def __init__(self, source: str = "random"):
        self.source = source
        self.name = source if source in ("random", "text") else Path(source).name
        self._text = None
        if source != "random":
            from .calibrate import read_text
            self._text, _ = read_text(None if source == "text" else source, "evaluation", flag="--context")
        self._tokenized = None          # (the tokenizer, its ids of the text without BOS)

    def ids(self, eng, n: int, seed: int) -> list[int]:
        """n token ids for eng: random ids drawn with seed, or the text's first n tokens (the text
        repeated as often as needed, BOS, where the model wants one, only at the start; seed unused)."""
        if self._text is None:
            return random_ids(n, eng.args.vocab_size, seed)
        if self._tokenized is None or self._tokenized[0] is not eng.tokenizer:
            self._tokenized = (eng.tokenizer, eng.tokenize(self._text, add_bos=False))
        toks = self._tokenized[1]
        if not toks:
            raise MiniRunError(f"--context {self.source} has no tokens")
        bos = eng.tokenize("")                                 # [BOS] or []
        return (bos + toks * (n // len(toks) + 1))[:n]


def selected_share(eng, ids: list[int]) -> float | None:
    """HCA: the share of the store its selection keeps in the first step after the context `ids`
    (mean over layers and heads); None when the cache records no selection (dense). The cache is
    left holding `ids`."""
    if not hasattr(eng.cache, "record_selection"):
        return None
    logits, _ = eng.prefill(ids)                               # (a cached prefix: nothing to do)
    with selection_probe(eng) as sel:
        eng.step(int(logits[-1].argmax()))
    eng.rewind(len(ids))
    return float(sel["fraction"].mean()) if "fraction" in sel else None


def measure_pp(eng, n: int, seed: int, context: Context | None = None) -> float:
    """Prefill n fresh tokens; tokens/s."""
    eng.reset()
    _forget_fitted_codebooks(eng)
    ids = (context or Context()).ids(eng, n, seed)
    _sync(eng)
    t0 = time.perf_counter()
    eng.prefill(ids)
    _sync(eng)
    dt = time.perf_counter() - t0
    if eng.device.type == "cuda":     # the engine's own timing does not wait for the GPU
        return n / dt
    return eng.last_prefill["tps"]


def measure_tg(eng, n: int, depth: int, seed: int, context: Context | None = None,
               probe: bool = False) -> tuple[float, dict, float | None]:
    """Decode n tokens greedily after `depth` tokens of context (prefill not timed).

    Returns (tokens/s, the cache's stats after the n steps, with probe the selected_share after the
    context (an untimed step), else None). Afterwards the cache is rewound to the context, so the
    next call's prefill reuses it (the engine reuses a cached prefix)."""
    ctx_ids = (context or Context()).ids(eng, max(depth, 1), seed)
    logits, _ = eng.prefill(ctx_ids)
    tok = int(logits[-1].argmax())
    _sync(eng)
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(eng.step(tok)[-1].argmax())   # .item() waits for the device: no EOS check
    _sync(eng)
    dt = time.perf_counter() - t0
    stats = eng.kv_stats()
    eng.rewind(len(ctx_ids))          # drop the generated tokens (or everything, when it cannot)
    return n / dt, stats, selected_share(eng, ctx_ids) if probe else None


def measure_tg_batch(engs, n: int, depth: int, seed: int, context: Context | None = None) -> tuple[float, dict]:
    """llama-batched-bench's test: B sequences (engines of one model, each its own `depth` tokens of
    context, prefilled untimed) decode n tokens greedily together, one forward a step
    (Engine.step_batch) -> (tokens/s of all B, the first cache's stats). The caches are rewound to
    their contexts afterwards."""
    from ..engine import Engine
    ctxs = [(context or Context()).ids(e, max(depth, 1), seed + i) for i, e in enumerate(engs)]
    toks = [int(e.prefill(ids)[0][-1].argmax()) for e, ids in zip(engs, ctxs)]
    _sync(engs[0])
    t0 = time.perf_counter()
    for _ in range(n):
        toks = Engine.step_batch(engs, toks).argmax(-1).tolist()
    _sync(engs[0])
    dt = time.perf_counter() - t0
    stats = engs[0].kv_stats()
    for e, ids in zip(engs, ctxs):
        e.rewind(len(ids))
    return len(engs) * n / dt, stats


def tokens_needed(pp: list[int], tg: int, depths: list[int]) -> int:
    """The most tokens one test holds: the longest pp, or the deepest tg context plus its tokens."""
    return max(max(pp, default=0), (max(max(depths, default=0), 1) + tg) if tg > 0 else 0, 1)


def bench_ctx(pp: list[int], tg: int, depths: list[int]) -> int:
    """The default cache size: tokens_needed rounded up to a multiple of CTX_ROUND."""
    return -(-tokens_needed(pp, tg, depths) // CTX_ROUND) * CTX_ROUND


def run_bench(model, modes: list[tuple[str, float | None]], pp: list[int], tg: int, depths: list[int],
              reps: int, dtype: str = "float32", device: str = "auto", ctx: int | None = None,
              threads: int | None = None, log=print, context: str = "random", parallel: tuple = (1,),
              **engine_kw) -> list[BenchResult]:
    """modes: [("dense", None), ("hca", 0.125), ...]. Returns one BenchResult per (mode, test).
    parallel: the tg tests' numbers of sequences decoding together (measure_tg_batch where > 1).

    ctx: the cache size of every engine (default: bench_ctx of the tests); context: what the
    prompts and contexts are made of (Context). engine_kw: any other EngineConfig field (tau,
    window, sinks, ...)."""
    from ..engine import Engine
    pp = [n for n in pp if n > 0]
    need = tokens_needed(pp, tg, depths)
    if ctx is not None and ctx < need:
        raise MiniRunError(f"--ctx {ctx} is too small for these tests: the largest holds {need} tokens")
    ctx = ctx or bench_ctx(pp, tg, depths)
    if reps < 1:
        raise MiniRunError("reps must be at least 1")
    if not parallel or min(parallel) < 1:
        raise MiniRunError("parallel: at least one sequence")
    tests = [("pp", n, 0, 1) for n in pp] + ([("tg", tg, d, b) for d in depths for b in parallel] if tg > 0 else [])
    if not tests:
        raise MiniRunError("no tests: give -p and/or -n > 0")
    source = Context(context)
    results = []
    scope_warned = False
    for kv, budget in modes:
        kw = dict(engine_kw)
        if kv == "hca" and budget is not None:
            kw.update(hca_setting(budget))
        eng = Engine.load(model, device=device, dtype=dtype, ctx=ctx, kv=kv, threads=threads, **kw)
        codebooks = codebook_source(eng)
        label = kv if kv == "dense" else f"{kv} {budget}"
        siblings = [eng.sibling() for _ in range(max(parallel) - 1)] if tg > 0 else []   # (caches: tg tests only)
        for kind, n, depth, par in tests:
            name = f"pp{n}" if kind == "pp" else f"tg{n} @ d{depth}" + (f" x{par}" if par > 1 else "")
            log(f"bench: {label} {name} ({reps} reps + 1 warm-up) ...")
            eng.reset()
            if kind == "tg":
                _forget_fitted_codebooks(eng)
            gc.collect()
            scope = "test" if _reset_peak_host() else "process"
            if scope == "process" and not scope_warned:
                log("bench: /proc/self/clear_refs refused: peak host memory is the process peak so far")
                scope_warned = True
            if eng.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(eng.device)
            samples, stats, selected = [], {}, None
            for r in range(reps + 1):          # repetition 0 warms up
                if kind == "pp":
                    tps = measure_pp(eng, n, seed=r, context=source)
                    stats = eng.kv_stats()
                elif par > 1:
                    tps, stats = measure_tg_batch([eng, *siblings[:par - 1]], n, depth, seed=0, context=source)
                else:
                    tps, stats, selected = measure_tg(eng, n, depth, seed=0, context=source, probe=r == reps)
                if r:
                    samples.append(tps)
            results.append(result(eng, model, kv, budget, name, kind, n, depth, source.name, samples,
                                  selected=selected, peak_host_bytes=_peak_host(), peak_host_scope=scope,
                                  kv_stats=stats, codebooks=codebooks, parallel=par))
        del eng, siblings
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results
