"""Pieces shared by the click commands (kept apart from main.py, which defines them)."""
from __future__ import annotations

import functools
import math

import click

from ..config import MAX_CTX, MAX_THREADS, WEIGHTS, parse_ctx
from ..errors import MiniRunError


class CtxType(click.ParamType):
    """--ctx: an integer with an optional binary K/M suffix (32K = 32768, 4M = 4194304)."""
    name = "ctx"

    def convert(self, value, param, ctx):
        try:
            return parse_ctx(value)
        except MiniRunError as e:
            self.fail(str(e), param, ctx)


CTX = CtxType()


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses nan and inf (nan compares false with every bound)."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv


# numeric options' ranges, checked where click parses them: before any model is loaded. Every one
# has an upper bound (a number past a C long was an OverflowError deep in torch): token counts at
# most MAX_CTX, threads at most this machine's CPUs, repetitions and such at most MAX_COUNT.
MAX_COUNT = 1_000_000
AT_LEAST_1 = click.IntRange(1, MAX_CTX)          # tokens
AT_LEAST_0 = click.IntRange(0, MAX_CTX)
COUNT = click.IntRange(1, MAX_COUNT)            # repetitions, trials, iterations, copies
THREADS = click.IntRange(1, MAX_THREADS)
SEED = click.IntRange(min=0, max=2**64 - 1)          # (torch.Generator.manual_seed's range)
TAU = FiniteFloatRange(0.0, 1.0, min_open=True)


# EngineConfig fields reached through --hca-opt KEY=VALUE (repeatable): what the product flags do not
# cover. The README's option table lists these.
ADVANCED = {
    "rescore": "true: keep the store's keys on the host too and weight the selected tokens by exact scores "
               "(codebooks only select; twice the host memory)",
    "far_positions": "auto | on | grouped | off: tokens older than the window attended at one distance (on) or "
                     "at compressed distances (grouped); auto: on when --ctx passes the trained context",
    "far_distance": "that one distance, in tokens (default: the window, at most a quarter of the trained context)",
    "length_scale": "auto | on | off: attention logits x log(n) / log(trained context) past it",
    "head_budgets": "auto | off: with far positions on, each head's own cap on the old tokens it reads, where "
                    "minirun calibrate --unrotated measured them",
    "value_sum": "auto | gpu | host: on a GPU, where the selected values are summed (gpu: a kernel reads the "
                 "mapped host pool; auto: gpu unless rescore)",
    "cuda_graphs": "true | false: on a GPU, each decode token replayed from a CUDA graph where the cache allows",
    "key_store": "codebook | exact: the store's keys as codebook indices or in full precision",
    "prefill_mode": "auto | exact | anchor | hca: how a prompt attends to old tokens (auto: exact up to "
                    "exact_prefill_max tokens, anchor beyond)",
    "exact_prefill_max": "tokens: the longest prompt auto prefills exactly (default: the trained context on a "
                         "CPU, 64K on a GPU)",
    "anchor_tokens": "tokens: the first tokens every chunk of an anchor prefill attends to exactly",
    "prefill_chunk": "tokens per prefill forward (default: 512 on a CPU, 4096 on a GPU)",
    "fit_min_tokens": "without calibrated codebooks: fit them once this many keys are in the store",
}


def parse_hca_opts(items) -> dict:
    """["rescore=true", "far_positions=on", ...] -> EngineConfig keyword arguments, each value
    converted to its field's type; an unknown key or a bad value is a one-line MiniRunError."""
    from dataclasses import fields

    from ..config import EngineConfig
    types = {f.name: str(f.type) for f in fields(EngineConfig)}
    out = {}
    for item in items or ():
        key, eq, raw = str(item).partition("=")
        key, raw = key.strip().replace("-", "_"), raw.strip()
        if not eq or key not in ADVANCED:
            raise MiniRunError(f"--hca-opt {item!r}: expected KEY=VALUE with KEY one of {', '.join(ADVANCED)}")
        t = types[key]
        try:
            if raw.lower() == "none" and "None" in t:
                out[key] = None
            elif t.startswith("bool"):
                if raw.lower() not in ("true", "false", "1", "0", "on", "off", "yes", "no"):
                    raise ValueError
                out[key] = raw.lower() in ("true", "1", "on", "yes")
            elif t.startswith("int"):
                out[key] = int(raw)
            else:
                out[key] = raw
        except ValueError:
            raise MiniRunError(f"--hca-opt {key}: {raw!r} is not a valid {t.split(' ')[0]}") from None
    return out


HCA_OPT_HELP = ("an advanced engine setting, KEY=VALUE (repeatable): " + ", ".join(ADVANCED) +
                " (README: options)")


def hca_opts_callback(ctx, param, value) -> dict:
    """--hca-opt's values -> a dict of EngineConfig settings, each checked as EngineConfig checks it:
    a bad one is a usage error (exit 2) before any model is loaded."""
    from ..config import EngineConfig
    try:
        opts = parse_hca_opts(value)
        EngineConfig(**opts)
    except MiniRunError as e:
        raise click.BadParameter(str(e).removeprefix("--hca-opt "), ctx, param) from None
    return opts


def threads_option():
    return click.option("--threads", type=THREADS, default=None,
                        help=f"CPU threads for torch and the kernels (at most this machine's {MAX_THREADS})")


def hca_opt_option(help_text: str = HCA_OPT_HELP):
    """--hca-opt, and on the command it decorates the warning of warn_idle_settings before it runs:
    every command that takes engine settings takes --hca-opt, so they are all checked here."""
    option = click.option("--hca-opt", "hca_opts", multiple=True, metavar="KEY=VALUE", callback=hca_opts_callback,
                          help=help_text)

    def deco(f):
        @functools.wraps(f)         # (keeps the click parameters declared below this one)
        def checked(*args, **kw):
            warn_idle_settings(click.get_current_context(), kw)
            return f(*args, **kw)
        return option(checked)
    return deco


# the flags that are EngineConfig fields: parameter name -> (field, how the flag is spelt)
_FLAG_FIELDS = {"kv_budget": ("kv_budget", "--kv-budget"), "budgets": ("kv_budget", "--kv-budget"),
                "tau": ("tau", "--tau"), "window": ("window", "--window"), "sinks": ("sinks", "--sinks"),
                "max_select": ("max_select", "--max-select")}


def device_type(kw: dict) -> str:
    """--device as the engine resolves it ("auto": cuda when torch sees a GPU; plan's --gpu-mem: cuda)."""
    device = str(kw.get("device") or "auto")
    if device == "auto":
        if kw.get("gpu_mem") is not None:
            return "cuda"
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"


def warn_idle_settings(ctx: click.Context, kw: dict) -> None:
    """One line on stderr for each setting given on the command line that changes nothing in the
    mode chosen (config.idle_settings): an HCA setting with --kv dense, a GPU one on a CPU, ..."""
    from click.core import ParameterSource

    from ..config import EngineConfig, hca_setting, idle_settings
    modes = kw.get("kv", kw.get("kv_modes"))
    if modes is None:               # (eval: always dense against HCA)
        return
    settings, spelt = dict(kw.get("hca_opts") or {}), {}
    for key, value in settings.items():
        spelt[key] = f"--hca-opt {key}={str(value).lower() if isinstance(value, bool) else value}"
    try:
        for param, (field, flag) in _FLAG_FIELDS.items():
            if param in kw and ctx.get_parameter_source(param) == ParameterSource.COMMANDLINE:
                given = hca_setting(str(kw[param]).split(",")[0]) if field == "kv_budget" else {field: kw[param]}
                settings.update(given)
                spelt.update({name: f"{flag} {kw[param]}" for name in given})
        kv = "hca" if "hca" in [m.strip() for m in str(modes).split(",")] else "dense"
        cfg = EngineConfig(kv=kv, **settings)
    except MiniRunError:            # (a bad value: the command says so itself)
        return
    lines = {f"minirun: warning: {spelt[name]} does nothing {why}"
             for name, why in idle_settings(cfg, list(spelt), device_type(kw))}
    for line in sorted(lines):
        click.echo(line, err=True)


def kv_values_option(f):
    """--kv-values, shared by every command that makes or plans an HCA cache."""
    return click.option("--kv-values", type=click.Choice(["auto", "float", "q8", "q4"]), default="auto",
                        show_default=True,
                        help="HCA: the store's values in host memory: float (float16; float32 runs: float32), "
                             "q8 / q4 codes per 32 channels (0.53x / 0.31x float16's bytes), or auto: q8 on the "
                             "CPU, float on a GPU")(f)


def engine_options(f):
    """The product flags of every command that loads a model, and --hca-opt for the rest."""
    opts = [
        click.option("--ctx", type=CTX, default="8K", show_default=True, help="context size in tokens (K/M suffixes: 4M = 4194304)"),
        click.option("--device", default="auto", show_default=True, help="cpu, cuda or auto"),
        click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True),
        click.option("--weights", type=click.Choice(WEIGHTS), default="stored", show_default=True,
                     help="weight matrices: as the checkpoint stores them (GGUF blocks stay blocks), dequantized "
                          "to --dtype, or a float checkpoint quantized at load (embedding and LM head Q8_0)"),
        click.option("--kv", type=click.Choice(["dense", "hca"]), default="dense", show_default=True, help="KV cache policy"),
        click.option("--kv-budget", default="0.25", show_default=True,
                     help="HCA key store: a device-memory preset relative to dense (0.5, 0.25, 0.125) or "
                          "gGcC codebooks (g64c16: 4-bit codes, fast on CPUs with AVX2)"),
        click.option("--tau", type=TAU, default=0.9, show_default=True, help="HCA: attention mass kept per head"),
        click.option("--window", type=AT_LEAST_1, default=256, show_default=True, help="HCA: recent tokens kept exact"),
        click.option("--sinks", type=AT_LEAST_0, default=16, show_default=True, help="HCA: first tokens kept exact"),
        click.option("--max-select", type=AT_LEAST_1, default=None,
                     help="HCA: attend to at most this many old tokens per head and step, the top-scoring "
                          "(bounds decode time where attention is diffuse; default: tau alone)"),
        kv_values_option,
        threads_option(),
        hca_opt_option(),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def sampling_options(temperature: float, max_tokens: int):
    def deco(f):
        opts = [
            click.option("-n", "--max-tokens", type=AT_LEAST_0, default=max_tokens, show_default=True),
            click.option("--temperature", "--temp", type=FiniteFloatRange(min=0.0), default=temperature, show_default=True),
            click.option("--top-k", type=AT_LEAST_0, default=0, show_default=True),
            click.option("--top-p", type=FiniteFloatRange(0.0, 1.0, min_open=True), default=1.0 if temperature == 0 else 0.9, show_default=True),
            click.option("--min-p", type=FiniteFloatRange(0.0, 1.0, max_open=True), default=0.0, show_default=True),
            click.option("--repetition-penalty", type=FiniteFloatRange(min=0.0, min_open=True), default=1.0, show_default=True),
            click.option("--seed", type=SEED, default=None),
            click.option("--ignore-eos", is_flag=True, help="keep generating past end-of-sequence tokens"),
        ]
        for o in reversed(opts):
            f = o(f)
        return f
    return deco


def engine_settings(ctx, device, dtype, kv, kv_budget, tau, window, sinks, threads, max_select=None,
                    hca_opts=None, weights="stored", kv_values="auto", **extra) -> dict:
    """The engine options' values -> Engine.load's keywords (every one an EngineConfig field)."""
    from ..config import hca_setting
    return dict(device=device, dtype=dtype, ctx=ctx, kv=kv, tau=tau, window=window, sinks=sinks, threads=threads,
                max_select=max_select, weights=weights, kv_values=kv_values, **hca_setting(kv_budget),
                **(hca_opts or {}), **extra)


def load_engine(model, **options):
    """Engine.load with the engine options (engine_settings), and the trained-context note."""
    from ..engine import Engine
    kv = options["kv"]
    eng = Engine.load(model, **engine_settings(**options))
    far = getattr(eng.cache, "far", False)
    note = trained_context_note(eng.args.max_position_embeddings, eng.config.ctx, far, hca=kv == "hca")
    if note:
        click.echo(note, err=True)
    return eng


def trained_context_note(trained: int | None, ctx: int, far: bool = False, hca: bool = False) -> str | None:
    """One line when --ctx reaches past the context the model was trained on (config.json's
    max_position_embeddings) and nothing keeps the distances inside it: answers degrade once a
    conversation is longer (SmolLM2, 8K: the pass key is lost past ~8K tokens with dense attention;
    docs/QUALITY.md). The HCA cache's far positions (kv/far_positions.py) are that something."""
    if trained is None or ctx <= trained or far:
        return None
    fix = "--hca-opt far_positions=auto or on may help" if hca else "--kv hca attends past it with far positions"
    return (f"minirun: note: --ctx {ctx} is past the {trained} tokens this model was trained on; expect "
            f"answers to degrade once the conversation is longer than that ({fix})")


def split_kwargs(kw: dict):
    """Separate engine options from sampling options."""
    engine_keys = ("ctx", "device", "dtype", "weights", "kv", "kv_budget", "tau", "window", "sinks", "max_select",
                   "kv_values", "threads", "hca_opts")
    eng = {k: kw.pop(k) for k in engine_keys}
    sampling = dict(temperature=kw.pop("temperature"), top_k=kw.pop("top_k"), top_p=kw.pop("top_p"),
                    min_p=kw.pop("min_p"), repetition_penalty=kw.pop("repetition_penalty"), seed=kw.pop("seed"),
                    ignore_eos=kw.pop("ignore_eos"))
    return eng, sampling
