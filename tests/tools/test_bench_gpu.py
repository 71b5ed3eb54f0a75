"""The GPU scripts rehearsed on the CPU at tiny sizes, so they cannot rot between GPU runs:
scripts/bench_gpu.sh (the GPU cache on the kernel emulator; every kind of step: dense, the deep step's
prefill and decode variants, a model made with random weights on the device) and scripts/chat_4m.sh's
chat stage (a tiny random model and a short text instead of 4M tokens of Botchan)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (CPU kernel emulator)")


def run(cmd, **env):
    full = dict(os.environ, PY=sys.executable, DEVICE="cpu", PYTHONPATH=str(REPO), **env)
    return subprocess.run(cmd, cwd=REPO, env=full, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@needs_gxx
def test_bench_gpu_rehearsal(tmp_path):
    out = tmp_path / "out"
    p = run(["bash", "scripts/bench_gpu.sh", str(out)], STEPS="dense,deep-g64c16,llama8b")
    assert p.returncode == 0, p.stderr[-2000:]
    status = json.loads((out / "steps.json").read_text())
    assert {k: v.split(",")[0] for k, v in status.items()} == {"dense": "ok", "deep-g64c16": "ok", "llama8b": "ok"}
    summary = (out / "summary.md").read_text()
    assert summary == p.stdout[p.stdout.index("# bench_gpu"):].rstrip("\n") + "\n"    # printed last
    deep = json.loads((out / "deep-g64c16.json").read_text())
    tests = [r["test"] for r in deep]
    assert tests[0] == "pp1024" and all(t == "tg4 @ d1024" for t in tests[1:])
    # both value sums and the cap on one prefill, each row saying which
    assert {(r["value_sum"], r["max_select"]) for r in deep[1:]} == {("gpu", 32), ("host", 32), ("gpu", None),
                                                                      ("host", None)}
    assert all(r["tps_mean"] > 0 and r["device_name"] and r["kv_stats"]["tokens_store"] > 0 for r in deep)
    big = json.loads((out / "llama8b.json").read_text())
    assert big[0]["model"] == "random-llama3-8b" and len(big) == 4
    plan = json.loads((out / "llama8b-plan.json").read_text())
    assert {t["tier"] for t in plan["tiers"]} >= {"weights", "key store", "value pool"}
    assert [r["test"] for r in json.loads((out / "dense.json").read_text())] == ["tg4 @ d256"] * 2 + ["tg4 @ d1024"] * 2
    assert "targets (best variant):" in summary
    log = (out / "deep-g64c16.log").read_text()   # what bounds a step and a prefill (scripts/gpu_profiles.py)
    for part in ("profile: wall", "host profile (3 steps", "prefill profile: 768 tokens", "prefill host profile"):
        assert part in log, part


def test_chat_4m_rehearsal(tmp_path, tiny_model_dir):
    book = tmp_path / "book.txt"
    book.write_text("It was a bright cold day in April, and the clocks were striking thirteen. " * 40)
    out = tmp_path / "out"
    p = run(["bash", "scripts/chat_4m.sh", "run", str(out)], MODEL=str(tiny_model_dir(hidden_size=256)), BOOK=str(book),
            COPIES="2", CTX="8K", MAX_SELECT="64", CHAT_LIMIT="300")
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads((out / "chat_4m.json").read_text())
    text = (out / "book4m.txt").read_text()
    assert text.count("The pass key is 48213") == 1 and text.count("bright cold day") == 80
    assert res["tokens"] > 2000 and res["prefill_s"] > 0 and res["decode_tps"] > 0
    assert res["passkey_found"] == ("48213" in res["answer"]) and res["exit"] == 0


def test_chat_4m_failure_exits_non_zero(tmp_path, tiny_model_dir):
    """A chat that fails (here: g64 groups cannot split a head of 16) fails the script, its JSON kept."""
    book = tmp_path / "book.txt"
    book.write_text("Some text. " * 50)
    p = run(["bash", "scripts/chat_4m.sh", "run", str(tmp_path / "out")], MODEL=str(tiny_model_dir()),
            BOOK=str(book), COPIES="1", CTX="8K")
    assert p.returncode != 0 and "does not divide" in p.stdout
    assert json.loads((tmp_path / "out" / "chat_4m.json").read_text())["exit"] == p.returncode
