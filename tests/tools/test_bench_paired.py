"""scripts/bench_paired.py: alternating rounds of several KV modes on one prefill each, the prompt
cache each mode writes, and dense modes filled with random keys and values instead of prefilled."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def bench_paired(*args):
    return subprocess.run([sys.executable, str(REPO / "scripts" / "bench_paired.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_prompt_caches_and_random_dense_fill(tiny_model_dir, tmp_path):
    d = tiny_model_dir("gqa-untied", head_dim=32)
    out = tmp_path / "caches"
    p = bench_paired(d, "--depth", 400, "-n", 3, "--rounds", 1, "--modes", "dense,hca:0.5,hca:0.5:q4",
                     "--dense-fill", "random", "--prompt-cache", out, "--hca-opt", "fit_min_tokens=40", "-o", "json")
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout)
    assert r["dense_fill"] == "random" and [x["mode"] for x in r["rows"]] == ["dense", "hca 0.5", "hca 0.5 q4"]
    assert all(x["tps_median"] > 0 for x in r["rows"])
    files = {f.name: f.stat().st_size for f in out.iterdir()}
    assert files == {f"{x['mode'].replace(' ', '-')}.kv": x["prompt_cache_bytes"] for x in r["rows"]}
    # q4 values take fewer bytes than float ones (a store of 400 - 256 - 16 tokens)
    assert files["hca-0.5-q4.kv"] < files["hca-0.5.kv"]
    # a second run into the same directory does not overwrite the files
    again = bench_paired(d, "--depth", 400, "-n", 3, "--rounds", 1, "--modes", "dense", "--dense-fill", "random",
                         "--prompt-cache", out)
    assert again.returncode != 0 and "exists" in again.stderr and "Traceback" not in again.stderr
    assert {f.name: f.stat().st_size for f in out.iterdir()} == files
