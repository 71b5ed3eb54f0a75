"""Planner arithmetic by hand, the refusal message, and `minirun bench` / `minirun plan` output formats."""
import csv
import io
import json

import pytest
import torch

from minirun.cli import main
from minirun.config import EngineConfig, ModelArgs
from minirun.errors import ContextError
from minirun.planner import check_fits, largest_ctx, plan

SMOLLM2 = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
LLAMA3_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
M4 = 4 * 1024 * 1024


def test_smollm2_bytes_per_tier_at_4m():
    a = ModelArgs.from_dict(SMOLLM2)
    L, Hkv, d, Hq = 30, 3, 64, 9
    dense = plan(a, EngineConfig(kv="dense", dtype="bfloat16", ctx=M4)).tiers
    assert dense["dense K+V"][0] == 4 * L * Hkv * d * M4 == 23040 * M4        # 22.5 KiB per token
    t = plan(a, EngineConfig(kv="hca", kv_budget=0.125, dtype="bfloat16", ctx=M4)).tiers
    n_store = M4 - 16 - 256
    assert t["key store"] == (2 * L * Hkv * 16 * n_store, "device")             # g = d/4 = 16 int16 indices
    assert 2 * L * Hkv * 16 == 2880 == 23040 // 8                               # exactly the 12.5% preset
    assert t["value pool"] == (2 * L * Hkv * d * n_store, "host")
    assert t["sinks+ring K+V"] == (4 * L * Hkv * d * 272, "device")
    assert t["codebooks"] == (L * Hkv * 16 * 1024 * 4 * 4, "device")
    assert t["scratch"] == (Hq * n_store * 8, "device")
    t25 = plan(a, EngineConfig(kv="hca", kv_budget=0.25, dtype="bfloat16", ctx=M4)).tiers
    assert t25["key store"][0] == 2 * L * Hkv * 32 * n_store                    # g = d/2: 25%
    t50 = plan(a, EngineConfig(kv="hca", kv_budget=0.5, dtype="bfloat16", ctx=M4)).tiers
    assert t50["key store"][0] == 2 * L * Hkv * d * n_store and "codebooks" not in t50


def test_llama3_8b_bytes_per_tier_at_4m():
    a = ModelArgs.from_dict(LLAMA3_8B)
    L, Hkv, d = 32, 8, 128
    dense = plan(a, EngineConfig(kv="dense", dtype="bfloat16", ctx=M4)).tiers
    assert dense["dense K+V"][0] == 128 * 1024 * M4                             # 128 KiB per token: 512 GiB
    t = plan(a, EngineConfig(kv="hca", kv_budget=0.125, dtype="bfloat16", ctx=M4)).tiers
    n_store = M4 - 272
    assert t["key store"][0] == 2 * L * Hkv * 32 * n_store == 16384 * n_store   # 16 KiB per token = 1/8
    assert t["value pool"][0] == 2 * L * Hkv * d * n_store                      # 64 KiB per token on the host
    assert t["weights"][0] == 2 * (32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096)
                                   + 2 * 128256 * 4096 + 4096)


def test_refusal_names_the_largest_ctx_that_fits():
    a = ModelArgs.from_dict(SMOLLM2)
    cfg = EngineConfig(kv="dense", dtype="bfloat16", ctx=M4)
    avail = {"host": 4 << 30, "device": None}
    cpu = torch.device("cpu")
    with pytest.raises(ContextError) as e:
        check_fits(a, cfg, cpu, avail)
    msg = str(e.value)
    assert "\n" not in msg and "the largest context that fits is" in msg
    best = largest_ctx(a, cfg, cpu, avail)
    assert str(best) in msg
    check_fits(a, EngineConfig(kv="dense", dtype="bfloat16", ctx=best), cpu, avail)
    with pytest.raises(ContextError):
        check_fits(a, EngineConfig(kv="dense", dtype="bfloat16", ctx=best + 1), cpu, avail)


def run(args, capsys):
    try:
        main(args)
    except SystemExit as e:
        assert e.code in (0, None), capsys.readouterr().err
    return capsys.readouterr().out


BENCH = ["-p", "16", "-n", "4", "-d", "0,64", "--kv", "dense,hca", "-r", "2", "--window", "16", "--sinks", "4"]


def test_bench_json_csv_markdown(tiny_model_dir, capsys):
    d = str(tiny_model_dir("gqa-untied"))
    rows = json.loads(run(["bench", d, *BENCH, "-o", "json"], capsys))
    assert len(rows) == 6                                  # 2 modes x (pp16, tg4@d0, tg4@d64)
    for r in rows:
        for k in ("model", "device", "dtype", "threads", "kv", "kv_budget", "codebooks", "test", "n_prompt",
                  "n_gen", "depth", "reps", "tps_mean", "tps_std", "samples", "peak_host_bytes",
                  "peak_device_bytes", "kv_stats", "date", "version"):
            assert k in r
        assert r["tps_mean"] > 0 and len(r["samples"]) == 2 and r["kv_stats"]["tokens"] > 0
    assert {r["test"] for r in rows} == {"pp16", "tg4 @ d0", "tg4 @ d64"}
    assert [r for r in rows if r["kv"] == "hca" and r["test"] == "tg4 @ d64"][0]["kv_stats"]["tokens_store"] > 0
    table = list(csv.DictReader(io.StringIO(run(["bench", d, *BENCH, "-o", "csv"], capsys))))
    assert len(table) == 6 and float(table[0]["tps_mean"]) > 0 and "kv_tokens" in table[0]
    md = run(["bench", d, *BENCH], capsys).strip().splitlines()
    assert md[0].startswith("| model") and len(md) == 2 + 6


def test_plan_bare_llama3_config(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA3_8B))
    out = run(["plan", str(cfg), "--ctx", "4M", "--kv", "hca", "--kv-budget", "0.125", "--dtype", "bfloat16",
               "--gpu-mem", "80G", "-o", "json"], capsys)
    r = json.loads(out)
    tiers = {t["tier"]: t for t in r["tiers"]}
    assert tiers["key store"]["bytes_per_token"] == 16384 and tiers["value pool"]["bytes_per_token"] == 65536
    assert r["available"]["device"] == 80 << 30 and r["fits"] in (True, False)
    text = run(["plan", str(cfg), "--ctx", "4M", "--gpu-mem", "80G"], capsys)
    assert "| key store | device |" in text and "largest ctx that fits" in text
