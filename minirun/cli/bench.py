"""`minirun bench` and `minirun plan`: thin click commands over minirun.tools.bench and minirun.planner."""
from __future__ import annotations

import json
import re
import sys
from fractions import Fraction
from pathlib import Path

import click

from .common import AT_LEAST_0, AT_LEAST_1, CTX, TAU, hca_opt_option, kv_values_option, threads_option
from ..config import KV_BUDGET_PRESETS, MAX_CTX, WEIGHTS, hca_setting
from ..errors import MiniRunError


MAX_REPS = 1000        # timed repetitions of one test
MAX_PARALLEL = 64      # sequences decoding together in one tg test (each holds a cache of --ctx)


def _ints(s: str, what: str) -> list[int]:
    """"512,2048" -> [512, 2048]: token counts, each in [0, MAX_CTX]."""
    try:
        vals = [int(x) for x in str(s).split(",") if x.strip() != ""]
    except ValueError:
        raise MiniRunError(f"{what}: expected comma-separated integers, got {s!r}") from None
    if any(v < 0 for v in vals):
        raise MiniRunError(f"{what}: negative values in {s!r}")
    if any(v > MAX_CTX for v in vals):
        raise MiniRunError(f"{what}: {max(vals)} is more than the largest context minirun takes, {MAX_CTX}")
    return vals


class AutoCtxType(click.ParamType):
    """--ctx for bench: 'auto' (just enough for the tests) or a size with K/M suffixes."""
    name = "ctx"

    def convert(self, value, param, ctx):
        if value is None or str(value).strip().lower() == "auto":
            return None
        return CTX.convert(value, param, ctx)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
MAX_MEMORY = 1 << 50     # 1024 TiB: more memory than any machine minirun plans for


class SizeType(click.ParamType):
    """A memory size in bytes with binary suffixes: 80G = 80GB = 80GiB = 80 * 2**30 (read as an exact
    fraction, never through a float), at most MAX_MEMORY."""
    name = "size"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        m = _SIZE_RE.match(str(value))
        if not m:
            self.fail(f"bad memory size {value!r}: use a number with an optional K, M, G or T suffix (e.g. 80G)",
                      param, ctx)
        n = int(Fraction(m.group(1)) * (1 << (10 * "_kmgt".index(m.group(2).lower() or "_"))))
        if n > MAX_MEMORY:
            self.fail(f"memory size {value!r} is more than {MAX_MEMORY >> 40} TiB", param, ctx)
        return n


def _modes(kv_modes: str, budgets: str) -> list[tuple[str, float | str | None]]:
    modes = []
    for m in [x.strip() for x in kv_modes.split(",") if x.strip()]:
        if m == "dense":
            modes.append(("dense", None))
        elif m == "hca":
            for x in [x.strip() for x in budgets.split(",") if x.strip()]:
                try:
                    kw = hca_setting(x)
                except MiniRunError:
                    kw = {}
                b = kw.get("kv_budget", x if "groups" in kw else None)      # a preset, or gGcC codebooks
                if b not in KV_BUDGET_PRESETS and not isinstance(b, str):
                    raise MiniRunError(f"unknown --kv-budget {x!r}: use "
                                       f"{', '.join(str(p) for p in KV_BUDGET_PRESETS)} or gGcC, e.g. g64c16 "
                                       f"(comma-separated)")
                modes.append(("hca", b))
        else:
            raise MiniRunError(f"unknown kv mode {m!r}: use dense and/or hca (comma-separated)")
    if not modes:
        raise MiniRunError("--kv: give dense and/or hca")
    return list(dict.fromkeys(modes))


BENCH_EPILOG = """\b
Tests (llama-bench's): pp N prefills N fresh random tokens; tg N @ dD decodes N tokens greedily
after D tokens of context (the context is prefilled untimed; EOS is ignored); with --parallel B
> 1, "tg N @ dD xB": B sequences, each with its own context, decode together, one forward a step,
and t/s counts the tokens of all B. One warm-up rep, then -r timed reps: t/s is mean ± sample
std. Status lines go to stderr, results to stdout.

\b
JSON fields (one object per mode and test; CSV has the same columns, samples space-separated and
kv_stats flattened into kv_<key> columns):
  model, model_bytes (weights as held), model_params, device, dtype, weights (dtype or block
  format), threads, ctx, kv (dense|hca),
  kv_budget (null for dense), codebooks (calibrated|fitted|-), test (pp512, tg32 @ d4096),
  n_prompt, n_gen, depth, reps, tps_mean, tps_std, samples (t/s of each rep), parallel
  (sequences decoding together), peak_host_bytes (VmHWM), peak_host_scope (test|process:
  whether the peak could be reset before the test), peak_device_bytes (CUDA, else 0), kv_stats (the cache's tokens and bytes
  per tier after the test), date (UTC), version (minirun's)

\b
Example: minirun bench models/SmolLM2-135M-Instruct -p 512,2048 -n 32 -d 0,4096,16384 \\
           --kv dense,hca --kv-budget 0.25,0.125 -r 3 -o json
"""


@click.command(epilog=BENCH_EPILOG)
@click.argument("model", type=click.Path(path_type=Path))
@click.option("-p", "--n-prompt", default="512", show_default=True,
              help="pp tests: comma-separated prompt lengths (\"\" for none)")
@click.option("-n", "--n-gen", type=AT_LEAST_0, default=32, show_default=True,
              help="tokens decoded in each tg test (0: no tg tests)")
@click.option("-d", "--depth", default="0", show_default=True, help="tg tests: comma-separated context depths")
@click.option("--parallel", default="1", show_default=True,
              help="tg tests: comma-separated numbers of sequences decoding together, each with its own "
                   f"context (llama-batched-bench; t/s counts all of them; at most {MAX_PARALLEL})")
@click.option("--kv", "kv_modes", default="dense,hca", show_default=True, help="KV modes: dense and/or hca")
@click.option("--kv-budget", "budgets", default="0.25", show_default=True,
              help="HCA budgets, comma-separated: 0.5, 0.25, 0.125, or gGcC codebooks such as g64c16 "
                   "(one engine each)")
@click.option("-r", "--reps", type=click.IntRange(1, MAX_REPS), default=3, show_default=True, help="timed repetitions (after one warm-up)")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--weights", type=click.Choice(WEIGHTS), default="stored", show_default=True,
              help="weight matrices as stored (GGUF blocks stay blocks), dequantized, or quantized at load")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda or auto")
@click.option("--ctx", type=AutoCtxType(), default="auto", show_default=True,
              help="cache size of every engine (K/M suffixes); auto: the largest test, rounded up to 256")
@threads_option()
@click.option("--tau", type=TAU, default=0.9, show_default=True, help="HCA: attention mass kept per head")
@click.option("--window", type=AT_LEAST_1, default=256, show_default=True, help="HCA: recent tokens kept exact")
@click.option("--sinks", type=AT_LEAST_0, default=16, show_default=True, help="HCA: first tokens kept exact")
@click.option("--max-select", type=AT_LEAST_1, default=None,
              help="HCA: at most this many old tokens per head and step, the top-scoring (default: tau alone)")
@kv_values_option
@hca_opt_option()
@click.option("--context", default="random", show_default=True,
              help="what prompts and contexts are made of: random (token ids, as llama-bench), text (the "
                   "stdlib's pydoc topics: natural text, offline) or a text file (./text for one named text)")
@click.option("-o", "--output", type=click.Choice(["md", "json", "csv"]), default="md", show_default=True)
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), default=None,
              help="also draw tg tokens/s against depth per mode into this PNG (needs matplotlib)")
def bench(model, n_prompt, n_gen, depth, parallel, kv_modes, budgets, reps, dtype, weights, device, ctx, threads, tau, window,
          sinks, max_select, kv_values, hca_opts, context, output, plot_path):
    """Prefill (pp N) and decode (tg N @ dD) tokens/s, llama-bench style, for dense and HCA caches."""
    from ..tools import bench as b
    from ..tools import bench_output as out
    from ..checkpoint.pull import find_model
    model = find_model(model)
    modes = _modes(kv_modes, budgets)
    par = _ints(parallel, "--parallel")
    if not par or not all(1 <= b <= MAX_PARALLEL for b in par):
        raise MiniRunError(f"--parallel: comma-separated numbers of sequences from 1 to {MAX_PARALLEL}, got {parallel!r}")
    if plot_path:
        out.check_plot()
    results = b.run_bench(model, modes, _ints(n_prompt, "-p"), n_gen, _ints(depth, "-d") or [0], reps,
                          dtype=dtype, device=device, ctx=ctx, threads=threads, tau=tau, window=window,
                          sinks=sinks, max_select=max_select, weights=weights, context=context, kv_values=kv_values,
                          parallel=tuple(dict.fromkeys(par)),
                          **hca_opts,
                          log=lambda s: click.echo(s, err=True))
    click.echo({"md": out.to_markdown, "json": out.to_json, "csv": out.to_csv}[output](results).rstrip("\n"))
    if plot_path:
        out.plot(results, str(plot_path))
        click.echo(f"plot: {plot_path}", err=True)


PLAN_EPILOG = """\b
JSON fields: ctx, kv, kv_budget (a number, or "gGcC" for explicit codebooks), dtype, weights (the dtype,
or the weights' block format), device, params,
tiers [{tier, where, bytes, bytes_per_token, transient}], device_bytes, host_bytes, dense_bytes_per_token,
available {host, device}, fits (null when no GPU figure is known), host_fits, largest_ctx (null when no
GPU figure is known), prompt_cache_bytes, trained_ctx (config.json's max_position_embeddings),
ctx_note (when --ctx passes it), note.

\b
Exit status: 0 when it fits (or no GPU figure is known and the host side fits), 1 when it does not.
"""


def plan_device(device: str, gpu_mem: int | None) -> str:
    """--device auto as chat and generate resolve it (cuda when torch sees a GPU, else cpu), and cuda
    when --gpu-mem names a GPU to plan for."""
    if device != "auto":
        return device
    import torch
    return "cuda" if gpu_mem is not None or torch.cuda.is_available() else "cpu"


@click.command(epilog=PLAN_EPILOG)
@click.argument("model_or_config", type=click.Path(path_type=Path))
@click.option("--ctx", type=CTX, default="8K", show_default=True, help="context size (K/M suffixes: 4M = 4194304)")
@click.option("--kv", type=click.Choice(["dense", "hca"]), default="dense", show_default=True)
@click.option("--kv-budget", default="0.25", show_default=True,
              help="HCA key store: a budget (0.5, 0.25, 0.125) or gGcC codebooks such as g64c16")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--weights", type=click.Choice(WEIGHTS), default="stored", show_default=True,
              help="weight matrices as stored (GGUF blocks stay blocks), dequantized, or quantized at load")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="where the device tiers go (cpu: everything is host memory; auto: cuda when torch sees a GPU "
                   "or --gpu-mem is given, else cpu)")
@click.option("--window", type=AT_LEAST_1, default=256, show_default=True, help="HCA: recent tokens kept exact")
@click.option("--sinks", type=AT_LEAST_0, default=16, show_default=True, help="HCA: first tokens kept exact")
@kv_values_option
@hca_opt_option()
@click.option("--gpu-mem", type=SizeType(), default=None,
              help="GPU memory to check against (e.g. 80G); default: the free memory of this machine's GPU")
@click.option("--host-mem", type=SizeType(), default=None,
              help="host memory to check against (e.g. 128G); default: what this machine has available")
@click.option("-o", "--output", type=click.Choice(["md", "json"]), default="md", show_default=True)
def plan_cmd(model_or_config, ctx, kv, kv_budget, dtype, weights, device, window, sinks, kv_values, hca_opts, gpu_mem,
             host_mem, output):
    """Bytes of every memory tier for a context, before anything is allocated, and whether it fits
    (the defaults are those of chat and generate).

    MODEL_OR_CONFIG: a model directory or a bare config.json (no weights needed)."""
    from ..config import EngineConfig, ModelArgs
    from ..planner import format_bytes, format_plan, plan_report
    from ..checkpoint.pull import find_model
    args = ModelArgs.from_path(find_model(model_or_config))
    device = plan_device(device, gpu_mem)
    cfg = EngineConfig(ctx=ctx, device=device, dtype=dtype, weights=weights, kv=kv, window=window, sinks=sinks,
                       kv_values=kv_values, **hca_setting(kv_budget), **hca_opts)
    report = plan_report(args, cfg, device, gpu_mem, host_mem)
    click.echo(json.dumps(report, indent=2) if output == "json" else format_plan(report))
    if host_mem is not None and not report["host_fits"]:
        click.echo(f"minirun plan: the host tiers need {format_bytes(report['host_bytes'])}, more than --host-mem "
                   f"{format_bytes(host_mem)}", err=True)
    if report["fits"] is False or (report["fits"] is None and not report["host_fits"]):
        sys.exit(1)
