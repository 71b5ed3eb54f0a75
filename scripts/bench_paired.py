"""Decode speed of several KV modes at one depth, in alternating rounds (paired comparison).

Usage:
  python scripts/bench_paired.py models/SmolLM2-135M-Instruct --depth 16384 -n 32 --rounds 7 \
      --modes dense,hca:0.125,hca:0.25,hca:g64c16:q4 [--dtype float32] [--context random|text|FILE] [-o json]
      [--hca-opt KEY=VALUE ...] [--prompt-cache DIR]
(hca:SETTING:VALUES: the store's values as kv_values, float, q8 or q4; default auto, the engine's own
(q8 on a CPU where the head size allows, float on a GPU). --prompt-cache:
each mode's prompt cache of the context is written into DIR and its size reported, one prefill
serving both measures. --dense-fill random: a dense mode's cache is filled with random keys and
values for the context's positions instead of prefilled: dense decoding reads every key and value
whatever they hold, so its speed is the same, without the quadratic prefill (about an hour at 64K
tokens on 2 cores); its answers mean nothing, so no quality is measured that way.)

`minirun bench` runs one mode after the other; on a shared machine whose speed drifts by 10-25%
within minutes that can decide a close comparison by itself. Here every engine is loaded and filled with
the same context once (minirun.tools.bench.Context: random token ids, the built-in natural text, or a
text file's tokens; HCA's selection, and so its speed, depends on it), then each round decodes n
tokens in every mode back to back, in reversed order every other round (greedy, EOS ignored, the
cache rewound to the context after each round). Reports the median tok/s per mode and the median
of the per-round ratios to the first mode, with min and max. Needs memory for all engines at once.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from minirun import Engine
from minirun.tools.bench import Context, device_name, selected_share
from minirun.cli.common import HCA_OPT_HELP, parse_hca_opts
from minirun.config import hca_setting, hca_setting_name
from minirun.errors import MiniRunError


def parse_modes(s: str) -> list[tuple[str, str | None, str]]:
    """"dense,hca:0.125,hca:g64c16:q4" -> [("dense", None, "auto"), ("hca", "0.125", "auto"),
    ("hca", "g64c16", "q4")]."""
    out = []
    for m in s.split(","):
        kind, _, rest = m.strip().partition(":")
        setting, _, values = rest.partition(":")
        out.append((kind, hca_setting_name(setting) if setting else None, values or "auto"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--depth", type=int, default=16384)
    ap.add_argument("-n", type=int, default=32, help="tokens decoded per round and mode")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--modes", default="dense,hca:0.125", help="dense, hca:BUDGET or hca:gGcC (explicit codebooks, e.g. "
                                                                  "hca:g64c16), comma-separated")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--context", default="random", help="random (token ids), text (the stdlib's pydoc topics) or a "
                                                        "text file")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--far-positions", default="auto", choices=["auto", "on", "grouped", "off"],
                    help="HCA: far positions (auto: on past the model's trained context)")
    ap.add_argument("--hca-opt", action="append", default=[], help="HCA: " + HCA_OPT_HELP)
    ap.add_argument("--prompt-cache", default=None, metavar="DIR",
                    help="write each mode's prompt cache of the context into DIR (a new file per mode) and "
                         "report its bytes")
    ap.add_argument("--dense-fill", default="prefill", choices=["prefill", "random"],
                    help="dense modes: prefill the context, or fill the cache with random K/V (speed only)")
    ap.add_argument("-o", "--output", choices=["text", "json"], default="text",
                    help="json: the figures as one JSON object on stdout (the rounds go to stderr)")
    a = ap.parse_args()
    say = (lambda *x, **k: print(*x, **k, file=sys.stderr)) if a.output == "json" else print
    try:
        context = Context(a.context)
        modes = parse_modes(a.modes)
        opts = parse_hca_opts(a.hca_opt)
    except MiniRunError as e:
        raise SystemExit(f"error: {e}") from None
    engines, file_bytes = [], {}
    for kind, budget, values in modes:
        kw = {**hca_setting(budget), "far_positions": a.far_positions, "kv_values": values, **opts} if budget else {}
        eng = Engine.load(a.model, device="cpu", dtype=a.dtype, ctx=a.depth + a.n + 8, kv=kind, threads=a.threads,
                          **kw)
        ids = context.ids(eng, a.depth, seed=0)
        t0 = time.perf_counter()
        if kind == "dense" and a.dense_fill == "random":
            fill_random_kv(eng, ids)
        else:
            eng.prefill(ids)
        name = kind + (f" {budget}" if budget else "") + ("" if values == "auto" else f" {values}")
        say(f"{name}: context of {a.depth} tokens prefilled in {time.perf_counter() - t0:.0f}s", flush=True)
        if a.prompt_cache:
            file_bytes[name] = write_prompt_cache(eng, Path(a.prompt_cache), name)
            say(f"{name}: prompt cache {file_bytes[name]} bytes", flush=True)
        engines.append((name, eng, ids))
    tps = {name: [] for name, _, _ in engines}
    for r in range(a.rounds + 1):                 # round 0 warms up and is dropped
        row = []
        for name, eng, ids in (engines if r % 2 == 0 else engines[::-1]):   # ABBA: no mode always first
            t = decode_round(eng, ids, a.n)
            row.append(f"{name} {t:.2f}")
            if r:
                tps[name].append(t)
        say(f"round {r}{' (warm-up)' if r == 0 else ''}: " + " | ".join(row), flush=True)
    selected = {name: selected_share(eng, ids) for name, eng, ids in engines}
    base = engines[0][0]
    rows = []
    for name in tps:
        xs = tps[name]
        ratios = [x / b for x, b in zip(xs, tps[base])]
        rows.append({"mode": name, "tps_median": statistics.median(xs), "tps_min": min(xs), "tps_max": max(xs),
                     "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "selected": selected[name], "prompt_cache_bytes": file_bytes.get(name)})
    if a.output == "json":
        print(json.dumps({"test": f"tg{a.n} @ d{a.depth}", "dtype": a.dtype, "rounds": a.rounds, "context": context.name,
                          "dense_fill": a.dense_fill,
                          "device_name": device_name(torch.device("cpu")), "threads": torch.get_num_threads(),
                          "base": base, "rows": rows}, indent=1))
        return
    print(f"\ntg{a.n} @ d{a.depth}, {a.dtype}, {a.rounds} rounds; tok/s median (min, max); ratio to {base} per round:")
    for r in rows:
        sel = "" if r["selected"] is None else f"   selected {100 * r['selected']:.1f}% of the store"
        sel += "" if r["prompt_cache_bytes"] is None else f"   prompt cache {r['prompt_cache_bytes']} bytes"
        print(f"  {r['mode']:10s} {r['tps_median']:.2f} ({r['tps_min']:.2f}, {r['tps_max']:.2f})   "
              f"x{r['ratio_median']:.2f} ({r['ratio_min']:.2f}, {r['ratio_max']:.2f}){sel}")


@torch.inference_mode()
def fill_random_kv(eng, ids: list[int]) -> None:
    """A dense cache holding len(ids) positions of random keys and values, the engine taking them
    for ids (decode_round's prefill then recomputes only the last token): --dense-fill random."""
    c, n = eng.cache, len(ids)
    g = torch.Generator().manual_seed(0)
    for layer in range(c.k.shape[0]):          # (a layer at a time: no [L, Hkv, n, hd] float32 temporary)
        for t in (c.k, c.v):
            t[layer, :, :n] = torch.randn(t[layer, :, :n].shape, generator=g).to(t.dtype)
    c.offset = n
    eng._cached_ids = list(ids)


def write_prompt_cache(eng, directory: Path, name: str) -> int:
    """Saves eng's prompt cache as DIRECTORY/<name>.kv (never over an existing file); returns its bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (name.replace(" ", "-") + ".kv")
    if path.exists():
        raise SystemExit(f"error: {path} exists; give --prompt-cache a new directory")
    return eng.save_prompt_cache(path)


def decode_round(eng, ids: list[int], n: int) -> float:
    """n greedy decode steps after the context `ids` (already in the cache: its prefill is a
    prefix reuse, not timed); the cache is rewound to the context afterwards. Returns tok/s."""
    logits, _ = eng.prefill(ids)
    tok = int(logits[-1].argmax())
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(eng.step(tok)[-1].argmax())
    dt = time.perf_counter() - t0
    eng.rewind(len(ids))
    return n / dt


if __name__ == "__main__":
    main()
