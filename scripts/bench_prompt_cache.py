"""Prefill a document against saving and loading its prompt cache (minirun/prompt_cache.py).

    python scripts/bench_prompt_cache.py MODEL --tokens 16384 [--kv hca --kv-budget g64c16 --kv-values q4] [--context FILE]

Prefills the first --tokens tokens of a text (Botchan by default, as the quality tools), writes the
prompt cache, loads it into a second engine of the same setup and checks that both decode the same
next 4 tokens' logits. Prints one markdown row: tokens, prefill s, write s, file size, load s.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_quality  # noqa: E402
from minirun import Engine  # noqa: E402
from minirun.config import hca_setting  # noqa: E402
from minirun.planner import format_bytes  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--kv", default="hca", choices=["dense", "hca"])
    ap.add_argument("--kv-budget", default="g64c16")
    ap.add_argument("--kv-values", default="auto", choices=["auto", "float", "q8", "q4"], help="HCA: the store's values")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--context", default=None, help="a text file (default: Botchan, fetched once)")
    ap.add_argument("--dir", default=None, help="where the file goes (default: a temporary directory)")
    a = ap.parse_args(argv)
    kw = dict(device=a.device, dtype=a.dtype, ctx=a.tokens + 64, kv=a.kv)
    if a.kv == "hca":
        kw.update(hca_setting(a.kv_budget), kv_values=a.kv_values)
    text = Path(a.context).read_text() if a.context else eval_quality.read_text(eval_quality.fetch_botchan(),
                                                                                part="evaluation")[0]
    first = Engine.load(a.model, **kw)
    ids = first.tokenize(text)
    if len(ids) < a.tokens:
        ids = (ids * (a.tokens // len(ids) + 1))
    ids = ids[:a.tokens]
    t0 = time.perf_counter()
    first.prefill(ids)
    prefill_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        path = Path(tmp) / "doc.kv"
        t0 = time.perf_counter()
        nbytes = first.save_prompt_cache(path)
        write_s = time.perf_counter() - t0
        second = Engine.load(a.model, **kw)
        t0 = time.perf_counter()
        second.load_prompt_cache(path, ids)
        load_s = time.perf_counter() - t0
    nxt = ids[:4]
    same = all(torch.equal(first.step(t), second.step(t)) for t in nxt)
    print("| tokens | kv | values | prefill s | write s | file | bytes | load s | next logits equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {len(ids)} | {a.kv} {a.kv_budget if a.kv == 'hca' else ''} | {a.kv_values if a.kv == 'hca' else '-'} | "
          f"{prefill_s:.1f} | {write_s:.2f} | {format_bytes(nbytes)} | {nbytes} | {load_s:.2f} | {same} |")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
