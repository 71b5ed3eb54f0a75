"""Two checkouts of minirun, one `minirun bench` command, alternating rounds: the speed of a change.

Usage:
  python scripts/bench_ab.py BEFORE_DIR AFTER_DIR [--rounds 3] [--json OUT] -- BENCH ARGS...
  e.g. python scripts/bench_ab.py /tmp/before . -- MODEL -p "" -n 64 -d 0 --kv dense --threads 2 -r 3

Each round runs the bench in a fresh process for BEFORE, then for AFTER (each checkout on
PYTHONPATH, the same interpreter), so drift of the machine falls on both. Per test row: the mean
tokens/s of each side over the rounds and AFTER / BEFORE. The first round of each side is a warm-up
(Numba's cache, the page cache) and not counted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def run_bench(tree: Path, bench_args: list[str]) -> list[dict]:
    """One `minirun bench ... -o json` with `tree` first on the path -> its rows."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "minirun", "bench", *bench_args, "-o", "json"]
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"bench_ab: {tree}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}")
    return json.loads(p.stdout)


def row_key(r: dict) -> str:
    return f"{r['kv']} {r['kv_budget'] or ''} {r['weights']} {r['test']}".replace("  ", " ")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("bench_ab: give the bench's arguments after --")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rounds", type=int, default=3, help="counted rounds (after one warm-up round)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv[:cut])
    bench_args = argv[cut + 1:]
    tps = {"before": {}, "after": {}}
    for rnd in range(a.rounds + 1):
        for side, tree in (("before", a.before), ("after", a.after)):
            rows = run_bench(tree.resolve(), bench_args)
            for r in rows:
                if rnd:
                    tps[side].setdefault(row_key(r), []).append(r["tps_mean"])
            print(f"round {rnd}{' (warm-up)' if not rnd else ''} {side}: "
                  + ", ".join(f"{row_key(r)} {r['tps_mean']:.1f}" for r in rows), file=sys.stderr)
    out = []
    for key, before in tps["before"].items():
        after = tps["after"][key]
        out.append({"test": key, "before_tps": statistics.mean(before), "after_tps": statistics.mean(after),
                    "ratio": statistics.mean(after) / statistics.mean(before), "before": before, "after": after})
        print(f"| {key} | {out[-1]['before_tps']:.1f} | {out[-1]['after_tps']:.1f} | {out[-1]['ratio']:.3f}x |")
    if a.json:
        a.json.write_text(json.dumps({"command": "python scripts/bench_ab.py " + " ".join(argv), "rows": out},
                                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
