"""A long document as a user has it: prefill, first token, decode speed, memory and planted facts.

Usage:
  python scripts/bench_longdoc.py [MODEL] --tokens 32K [--kv dense,hca] [--kv-budget g64c16]
         [--ctx N] [--facts 4] [--decode 64] [--threads 2] [--device cpu|cuda] [--max-select N]
         [--dense-fill prefill|random]
         [--hca-opt KEY=VALUE ...]
         [--json out.json]

The document: Botchan (scripts/eval_quality.py's copy) and the stdlib's pydoc topics (evaluation
half), their paragraphs repeated and shuffled (seeded) to about N tokens, with `--facts` sentences
("The number of the red locker is 48213.") planted at depths spread over it. Each run goes through
`Engine.chat` as `minirun chat --file` does: the system message with the document is prefilled
first (timed: prefill s and tok/s), then each question is a user message after it (the cache
keeps the document; the first question's prefill plus its first token is the time to first token),
answered greedily in at most 16 tokens; a fact counts as answered when its number's digits appear
in the answer's. Decode speed: 64 tokens (EOS ignored) after the first question; the selection
share is the mean share of the store each HCA query head kept over those steps. Each (kv, tokens)
pair runs in a process of its own, so its peak RSS (and on a GPU its peak device memory) is its own. JSON: one object (title, command,
machine, date, kind "longdoc", rows); scripts/results_tables.py renders it.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import re
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

THINGS = ("red locker", "silver boat", "library card", "garden gate", "blue train", "old clock", "north tower",
          "glass jar")
SYSTEM = "You are a helpful assistant."      # (chat --file's system prompt before the document)


PARAGRAPH_CHARS = 1500   # the longest source paragraph a document takes whole


def paragraphs(botchan: Path | None) -> list[str]:
    """The source paragraphs: Botchan's (when its copy exists) and the pydoc topics' (evaluation half)."""
    from minirun.tools.calibrate import builtin_text, read_text
    texts = [builtin_text("evaluation")[0]]
    if botchan is not None and botchan.is_file():
        texts.append(read_text(botchan)[0])
    out = []
    for t in texts:
        for p in re.split(r"\n\s*\n", t):
            out += [q for q in _pieces(p.strip()) if len(q) > 40]
    return out


def _pieces(paragraph: str, most: int = PARAGRAPH_CHARS) -> list[str]:
    """A paragraph longer than `most` characters (a copy without blank lines between paragraphs)
    cut at line ends into pieces of at most about that many, so that the document's length and its
    facts' depths stay close to what was asked."""
    if len(paragraph) <= most:
        return [paragraph]
    pieces, cur = [], []
    for line in paragraph.splitlines():
        if cur and sum(len(x) + 1 for x in cur) + len(line) > most:
            pieces.append("\n".join(cur))
            cur = []
        cur.append(line)
    return pieces + (["\n".join(cur)] if cur else [])


def facts(n: int, seed: int) -> list[dict]:
    """n facts: a thing and its 5-digit number (seeded), each with its sentence and question."""
    rng = random.Random(f"facts-{seed}")
    out = []
    for thing in THINGS[:n]:
        key = rng.randint(10000, 99999)
        out.append({"thing": thing, "key": key, "sentence": f"The number of the {thing} is {key}.",
                    "question": f"What is the number of the {thing} in the document? Answer with the number only."})
    return out


def build_document(tok, n_tokens: int, planted: list[dict], seed: int, source: list[str]) -> str:
    """About n_tokens of shuffled paragraphs (repeated as needed), each fact's sentence a paragraph of
    its own at depth (i + 0.5) / len(planted) of the text."""
    rng = random.Random(f"doc-{seed}")
    sizes = [len(tok.encode(p, add_bos=False)) + 2 for p in source]
    order, total = [], 0
    while total < n_tokens:
        batch = list(range(len(source)))
        rng.shuffle(batch)
        for i in batch:
            if total >= n_tokens:
                break
            order.append(i)
            total += sizes[i]
    paras = [source[i] for i in order]
    for j, f in reversed(list(enumerate(planted))):
        paras.insert(int(len(paras) * (j + 0.5) / len(planted)), f["sentence"])
    return "\n\n".join(paras)


def peak_rss() -> int:
    """This process's peak resident bytes (Linux: ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_one(a) -> dict:
    """One (kv, tokens) run in this process (module docstring) -> its row."""
    import torch

    from minirun import Engine
    from minirun.config import hca_setting
    hca = dict(hca_setting(a.kv_budget), max_select=a.max_select, kv_values=a.kv_values) if a.kv == "hca" else {}
    eng = Engine.load(a.model, device=a.device, ctx=a.ctx, kv=a.kv, threads=a.threads, **hca, **a.hca_opts)
    planted = facts(a.facts, a.seed)
    doc = build_document(eng.tokenizer, parse_tokens(a.tokens)[0], planted, a.seed, paragraphs(a.botchan))
    base = [{"role": "system", "content": SYSTEM + "\n\nThe user has shared this document:\n\n" + doc}]
    prefix = eng.tokenize(eng.tokenizer.apply_chat_template(base, add_generation_prompt=False), add_bos=None)
    t0 = time.perf_counter()
    random_fill = a.kv == "dense" and a.dense_fill == "random"
    if random_fill:     # (dense decoding reads every key and value whatever they hold: its speed and
        from bench_paired import fill_random_kv   # memory without the quadratic prefill; no facts asked)
        fill_random_kv(eng, prefix)
        planted = []
    else:
        eng.prefill(prefix, progress=_bar("document"))             # as cli/chat.prefill_document
    prefill_s = time.perf_counter() - t0
    row = {"kv": row_label(a), "tokens": len(prefix), "ctx": a.ctx,
           "prefill_s": prefill_s, "prefill_tps": len(prefix) / prefill_s,
           "prefill_mode": "random fill" if random_fill else eng.last_prefill["mode"], "facts": []}
    cache = eng.cache
    for i, f in enumerate(planted):
        ids = eng.chat_prompt(base + [{"role": "user", "content": f["question"]}])
        t1 = time.perf_counter()
        res = eng.generate(ids, max_new_tokens=16, stop=("\n",))
        if i == 0:
            row.update(first_token(res))
        ok = str(f["key"]) in re.sub(r"\D", "", res.text)
        row["facts"].append({"depth": (i + 0.5) / len(planted), "key": f["key"], "answer": res.text.strip(),
                             "ok": ok, "seconds": time.perf_counter() - t1})
    ids = eng.chat_prompt(base + [{"role": "user", "content": planted[0]["question"] if planted else "Summarize."}])
    record = hasattr(cache, "record_selection")
    if record:
        cache.record_selection = []
    res = eng.generate(ids, max_new_tokens=a.decode, ignore_eos=True)
    row["decode_tps"], row["decode_tokens"] = res.decode_tps, len(res.tokens)
    if random_fill:     # (no fact asked: this question's, as the facts' first question gives them)
        row.update(first_token(res))
    row["selected"] = (float(torch.tensor([float(x.mean()) for x in cache.record_selection]).mean())
                       if record and cache.record_selection else None)
    if record:
        cache.record_selection = None
    row["answered"] = sum(f["ok"] for f in row["facts"])
    row["peak_rss_bytes"] = peak_rss()
    row["peak_device_bytes"] = torch.cuda.max_memory_allocated(eng.device) if eng.device.type == "cuda" else None
    return row


def first_token(res) -> dict:
    """A question's timings from its generate result: its prefill, and its first token (the
    prefill plus one decode step)."""
    return {"first_token_s": res.prefill_s + (res.decode_s / len(res.tokens) if res.tokens else 0.0),
            "question_prefill_s": res.prefill_s}


def row_label(a) -> str:
    """A row's kv column: dense, or hca with its budget and any setting given beyond the defaults
    ("hca g64c16 max_select=4096 rescore=true")."""
    if a.kv == "dense":
        return "dense" + (" (random keys and values)" if a.dense_fill == "random" else "")
    extra = ([f"max_select={a.max_select}"] if a.max_select else []) + \
        ([f"{a.kv_values} values"] if a.kv_values != "auto" else []) + list(a.hca_opt)
    return " ".join([f"hca {a.kv_budget}"] + extra)


def _bar(desc: str):
    from minirun.cli.chat import _progress_bar
    return _progress_bar(desc)


def positive_int(s: str) -> int:
    n = int(s)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def parse_tokens(s: str) -> list[int]:
    from minirun.config import parse_ctx
    return [parse_ctx(x) for x in s.split(",") if x.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--tokens", default="32K", help="document lengths in tokens, comma-separated (1K = 1024)")
    ap.add_argument("--kv", default="dense,hca", help="dense, hca or both (comma-separated)")
    ap.add_argument("--kv-budget", default="g64c16", help="HCA budget or gGcC codebooks")
    ap.add_argument("--ctx", type=int, default=None, help="the context (default: the document + 1024 tokens)")
    ap.add_argument("--facts", type=int, default=4, choices=range(1, len(THINGS) + 1))
    ap.add_argument("--decode", type=int, default=64, help="tokens decoded for the decode speed")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dense-fill", default="prefill", choices=["prefill", "random"],
                    help="dense: read the document, or fill the cache with random keys and values (speed and "
                         "memory only, no facts asked: past ~32K tokens dense's prefill takes hours on a CPU)")
    ap.add_argument("--max-select", type=positive_int, default=None, help="HCA: at most this many store tokens "
                                                                         "per head and step (minirun's --max-select)")
    ap.add_argument("--kv-values", default="auto", choices=["auto", "float", "q8", "q4"],
                    help="HCA: the store's values on the host (minirun's --kv-values)")
    ap.add_argument("--hca-opt", action="append", default=[], help="KEY=VALUE: an advanced engine setting (minirun's --hca-opt)")
    ap.add_argument("--botchan", type=Path, default=None, help="Botchan's text (default: eval_quality's copy, "
                                                               "fetched once)")
    ap.add_argument("--json", type=Path, default=None, help="write the results file here")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)   # (a child: one run, its row on stdout)
    a = ap.parse_args(argv)
    from minirun.cli.common import parse_hca_opts
    from minirun.errors import MiniRunError
    try:
        a.hca_opts = parse_hca_opts(a.hca_opt)
    except MiniRunError as e:
        raise SystemExit(f"error: {e}") from None
    if a.one:
        print(json.dumps(run_one(a)))
        return 0
    if a.botchan is None:
        from eval_quality import fetch_botchan
        a.botchan = fetch_botchan()
    rows = []
    for n in parse_tokens(a.tokens):
        for kv in [k.strip() for k in a.kv.split(",") if k.strip()]:
            child = [sys.executable, __file__, a.model, "--one", "--tokens", str(n), "--kv", kv, "--kv-budget",
                     a.kv_budget, "--ctx", str(a.ctx or n + 1024), "--facts", str(a.facts), "--decode", str(a.decode),
                     "--seed", str(a.seed), "--botchan", str(a.botchan), "--device", a.device] + \
                    (["--threads", str(a.threads)] if a.threads else []) + \
                    (["--max-select", str(a.max_select)] if a.max_select else []) + \
                    ["--dense-fill", a.dense_fill, "--kv-values", a.kv_values] + sum((["--hca-opt", o] for o in a.hca_opt), [])
            out = subprocess.run(child, stdout=subprocess.PIPE, text=True)
            if out.returncode:
                print(f"error: the {kv} run at {n} tokens failed (exit {out.returncode})", file=sys.stderr)
                return 1
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(summary(rows[-1]), file=sys.stderr)
    report = {"title": f"A long document through Engine.chat ({Path(a.model).name}, {a.device})",
              "command": "python scripts/bench_longdoc.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": f"{platform.processor() or platform.machine()}, {a.threads or 'default'} threads",
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "kind": "longdoc", "rows": rows}
    if a.json:
        tmp = a.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(a.json)
    print(json.dumps(report, indent=2))
    return 0


def summary(r: dict) -> str:
    sel = "-" if r["selected"] is None else f"{100 * r['selected']:.1f}%"
    return (f"{r['kv']} @ {r['tokens']} tok: prefill {r['prefill_s']:.1f} s ({r['prefill_tps']:.0f} tok/s, "
            f"{r['prefill_mode']}), first token {r['first_token_s']:.1f} s, decode {r['decode_tps']:.2f} tok/s, "
            f"selected {sel}, facts {r['answered']}/{len(r['facts'])}, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
