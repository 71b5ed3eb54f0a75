"""`minirun calibrate` and `minirun eval`: thin click commands over minirun.tools.calibrate and minirun.tools.evaluate."""
from __future__ import annotations

import json
from pathlib import Path

import click

from .common import AT_LEAST_0, AT_LEAST_1, COUNT, SEED, TAU, hca_opt_option, kv_values_option, threads_option
from ..tools.calibrate import DEFAULT_ITERS, DEFAULT_TOKENS, DEFAULT_WINDOWS
from ..errors import MiniRunError

EVAL_OPTS = ("key_store", "far_positions", "length_scale", "rescore")   # the --hca-opt keys eval takes


def _floats(value: str, what: str) -> list[float]:
    try:
        return [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise MiniRunError(f"{what}: expected comma-separated numbers, got {value!r}") from None


def _settings(value: str) -> list[str]:
    """--kv-budget of eval: budgets or gGcC settings (config.hca_setting), each checked here."""
    from ..config import hca_setting
    out = [x.strip() for x in value.split(",") if x.strip()]
    for x in out:
        hca_setting(x)
    return out


def _ints(value: str, what: str) -> list[int]:
    from ..config import parse_ctx
    try:
        return [parse_ctx(x) for x in value.split(",") if x.strip()]
    except MiniRunError:
        raise MiniRunError(f"{what}: expected comma-separated token counts (1K = 1024), got {value!r}") from None


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--data", type=click.Path(path_type=Path), default=None,
              help="calibration text file (default: the stdlib's pydoc topics, calibration half)")
@click.option("--kv-budget", type=click.Choice(["0.25", "0.125"]), default="0.25", show_default=True,
              help="preset giving the groups (0.25: head_dim/2, 0.125: head_dim/4)")
@click.option("--groups", type=click.IntRange(1, 1 << 16), default=None, help="sub-vectors per key (overrides --kv-budget)")
@click.option("--centroids", type=click.IntRange(2, 32768), default=1024, show_default=True, help="centroids per group")
@click.option("--tokens", type=AT_LEAST_1, default=DEFAULT_TOKENS, show_default=True,
              help="keys per (layer, kv-head) to fit on, sub-sampled across windows and positions")
@click.option("--windows", type=COUNT, default=DEFAULT_WINDOWS, show_default=True,
              help="2048-token windows of the text to run, spread over it")
@click.option("--iters", type=COUNT, default=DEFAULT_ITERS, show_default=True,
              help="mini-batch k-means steps (4096 samples each)")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--unrotated", is_flag=True,
              help="keys without their RoPE rotation: the codebooks far_positions on / auto runs load "
                   "(grouped ones load the plain, rotated ones)")
@threads_option()
@click.option("--head-budgets/--no-head-budgets", default=True, show_default=True,
              help="with --unrotated: also measure each head's selection cap past the trained context "
                   "(an exact prefill of that many tokens) and write it into the file")
def calibrate(model, data, kv_budget, groups, centroids, tokens, windows, iters, seed, unrotated, threads,
              head_budgets):
    """Fit key codebooks on text and write codebooks-g{G}-c{C}[-unrotated].safetensors into MODEL."""
    from ..tools.calibrate import calibrate as run
    from ..config import ModelArgs
    from ..checkpoint.pull import find_model
    model = find_model(model)
    if threads:
        import torch
        torch.set_num_threads(threads)
    hd = ModelArgs.from_path(model).head_dim
    g = groups or {"0.25": hd // 2, "0.125": hd // 4}[kv_budget]
    path = run(model, g, centroids, data=data, tokens=tokens, iters=iters, windows=windows, seed=seed,
               unrotated=unrotated, log=lambda s: click.echo(s, err=True), budgets=head_budgets)
    click.echo(str(path))


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--data", type=click.Path(path_type=Path), default=None,
              help="evaluation text file (default: the stdlib's pydoc topics, evaluation half)")
@click.option("--kv-budget", "budgets", default="0.5,0.25,0.125", show_default=True,
              help="HCA budgets (or gGcC codebooks, e.g. g64c16) to compare with dense (comma-separated; "
                   "empty: dense only)")
@click.option("--ppl-tokens", type=AT_LEAST_0, default=4096, show_default=True, help="0 skips perplexity")
@click.option("--prompt-tokens", type=AT_LEAST_1, default=3072, show_default=True, help="teacher forcing: prompt length")
@click.option("--positions", type=AT_LEAST_0, default=256, show_default=True,
              help="teacher forcing: positions compared after the prompt (0 skips agreement/KL)")
@click.option("--passkey-lengths", default="1K,2K,4K,8000", show_default=True,
              help="passkey prompt lengths in tokens (empty skips passkey)")
@click.option("--passkey-depths", default="0.1,0.5,0.9", show_default=True, help="where the key sits (0..1)")
@click.option("--trials", type=COUNT, default=2, show_default=True, help="random keys per passkey cell")
@click.option("--passkey-haystack", type=click.Choice(["filler", "text"]), default="filler", show_default=True,
              help="hide the key in filler sentences, or in the evaluation text's start")
@click.option("--passkey-copies", type=COUNT, default=1, show_default=True,
              help="with --passkey-haystack text: that text repeated this many times (as a 4M-token book is)")
@click.option("--tau", type=TAU, default=0.9, show_default=True, help="HCA: softmax mass kept per head")
@click.option("--window", type=AT_LEAST_1, default=256, show_default=True, help="HCA: recent tokens kept exact")
@click.option("--sinks", type=AT_LEAST_0, default=16, show_default=True, help="HCA: first tokens kept exact")
@click.option("--centroids", type=click.IntRange(2, 32768), default=None, help="HCA codebook size (default: the preset's 1024)")
@click.option("--max-select", type=AT_LEAST_1, default=None,
              help="HCA: at most this many old tokens per head and step, the top-scoring (default: tau alone)")
@hca_opt_option("an advanced setting, KEY=VALUE (repeatable): " + ", ".join(EVAL_OPTS) + " (README: options)")
@kv_values_option
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@threads_option()
@click.option("--seed", type=SEED, default=0, show_default=True, help="passkey keys")
@click.option("-o", "--output", type=click.Choice(["md", "json"]), default="md", show_default=True)
def eval_cmd(model, data, budgets, ppl_tokens, prompt_tokens, positions, passkey_lengths, passkey_depths, trials,
             passkey_haystack, passkey_copies, tau, window, sinks, centroids, max_select, hca_opts, kv_values, dtype,
             threads, seed, output):
    """Dense vs HCA on the same inputs: perplexity, top-1 agreement and KL, passkey accuracy."""
    from ..tools.calibrate import read_text
    from ..config import ModelArgs
    from ..tools.evaluate import format_markdown, run_grid
    from ..checkpoint.tokenizer import Tokenizer
    from ..checkpoint.pull import find_model
    model = find_model(model)
    opts = hca_opts
    other = sorted(set(opts) - set(EVAL_OPTS))
    if other:
        raise MiniRunError(f"--hca-opt {', '.join(other)}: not an eval setting (eval takes {', '.join(EVAL_OPTS)})")
    ModelArgs.from_path(model)                                   # a bad model dir: one line, before any work
    text, source = read_text(data, part="evaluation")
    ids = Tokenizer(model).encode(text)
    report = run_grid(model, ids, budgets=_settings(budgets), ppl_tokens=ppl_tokens,
                      prompt_tokens=prompt_tokens, positions=positions,
                      lengths=_ints(passkey_lengths, "--passkey-lengths"),
                      depths=_floats(passkey_depths, "--passkey-depths"), trials=trials, tau=tau, window=window,
                      sinks=sinks, dtype=dtype, centroids=centroids, threads=threads, seed=seed, max_select=max_select,
                      passkey_haystack=passkey_haystack, passkey_copies=passkey_copies, kv_values=(kv_values,), **opts,
                      log=lambda s: click.echo(s, err=True))
    report["data"] = source
    click.echo(json.dumps(report, indent=1) if output == "json" else format_markdown(report, data=source))
