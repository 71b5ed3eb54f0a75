"""`minirun calibrate` and `minirun eval`: thin click commands over minirun.calibrate and minirun.evaluate."""
from __future__ import annotations

import json
from pathlib import Path

import click

from .errors import MiniRunError


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--data", type=click.Path(path_type=Path), default=None,
              help="calibration text (default: the stdlib's pydoc topics, first half)")
@click.option("--kv-budget", type=click.Choice(["0.25", "0.125"]), default="0.125", show_default=True,
              help="preset giving the groups (0.25: head_dim/2, 0.125: head_dim/4)")
@click.option("--groups", type=int, default=None, help="sub-vectors per key (overrides --kv-budget)")
@click.option("--centroids", type=int, default=1024, show_default=True)
@click.option("--tokens", type=int, default=16384, show_default=True, help="keys per (layer, kv-head) to fit on")
@click.option("--iters", type=int, default=40, show_default=True, help="mini-batch k-means steps")
def calibrate(model, data, kv_budget, groups, centroids, tokens, iters):
    """Fit key codebooks on text and write codebooks-g{G}-c{C}.safetensors into MODEL."""
    from .calibrate import calibrate as run
    from .config import ModelArgs
    hd = ModelArgs.from_path(model).head_dim
    g = groups or {"0.25": hd // 2, "0.125": hd // 4}[kv_budget]
    path = run(model, g, centroids, data=data, tokens=tokens, iters=iters, log=lambda s: click.echo(s, err=True))
    click.echo(str(path))


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--data", type=click.Path(path_type=Path), default=None,
              help="evaluation text (default: the stdlib's pydoc topics, second half)")
@click.option("--kv-budget", "budgets", default="0.5,0.25,0.125", show_default=True, help="HCA budgets to compare")
@click.option("--ppl-tokens", type=int, default=4096, show_default=True, help="0 skips perplexity")
@click.option("--prompt-tokens", type=int, default=3072, show_default=True)
@click.option("--positions", type=int, default=256, show_default=True, help="0 skips agreement/KL")
@click.option("--passkey-lengths", default="1024,2048,4096,7168", show_default=True, help="empty skips passkey")
@click.option("--passkey-depths", default="0.1,0.5,0.9", show_default=True)
@click.option("--trials", type=int, default=1, show_default=True)
@click.option("--tau", type=float, default=0.9, show_default=True)
@click.option("--window", type=int, default=256, show_default=True)
@click.option("--sinks", type=int, default=16, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("-o", "--output", type=click.Choice(["md", "json"]), default="md", show_default=True)
def eval_cmd(model, data, budgets, ppl_tokens, prompt_tokens, positions, passkey_lengths, passkey_depths, trials,
             tau, window, sinks, dtype, output):
    """Dense vs HCA on the same inputs: perplexity, top-1 agreement and KL, passkey accuracy."""
    from .calibrate import read_text
    from .engine import Engine
    from .evaluate import agreement, passkey, perplexity
    text, source = read_text(data, part="evaluation")
    lengths = [int(x) for x in passkey_lengths.split(",") if x.strip()]
    depths = [float(x) for x in passkey_depths.split(",") if x.strip()]
    need = max([ppl_tokens, prompt_tokens + positions] + lengths) + 64
    modes = [("dense", None)] + [("hca", float(b)) for b in budgets.split(",") if b.strip()]
    engines = {m: Engine.load(model, device="cpu", dtype=dtype, ctx=need, kv=m[0], tau=tau, window=window,
                              sinks=sinks, **({"kv_budget": m[1]} if m[1] else {})) for m in modes}
    ids = engines[modes[0]].tokenize(text)
    if len(ids) < max(ppl_tokens, prompt_tokens + positions):
        raise MiniRunError(f"evaluation text has {len(ids)} tokens; need {max(ppl_tokens, prompt_tokens + positions)}")
    rows = []
    for m in modes:
        eng, name = engines[m], m[0] if m[1] is None else f"hca {m[1]}"
        row = {"mode": name}
        click.echo(f"eval: {name} ...", err=True)
        if ppl_tokens:
            row["ppl"] = perplexity(eng, ids[:ppl_tokens])
        if positions and m[1] is not None:
            row.update(agreement(engines[modes[0]], eng, ids[:prompt_tokens],
                                 ids[prompt_tokens:prompt_tokens + positions]))
        if lengths:
            row["passkey"] = passkey(eng, lengths, depths, trials)
        cb = getattr(eng.cache, "codebooks", None)
        row["codebooks"] = "-" if cb is None else cb.source
        rows.append(row)
    report = {"model": str(model), "data": source, "tau": tau, "window": window, "sinks": sinks, "rows": rows}
    click.echo(json.dumps(report, indent=2) if output == "json" else format_eval(report))


def format_eval(r: dict) -> str:
    dense = r["rows"][0].get("ppl")
    lines = [f"data: {r['data']}; tau {r['tau']}, window {r['window']}, sinks {r['sinks']}", "",
             "| mode | ppl | vs dense | top-1 agreement | mean KL | passkey (all cells) | codebooks |",
             "|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        ppl = row.get("ppl")
        rel = f"{100 * (ppl / dense - 1):+.2f}%" if ppl and dense else "-"
        pk = row.get("passkey", [])
        acc = f"{sum(c['accuracy'] for c in pk) / len(pk):.2f}" if pk else "-"
        lines.append(f"| {row['mode']} | {ppl:.3f} | {rel} | {row.get('top1_agreement', '-')} | "
                     f"{row.get('mean_kl', '-')} | {acc} | {row['codebooks']} |" if ppl else
                     f"| {row['mode']} | - | - | {row.get('top1_agreement', '-')} | {row.get('mean_kl', '-')} | {acc} | {row['codebooks']} |")
    pk_rows = [row for row in r["rows"] if row.get("passkey")]
    if pk_rows:
        cells = [(c["length"], c["depth"]) for c in pk_rows[0]["passkey"]]
        lines += ["", "| passkey length, depth | " + " | ".join(row["mode"] for row in pk_rows) + " |",
                  "|---|" + "---|" * len(pk_rows)]
        for i, (n, d) in enumerate(cells):
            lines.append(f"| {n}, {d} | " + " | ".join(f"{row['passkey'][i]['accuracy']:.2f}" for row in pk_rows) + " |")
    return "\n".join(lines)
