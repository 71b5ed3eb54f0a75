"""The figures in docs/ from the measurements kept in docs/results/: regenerate, or check, the tables.

    python scripts/results_tables.py          # rewrite every table in docs/*.md from docs/results/
    python scripts/results_tables.py --check  # exit 1 (and name them) where a table differs

A results file is one JSON object: title, command, machine, date (what produced the figures, where,
when), kind, and the tool's own output: "bench" (rows of `minirun bench -o json` or of
scripts/bench_gpu.py; "table": "compact" for one line per decode variant), "eval" (the report of
`minirun eval -o json`), "eval-grid" ("reports": several, as one continuation perplexity
table), "paired" (scripts/bench_paired.py -o json), "vs-llamacpp" ("report":
scripts/bench_vs_llamacpp.py's, whose --json writes the whole file), "plan" (`minirun plan -o
json`), "serve" ("runs": scripts/bench_serve.py reports, one per server), "serve-peers"
("servers": scripts/bench_serve_peers.py's, whose --json writes the whole file), "longdoc" ("rows":
scripts/bench_longdoc.py's), "budgets" ("rows": scripts/head_budget_rules.py's). A document shows a file's table between `<!-- results: NAME [VIEW] -->` and `<!-- /results -->` (NAME: the file's
name without .json; VIEW "summary": an eval report's settings and main table only), headed by its
title and followed by its command, machine and date.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minirun.tools.bench import BenchResult  # noqa: E402
from minirun.tools.bench_output import to_markdown, to_markdown_compact  # noqa: E402
from minirun.tools.evaluate import format_markdown  # noqa: E402
from minirun.planner import format_bytes, format_plan  # noqa: E402

RESULTS, DOCS = REPO / "docs" / "results", REPO / "docs"
BLOCK = re.compile(r"(<!-- results: ([\w.-]+)(?: (\w+))? -->\n)(.*?)(<!-- /results -->)", re.S)


def paired_table(d: dict) -> str:
    lines = [f"{d['test']}, {d['dtype']}, context {d['context']}, {d['rounds']} rounds, {d['threads']} threads: "
             f"tokens/s median (min-max), and the per-round ratio to {d['base']}", "",
             "| mode | tok/s | ratio to " + d["base"] + " | selected |", "|---|---:|---:|---:|"]
    files = any(r.get("prompt_cache_bytes") for r in d["rows"])   # (--prompt-cache: each mode's file)
    if files:
        lines[-2:] = [lines[-2] + " prompt cache |", lines[-1] + "---:|"]
    for r in d["rows"]:
        sel = "-" if r["selected"] is None else f"{100 * r['selected']:.1f}%"
        lines.append(f"| {r['mode']} | {r['tps_median']:.2f} ({r['tps_min']:.2f}-{r['tps_max']:.2f}) | "
                     f"{r['ratio_median']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | {sel} |"
                     + (f" {format_bytes(r['prompt_cache_bytes'])} |" if files else ""))
    return "\n".join(lines)


def vs_llamacpp_table(report: dict) -> str:
    """scripts/bench_vs_llamacpp.py's report: per weight format, each engine's median (min-max)
    tokens/s over the paired rounds, the median of the per-round ratios, and the resident bytes
    (the tests a report ran: pp and tg, or tg alone after -p 0; at a depth and KV mode when given)."""
    def med(xs):
        return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"
    tests = [t for t in ("pp", "tg") if any(r["ratio"].get(t) for r in report["formats"].values())]
    names = {"pp": f"pp{report['p']}", "tg": f"tg{report['n']}"}
    at = f" at depth {report['d']}" if report.get("d") else ""
    kv = f", minirun's KV: {report['kv']}" if report.get("kv", "dense") != "dense" else ""
    head = "".join(f" llama.cpp {t} | minirun {t} | {t} ratio |" for t in tests)
    lines = [f"{' / '.join(names[t] for t in tests)}{at}{kv}, {report['rounds']} paired rounds (llama-bench, then "
             "minirun bench, back to back); median (min-max) tokens/s, and the median of the rounds' ratios", "",
             f"| weights |{head} resident / GGUF bytes |", "|---|" + "---:|---:|---:|" * len(tests) + "---:|"]
    for fmt, r in report["formats"].items():
        res = r["resident"]
        cells = "".join(f" {med(r['llama.cpp'][t])} | {med(r['minirun'][t])} | {statistics.median(r['ratio'][t]):.2f}x |"
                        for t in tests)
        lines.append(f"| {fmt} |{cells} {res['held'] / 2**20:.1f} / {res['gguf'] / 2**20:.1f} MiB ({res['ratio']:.3f}) |")
    return "\n".join(lines)


def serve_table(runs: list[dict]) -> str:
    """scripts/bench_serve.py reports, one per server (named by its "label", else its kv mode): the
    concurrent requests, then the document's first request against its follow-up questions (first
    token wall and server CPU seconds), each where the runs have it."""
    lines = serve_concurrent_rows(runs) if "concurrent" in runs[0] else []
    if "document" in runs[0]:
        lines += ([""] if lines else []) + serve_document_rows(runs)
    return "\n".join(lines + kill_table(runs))


def serve_concurrent_rows(runs: list[dict]) -> list[str]:
    c0 = runs[0]["concurrent"]
    lines = [f"{c0['clients']} clients x {c0['requests_each']} streamed requests x {c0['max_tokens']} tokens "
             "(the first token includes any wait in the queue)", "",
             "| server | wall s | tok/s in all | first token p50 / p95 s | decode tok/s p50 / p95 (slow tail) |",
             "|---|---:|---:|---:|---:|"]
    for r in runs:
        c = r["concurrent"]
        lines.append(f"| {r.get('label') or r['server']['kv']} | {c['wall_s']:.1f} | {c['aggregate_tps']:.1f} | {c['ttft_p50']:.2f} / "
                     f"{c['ttft_p95']:.2f} | {c['decode_tps_p50']:.1f} / {c['decode_tps_p95']:.1f} |")
    return lines


def serve_document_rows(runs: list[dict]) -> list[str]:
    doc = runs[0]["document"]
    n_docs = doc.get("documents", 1)
    what = (f"A {doc['doc_tokens']}-token document and a question, then {len(doc['requests']) - 1} more questions about it"
            if n_docs == 1 else f"{n_docs} documents of {doc['doc_tokens']} tokens, a question each, then "
            f"{len(doc['requests']) // n_docs - 1} more about each, the documents taking turns")
    lines = [f"{what}, each answered in {doc['answer_tokens']} tokens: first token in seconds, wall (server CPU)", "",
             f"| server | prompt tokens | first request{'s' if n_docs > 1 else ''} | follow-ups | cached tokens | decode tok/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in runs:
        q = r["document"]["requests"]
        first = [x for i, x in enumerate(q) if x.get("round", i) == 0]   # (one document: no "round", its first request)
        later = [x for i, x in enumerate(q) if x.get("round", i) != 0]
        t = lambda x: f"{x['ttft']:.2f} ({x['server']['first_text_cpu_s']:.2f})"   # noqa: E731
        tps = [x["decode_tps"] for x in q]
        lines.append(f"| {r.get('label') or r['server']['kv']} | {q[0]['prompt_tokens']} | {', '.join(t(x) for x in first)} | "
                     f"{', '.join(t(x) for x in later)} | "
                     f"{', '.join(str(x['cached_tokens']) for x in q)} | {min(tps):.1f}-{max(tps):.1f} |")
    return lines


def kill_table(runs: list[dict]) -> list[str]:
    """Rows of the runs with a kill phase (bench_replicas.py --kill-after): one replica killed into
    the short load; what was answered, what failed, when two replicas ran again."""
    killed = [r for r in runs if "kill" in r]
    if not killed:
        return []
    k0 = killed[0]["kill"]
    lines = ["", f"The short load again, one replica killed {k0['kill_after_s']:g} s into it", "",
             "| server | answered | failed (error) | tok/s in all | back to 2 replicas after s |", "|---|---:|---:|---:|---:|"]
    for r in killed:
        k = r["kill"]
        errors = "; ".join(sorted({e.split(": ", 1)[-1].split(";")[0] for e in k["errors"]}))
        back = "not in 300 s" if k["recovered_s"] is None else f"{k['recovered_s']:.1f}"
        lines.append(f"| {r['label']} | {k['answered']} | {len(k['errors'])}{f' ({errors})' if errors else ''} | "
                     f"{k['aggregate_tps']:.1f} | {back} |")
    return lines


def eval_grid_table(reports: list[dict]) -> str:
    """Continuation perplexity of several eval reports (one per prompt length and HCA setting) as
    one table: a row per prompt length, dense (its whole prompt) and each far-position setting."""
    fars = list(dict.fromkeys(r["settings"].get("far_positions", "off") for r in reports))
    cells: dict = {}
    for r in reports:
        n, far = r["settings"]["prompt_tokens"], r["settings"].get("far_positions", "off")
        for row in r["rows"]:
            cells[(n, "dense" if row["mode"] == "dense" else far)] = (row["mode"], row["cont_ppl"])
    hca = {far: next(m for (_, f), (m, _) in cells.items() if f == far) for far in fars}
    lines = ["| prompt tokens | dense, whole prompt | " + " | ".join(f"{hca[f]}, far positions {f}" for f in fars) + " |",
             "|---:|---:|" + "---:|" * len(fars)]
    for n in sorted({n for n, _ in cells}):
        vals = [cells.get((n, c), (None, None))[1] for c in ["dense", *fars]]
        lines.append(f"| {n:,} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in vals) + " |")
    return "\n".join(lines)


def longdoc_table(rows: list[dict]) -> str:
    """scripts/bench_longdoc.py's rows: per (kv, document length) the document's prefill, the first
    question's first token, decode speed, selection share, planted facts answered and peak RSS."""
    lines = ["| kv | document tokens | prefill s (tok/s, mode) | first token s | decode tok/s | selected | facts "
             "answered | peak RSS |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        sel = "-" if r["selected"] is None else f"{100 * r['selected']:.1f}%"
        lines.append(f"| {r['kv']} | {r['tokens']:,} | {r['prefill_s']:.1f} ({r['prefill_tps']:.0f}, "
                     f"{r['prefill_mode']}) | {r['first_token_s']:.1f} | {r['decode_tps']:.2f} | {sel} | "
                     f"{facts_cell(r)} | {r['peak_rss_bytes'] / 2**30:.2f} GiB |")
    return "\n".join(lines)


def facts_cell(r: dict) -> str:
    """"k of n" planted facts answered, or "-" where none were asked (a cache of random keys and values)."""
    return f"{r['answered']} of {len(r['facts'])}" if r["facts"] else "-"


def budgets_table(rows: list[dict]) -> str:
    """Head-budget rules on one passkey prompt each (rows: length, depth, rule, answer, ok, decode
    tok/s median, selected share): each rule's answer, speed and selection share."""
    lines = ["| tokens | key depth | kv | rule | decode tok/s (median) | selected | answer | found |",
             "|---:|---:|---|---|---:|---:|---|---|"]
    for r in rows:
        sel = "-" if r.get("selected") is None else f"{100 * r['selected']:.1f}%"
        lines.append(f"| {r['N']:,} | {r['depth']:g} | {r.get('kv', 'hca g64c16')} | {r['rule']} | "
                     f"{r['tps_median']:.2f} | {sel} | {r['answer']} | {'yes' if r['ok'] else 'no'} |")
    return "\n".join(lines)


def serve_peers_table(servers: dict) -> str:
    """scripts/bench_serve_peers.py's summaries: one row per server, means over the rounds (the
    document's columns where the run had the mixed phase; "refused" where a server refused it)."""
    mixed = any("mixed_ttft_p50" in v["summary"] for v in servers.values())
    head = "| server | tok/s in all | first token p50 / p95 s | decode tok/s p50 |"
    lines = [head + (" beside a document: short ones' first token p50 / p95 s | the document's first token s |"
                     if mixed else ""), "|---|---:|---:|---:|" + ("---:|---:|" if mixed else "")]
    f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"   # noqa: E731
    for name, v in servers.items():
        s = v["summary"]
        row = (f"| {name} | {f(s['aggregate_tps'], 1)} | {f(s['ttft_p50'])} / {f(s['ttft_p95'])} | "
               f"{f(s['decode_tps_p50'], 1)} |")
        if mixed and s.get("mixed_refused"):
            row += " refused | refused |"
        elif mixed:
            row += f" {f(s.get('mixed_ttft_p50'))} / {f(s.get('mixed_ttft_p95'))} | {f(s.get('mixed_document_ttft'))} |"
        lines.append(row)
    return "\n".join(lines)


def render(d: dict, view: str | None = None) -> str:
    """A results file as markdown: its title, its table, its command, machine and date. view
    "summary": an eval report's settings and main table only."""
    kind = d["kind"]
    if kind == "bench":
        rows = d["rows"]
        body = to_markdown_compact(rows) if d.get("table") == "compact" else \
            to_markdown([BenchResult(**{k: v for k, v in r.items() if k in BenchResult.__dataclass_fields__})
                         for r in rows])
    elif kind == "eval":
        body = format_markdown(d["report"], data=d["report"].get("data"))
        if view == "summary":   # the settings and the main table only
            paras = body.split("\n\n")
            body = "\n\n".join(paras[:1 + next(i for i, p in enumerate(paras) if p.startswith("| mode"))])
    elif kind == "eval-grid":
        body = eval_grid_table(d["reports"])
    elif kind == "paired":
        body = paired_table(d["report"])
    elif kind == "vs-llamacpp":
        body = vs_llamacpp_table(d["report"])
    elif kind == "plan":
        body = "```\n" + format_plan(d["report"]) + "\n```"
    elif kind == "serve":
        body = serve_table(d["runs"])
    elif kind == "serve-peers":
        body = serve_peers_table(d["servers"])
    elif kind == "longdoc":
        body = longdoc_table(d["rows"])
    elif kind == "budgets":
        body = budgets_table(d["rows"])
    else:
        raise SystemExit(f"results_tables: unknown kind {kind!r}")
    return (f"**{d['title']}**\n\n{body}\n\n"
            f"`{d['command']}` -- {d['machine']}, {d['date']}\n")


def regenerate(doc: str) -> str:
    """The document with each results block rendered from its file."""
    def sub(m):
        path = RESULTS / f"{m.group(2)}.json"
        if not path.is_file():
            raise SystemExit(f"results_tables: {path} (named in a document) does not exist")
        return m.group(1) + render(json.loads(path.read_text()), m.group(3)) + m.group(5)
    return BLOCK.sub(sub, doc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 where a table differs")
    a = ap.parse_args(argv)
    stale = []
    for md in sorted(DOCS.glob("*.md")) + [REPO / "README.md"]:
        text = md.read_text()
        new = regenerate(text)
        if new != text:
            stale.append(md.relative_to(REPO))
            if not a.check:
                md.write_text(new)
    if a.check and stale:
        print("results_tables: out of date: " + ", ".join(map(str, stale)) + " (run scripts/results_tables.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
