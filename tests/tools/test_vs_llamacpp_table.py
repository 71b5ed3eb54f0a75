"""scripts/results_tables.vs_llamacpp_table on bench_vs_llamacpp reports: pp and tg at depth 0, and
tg alone at a depth with minirun's HCA cache (-p 0 -d D --kv hca)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import results_tables  # noqa: E402


def report(tests, **extra) -> dict:
    fmt = {"llama.cpp": {t: [10.0, 20.0, 30.0] for t in tests}, "minirun": {t: [30.0, 40.0, 90.0] for t in tests},
           "ratio": {t: [3.0, 2.0, 3.0] for t in tests}, "resident": {"held": 2 ** 20, "gguf": 2 ** 20, "ratio": 1.0}}
    return {"p": 512, "n": 32, "rounds": 3, "formats": {"Q4_1": fmt}, **extra}


def test_pp_and_tg_at_depth_zero():
    t = results_tables.vs_llamacpp_table(report(("pp", "tg")))
    assert t.startswith("pp512 / tg32, 3 paired rounds")
    assert "| weights | llama.cpp pp | minirun pp | pp ratio | llama.cpp tg | minirun tg | tg ratio |" in t
    assert "| Q4_1 | 20.0 (10.0-30.0) | 40.0 (30.0-90.0) | 3.00x | 20.0 (10.0-30.0) | 40.0 (30.0-90.0) | 3.00x |" in t


def test_tg_alone_at_a_depth_with_hca():
    t = results_tables.vs_llamacpp_table(report(("tg",), d=65536, kv="hca g64c16"))
    assert t.startswith("tg32 at depth 65536, minirun's KV: hca g64c16, 3 paired rounds")
    assert "pp ratio" not in t and "|---|---:|---:|---:|---:|" in t
    assert "| Q4_1 | 20.0 (10.0-30.0) | 40.0 (30.0-90.0) | 3.00x | 1.0 / 1.0 MiB (1.000) |" in t
