"""Head-budget rules side by side past the trained context: one prefill per passkey prompt, then
each rule's question, answer and decode speed on that same cache.

Usage:
  python scripts/head_budget_rules.py MODEL --tokens 16384 [--kv hca|dense] [--rules off,1024,256]
         [--measured FILE.npz] [--threads 2] [--json out.json]

Prompts: eval_quality's passkey (a 5-digit key in Botchan's text, at depths 0.3 and 0.7). For each,
the text before the question is prefilled once (as the engine prefills a prompt: anchor past
exact_prefill_max), then per rule the cache is rewound there, the question fed token by token
and 24 tokens decoded greedily (the answer: the first 10; decode tok/s: the median step). Rules
(HCACache.set_head_caps): "off" (tau alone), an integer (every head's cap: head_budgets.default_caps),
"measured" / "lostX" (head_budgets.caps_from on --measured's masses, X the lost share). The
selection share is the mean share of the store each query head kept over the decoded steps.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from minirun import Engine  # noqa: E402
from minirun.kv import head_budgets as hb  # noqa: E402
from minirun.tools.evaluate import passkey_prompt, prose_haystack  # noqa: E402


def caps_of(rule: str, L: int, Hq: int, measured: Path | None):
    """A rule's caps [L, Hq] (None: tau alone)."""
    if rule == "off":
        return None
    if rule == "measured" or rule.startswith("lost"):
        d = np.load(measured)
        return hb.caps_from(d["store_share"], d["captured"], lost=float(rule[4:]) if rule != "measured"
                            else hb.LOST_MASS)
    return hb.default_caps(L, Hq, int(rule))


def run_rule(eng, ids, q, key, steps: int = 24, answer_tokens: int = 10) -> dict:
    """Rewind to q, feed ids[q:], decode `steps` greedily -> the answer, whether it holds the key,
    the median step's tok/s and the selection share."""
    c = eng.cache
    if hasattr(c, "record_selection"):
        c.record_selection = []
    eng.rewind(q)
    for tok in ids[q:]:
        logits = eng.step(tok)
    out, times = [], []
    for i in range(steps):
        tok = int(logits[-1].argmax())
        if i < answer_tokens:
            out.append(tok)
        t = time.perf_counter()
        logits = eng.step(tok)
        times.append(time.perf_counter() - t)
    ans = eng.detokenize(out)
    sel = getattr(c, "record_selection", None)
    return {"answer": ans.strip()[:40], "ok": str(key) in re.sub(r"\D", "", ans), "tps_median": 1 / float(np.median(times)),
            "selected": float(np.mean([x.mean() for x in sel])) if sel else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--kv", default="hca", choices=["hca", "dense"])
    ap.add_argument("--kv-budget", default="g64c16")
    ap.add_argument("--rules", default="off,1024,256")
    ap.add_argument("--measured", type=Path, default=None, help="head_budgets.measure's masses (npz)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    from eval_quality import fetch_botchan
    from minirun.config import hca_setting
    kw = dict(hca_setting(a.kv_budget), kv_budget=None) if a.kv == "hca" else {}
    eng = Engine.load(a.model, device="cpu", ctx=a.tokens + 512, kv=a.kv, threads=a.threads, **kw)
    text_ids = eng.tokenize(fetch_botchan().read_text())
    hay = prose_haystack(eng, text_ids, a.tokens - 60, copies=a.tokens // 8192 + 1)
    L, Hq = eng.args.num_hidden_layers, eng.args.num_attention_heads
    rows = []
    for depth, key in ((0.3, 48213), (0.7, 71946)):
        ids, q = passkey_prompt(eng, a.tokens, depth, key, haystack=hay)
        eng.reset()
        t = time.perf_counter()
        eng.prefill(ids[:q])
        pf = time.perf_counter() - t
        print(f"depth {depth}: prefill {q} tokens in {pf:.1f} s ({eng.last_prefill['mode']})", file=sys.stderr)
        for rule in (a.rules.split(",") if a.kv == "hca" else ["dense"]):
            if a.kv == "hca":
                eng.cache.set_head_caps(caps_of(rule, L, Hq, a.measured))
            r = {"N": a.tokens, "depth": depth, "kv": "dense" if a.kv == "dense" else f"hca {a.kv_budget}",
                 "rule": rule, "prefill_s": pf, "prefill_mode": eng.last_prefill["mode"], **run_rule(eng, ids, q, key)}
            print(r, file=sys.stderr)
            rows.append(r)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
