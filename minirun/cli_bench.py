"""`minirun bench` and `minirun plan`: thin click commands over minirun.bench and minirun.planner."""
from __future__ import annotations

import json
from pathlib import Path

import click

from .cli_common import CTX
from .errors import MiniRunError


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in str(s).split(",") if x.strip() != ""]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {s!r}") from None


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("-p", "--n-prompt", default="512", show_default=True, help="prefill tests: comma-separated token counts (empty: none)")
@click.option("-n", "--n-gen", type=int, default=32, show_default=True, help="tokens generated in each tg test (0: none)")
@click.option("-d", "--depth", default="0", show_default=True, help="tg tests: comma-separated context depths")
@click.option("--kv", "kv_modes", default="dense,hca", show_default=True, help="modes: dense and/or hca")
@click.option("--kv-budget", "budgets", default="0.125", show_default=True, help="HCA budgets: comma-separated (0.5, 0.25, 0.125)")
@click.option("-r", "--reps", type=int, default=3, show_default=True, help="repetitions (after one warm-up)")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--ctx", type=CTX, default=None, help="cache size (default: just enough for the tests)")
@click.option("--threads", type=int, default=None)
@click.option("--tau", type=float, default=0.9, show_default=True)
@click.option("--window", type=int, default=256, show_default=True)
@click.option("--sinks", type=int, default=16, show_default=True)
@click.option("-o", "--output", type=click.Choice(["md", "json", "csv"]), default="md", show_default=True)
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), default=None, help="PNG of tg tokens/s against depth")
def bench(model, n_prompt, n_gen, depth, kv_modes, budgets, reps, dtype, device, ctx, threads, tau, window, sinks,
          output, plot_path):
    """Prefill (pp N) and decode (tg N @ dD) tokens/s, llama-bench style, for dense and HCA.

    JSON/CSV fields: model, device, dtype, threads, kv, kv_budget, codebooks (calibrated|fitted|-),
    test, n_prompt, n_gen, depth, reps, tps_mean, tps_std, samples, peak_host_bytes (VmHWM),
    peak_device_bytes, kv_stats (bytes per tier; CSV: kv_<key>), date, version.
    """
    from . import bench as b
    modes = []
    for m in [x.strip() for x in kv_modes.split(",") if x.strip()]:
        if m == "dense":
            modes.append(("dense", None))
        elif m == "hca":
            modes += [("hca", float(x)) for x in budgets.split(",") if x.strip()]
        else:
            raise MiniRunError(f"unknown kv mode {m!r}: use dense and/or hca")
    if reps < 1:
        raise MiniRunError("--reps must be at least 1")
    results = b.run_bench(model, modes, _ints(n_prompt), n_gen, _ints(depth), reps, dtype=dtype, device=device,
                          ctx=ctx, threads=threads, tau=tau, window=window, sinks=sinks,
                          log=lambda s: click.echo(s, err=True))
    click.echo({"md": b.to_markdown, "json": b.to_json, "csv": b.to_csv}[output](results))
    if plot_path:
        b.plot(results, str(plot_path))
        click.echo(f"plot: {plot_path}", err=True)


@click.command()
@click.argument("model_or_config", type=click.Path(path_type=Path))
@click.option("--ctx", type=CTX, default="8K", show_default=True)
@click.option("--kv", type=click.Choice(["dense", "hca"]), default="hca", show_default=True)
@click.option("--kv-budget", type=click.Choice(["0.5", "0.25", "0.125"]), default="0.125", show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="bfloat16", show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cuda", show_default=True)
@click.option("--window", type=int, default=256, show_default=True)
@click.option("--sinks", type=int, default=16, show_default=True)
@click.option("--gpu-mem", type=CTX, default=None, help="GPU memory to check against (e.g. 80G); default: the free memory of this machine's GPU")
@click.option("-o", "--output", type=click.Choice(["md", "json"]), default="md", show_default=True)
def plan_cmd(model_or_config, ctx, kv, kv_budget, dtype, device, window, sinks, gpu_mem, output):
    """Bytes of every tier for a context, before anything is allocated, and whether it fits."""
    from .config import EngineConfig, ModelArgs
    from .planner import format_plan, plan_report
    args = ModelArgs.from_path(model_or_config)
    cfg = EngineConfig(ctx=ctx, device="cpu", dtype=dtype, kv=kv, kv_budget=float(kv_budget), window=window, sinks=sinks)
    report = plan_report(args, cfg, device, gpu_mem)
    click.echo(json.dumps(report, indent=2) if output == "json" else format_plan(report))
