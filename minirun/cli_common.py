"""Pieces shared by the click commands (kept apart from cli.py so `python -m minirun.cli` works)."""
from __future__ import annotations

import click

from .config import WEIGHTS, parse_ctx
from .errors import MiniRunError


class CtxType(click.ParamType):
    """--ctx: an integer with an optional binary K/M suffix (32K = 32768, 4M = 4194304)."""
    name = "ctx"

    def convert(self, value, param, ctx):
        try:
            return parse_ctx(value)
        except MiniRunError as e:
            self.fail(str(e), param, ctx)


CTX = CtxType()


def engine_options(f):
    """Options shared by every command that loads a model."""
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
        click.option("--tau", type=float, default=0.9, show_default=True, help="HCA: attention mass kept per head"),
        click.option("--window", type=int, default=256, show_default=True, help="HCA: recent tokens kept exact"),
        click.option("--sinks", type=int, default=16, show_default=True, help="HCA: first tokens kept exact"),
        click.option("--far-positions", type=click.Choice(["auto", "on", "grouped", "off"]), default="auto", show_default=True,
                     help="HCA: attend to tokens older than the window at one distance (1024), or grouped: at "
                          "their distances compressed to fit the model's trained context, for contexts past it "
                          "(auto: on when --ctx passes it); see docs/QUALITY.md"),
        click.option("--length-scale", type=click.Choice(["auto", "on", "off"]), default="off", show_default=True,
                     help="HCA: scale attention logits by log(n) / log(trained context) past the trained "
                          "context (auto: on when --ctx passes it); see docs/QUALITY.md"),
        click.option("--max-select", type=int, default=None,
                     help="HCA: attend to at most this many old tokens per head and step, the top-scoring "
                          "(bounds decode time where attention is diffuse; default: tau alone)"),
        click.option("--rescore", is_flag=True,
                     help="HCA: keep the old tokens' keys on the host beside their values and weight the "
                          "selected tokens by exact scores (codebooks only select): answers closer to dense "
                          "attention for twice the host memory; see docs/QUALITY.md"),
        click.option("--threads", type=int, default=None, help="CPU threads for torch"),
        click.option("--cuda-graphs", is_flag=True,
                     help="GPU: replay decode tokens from CUDA graphs: a dense token in one launch instead of "
                          "hundreds, an HCA token's layers around its attention (see docs/DESIGN.md)"),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def sampling_options(temperature: float, max_tokens: int):
    def deco(f):
        opts = [
            click.option("-n", "--max-tokens", type=int, default=max_tokens, show_default=True),
            click.option("--temperature", "--temp", type=float, default=temperature, show_default=True),
            click.option("--top-k", type=int, default=0, show_default=True),
            click.option("--top-p", type=float, default=1.0 if temperature == 0 else 0.9, show_default=True),
            click.option("--min-p", type=float, default=0.0, show_default=True),
            click.option("--repetition-penalty", type=float, default=1.0, show_default=True),
            click.option("--seed", type=int, default=None),
            click.option("--ignore-eos", is_flag=True, help="keep generating past end-of-sequence tokens"),
        ]
        for o in reversed(opts):
            f = o(f)
        return f
    return deco


def load_engine(model, ctx, device, dtype, kv, kv_budget, tau, window, sinks, threads, far_positions="auto",
                max_select=None, length_scale="off", rescore=False, cuda_graphs=False, weights="stored", **extra):
    from .engine import Engine
    from .config import hca_setting
    eng = Engine.load(model, device=device, dtype=dtype, ctx=ctx, kv=kv, tau=tau, window=window, sinks=sinks,
                      threads=threads, far_positions=far_positions, max_select=max_select, length_scale=length_scale,
                      rescore=rescore, cuda_graphs=cuda_graphs, weights=weights, **hca_setting(kv_budget),
                      **extra)
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
    fix = "--far-positions auto or on may help" if hca else "--kv hca attends past it with far positions"
    return (f"minirun: note: --ctx {ctx} is past the {trained} tokens this model was trained on; expect "
            f"answers to degrade once the conversation is longer than that ({fix})")


def split_kwargs(kw: dict):
    """Separate engine options from sampling options."""
    engine_keys = ("ctx", "device", "dtype", "weights", "kv", "kv_budget", "tau", "window", "sinks", "far_positions",
                   "max_select", "length_scale", "rescore", "threads", "cuda_graphs")
    eng = {k: kw.pop(k) for k in engine_keys}
    sampling = dict(temperature=kw.pop("temperature"), top_k=kw.pop("top_k"), top_p=kw.pop("top_p"),
                    min_p=kw.pop("min_p"), repetition_penalty=kw.pop("repetition_penalty"), seed=kw.pop("seed"),
                    ignore_eos=kw.pop("ignore_eos"))
    return eng, sampling
