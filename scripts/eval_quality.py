"""Run the quality grid (dense vs HCA at each budget) and write markdown + JSON.

Usage:
  python scripts/eval_quality.py MODEL [--data FILE | --botchan] [--sections ppl,agree,passkey]
         [--budgets 0.5,0.25,0.125] [--json out.json] [--md out.md] [any knob of `minirun eval`]
  python scripts/eval_quality.py --merge a.json b.json ... [--md out.md]   # one table from several runs

Each section runs as its own grid (one engine loaded at a time, dense first), so long runs can be
split into separate jobs and merged afterwards. --botchan: the English translation of Natsume's
"Botchan" (Project Gutenberg #8868, public domain) that sentencepiece ships in its source
distribution; fetched once with `pip download` into ~/.cache/minirun/.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minirun.tools.calibrate import read_text  # noqa: E402
from minirun.config import hca_setting, parse_ctx  # noqa: E402
from minirun.errors import MiniRunError  # noqa: E402
from minirun.tools.evaluate import format_markdown, run_grid  # noqa: E402

BOTCHAN = Path.home() / ".cache" / "minirun" / "botchan.txt"
SECTIONS = ("ppl", "agree", "passkey")


def fetch_botchan() -> Path:
    """sentencepiece 0.2.3's sdist holds test/botchan.txt; keep a copy in ~/.cache/minirun."""
    if BOTCHAN.is_file():
        return BOTCHAN
    BOTCHAN.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                        "sentencepiece==0.2.3", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("sentencepiece-*.tar.gz"))
        with tarfile.open(sdist) as tf:
            member = next(m for m in tf.getmembers() if m.name.endswith("/test/botchan.txt"))
            tmp_out = BOTCHAN.with_suffix(".tmp")
            tmp_out.write_bytes(tf.extractfile(member).read())
            tmp_out.replace(BOTCHAN)
    return BOTCHAN


def merge(reports: list[dict]) -> dict:
    """Rows of several reports merged by mode (later sections add their keys); settings of the first
    report, with the section-specific ones taken from the report that ran that section."""
    out = {"settings": dict(reports[0]["settings"]), "rows": [], "data": reports[0].get("data")}
    by_mode: dict = {}
    for r in reports:
        s = r["settings"]
        if s.get("ppl_tokens"):
            out["settings"]["ppl_tokens"] = s["ppl_tokens"]
        if s.get("positions"):
            out["settings"].update(positions=s["positions"], prompt_tokens=s["prompt_tokens"])
        if s.get("lengths"):
            out["settings"].update(lengths=s["lengths"], depths=s["depths"], trials=s["trials"])
        for row in r["rows"]:
            m = by_mode.setdefault(row["mode"], {"mode": row["mode"], "seconds": {}})
            if m not in out["rows"]:
                out["rows"].append(m)
            secs = {**m["seconds"], **row.get("seconds", {})}
            m.update(row)
            m["seconds"] = secs
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("--data", default=None, help="evaluation text (default: pydoc topics, evaluation half)")
    ap.add_argument("--botchan", action="store_true", help="evaluate on Botchan (fetched once, see above)")
    ap.add_argument("--sections", default="ppl,agree,passkey")
    ap.add_argument("--budgets", default="0.5,0.25,0.125", help="HCA settings: budgets or gGcC (e.g. g64c16)")
    ap.add_argument("--far-positions", default="auto", choices=["auto", "on", "grouped", "off"],
                    help="HCA: far positions (minirun/kv/far_positions.py)")
    ap.add_argument("--max-select", type=int, default=None, help="HCA: top tokens per head and step at most")
    ap.add_argument("--length-scale", default="off", choices=["auto", "on", "off"],
                    help="HCA: logits x log n / log(trained context) past it")
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--prompt-tokens", type=int, default=3072)
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--passkey-lengths", default="1024,2048,4096,8000")
    ap.add_argument("--passkey-depths", default="0.1,0.5,0.9")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--passkey-haystack", default="filler", choices=["filler", "text"],
                    help="hide the key in filler, or in the evaluation text's start")
    ap.add_argument("--passkey-copies", type=int, default=1, help="with --passkey-haystack text: copies of that text")
    ap.add_argument("--tau", type=float, default=0.9)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--sinks", type=int, default=16)
    ap.add_argument("--key-store", default="codebook", choices=["codebook", "exact"])
    ap.add_argument("--centroids", type=int, default=None)
    ap.add_argument("--rescore", action="store_true", help="HCA: exact weights from host keys (--rescore)")
    ap.add_argument("--kv-values", default="float", help="HCA: the store's value types, comma-separated "
                    "(float,q8,q4): each budget run with each")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    ap.add_argument("--md", type=Path, default=None, help="write the markdown here (else stdout)")
    ap.add_argument("--merge", nargs="+", type=Path, default=None, help="merge these JSON reports instead of running")
    a = ap.parse_args(argv)

    if a.merge:
        report = merge([json.loads(p.read_text()) for p in a.merge])
        if a.json:
            a.json.write_text(json.dumps(report, indent=1))
    else:
        if not a.model:
            ap.error("MODEL is required unless --merge is given")
        data = fetch_botchan() if a.botchan else a.data
        text, source = read_text(data, part="evaluation")
        from minirun.checkpoint.tokenizer import Tokenizer
        ids = Tokenizer(Path(a.model)).encode(text)
        print(f"eval_quality: {len(ids)} tokens of {source}", file=sys.stderr)
        sections = [s.strip() for s in a.sections.split(",") if s.strip()]
        bad = set(sections) - set(SECTIONS)
        if bad:
            ap.error(f"unknown sections {sorted(bad)}: use {','.join(SECTIONS)}")
        budgets = [b.strip() for b in a.budgets.split(",") if b.strip()]
        try:
            [hca_setting(b) for b in budgets]
        except MiniRunError as e:
            ap.error(str(e))
        reports = []
        for sec in sections:
            t0 = time.perf_counter()
            r = run_grid(
                a.model, ids, budgets=budgets,
                ppl_tokens=a.ppl_tokens if sec == "ppl" else 0,
                prompt_tokens=a.prompt_tokens, positions=a.positions if sec == "agree" else 0,
                lengths=[parse_ctx(x) for x in a.passkey_lengths.split(",") if x.strip()] if sec == "passkey" else [],
                depths=[float(x) for x in a.passkey_depths.split(",") if x.strip()], trials=a.trials,
                tau=a.tau, window=a.window, sinks=a.sinks, dtype=a.dtype, key_store=a.key_store,
                centroids=a.centroids, threads=a.threads, seed=a.seed, far_positions=a.far_positions,
                max_select=a.max_select, length_scale=a.length_scale, rescore=a.rescore,
                passkey_haystack=a.passkey_haystack,
                passkey_copies=a.passkey_copies, kv_values=[v.strip() for v in a.kv_values.split(",") if v.strip()],
                log=lambda s: print(f"[{time.strftime('%H:%M:%S')}] {s}", file=sys.stderr, flush=True))
            r["data"] = source
            print(f"eval_quality: section {sec} took {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
            reports.append(r)
            if a.json:   # after every section: a long run that dies keeps what it finished
                a.json.write_text(json.dumps(merge(reports), indent=1))
        report = merge(reports)
    md = format_markdown(report, data=report.get("data"))
    if a.md:
        a.md.write_text(md + "\n")
    else:
        print(md)


if __name__ == "__main__":
    main()
