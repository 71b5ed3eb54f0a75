"""Planner arithmetic by hand, the refusal message, and `minirun bench` / `minirun plan` output formats."""
import csv
import io
import json

import pytest
import torch

from minirun import Engine
from minirun.tools.bench import FIELDS, Context, bench_ctx, tokens_needed
from minirun.tools.bench_output import MD_HEAD
from minirun.cli.main import main
from minirun.cli.bench import SizeType, _modes
from minirun.config import EngineConfig, ModelArgs
from minirun.errors import ContextError
from minirun import planner
from minirun.planner import ANCHOR_BLOCK, PREFILL_KEYS, PREFILL_VALUES, check_fits, largest_ctx, param_count, plan

SMOLLM2 = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
LLAMA3_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
M4 = 4 * 1024 * 1024
KiB, GiB = 1024, 1 << 30


def test_smollm2_bytes_per_tier_at_4m():
    a = ModelArgs.from_dict(SMOLLM2)
    L, Hkv, d, Hq = 30, 3, 64, 9
    dense = plan(a, EngineConfig(kv="dense", dtype="bfloat16", ctx=M4)).tiers
    assert dense["dense K+V"] == (4 * L * Hkv * d * M4, "device")
    assert 4 * L * Hkv * d == 23040 == 22.5 * KiB                                # K+V, 2 bytes each, per token
    assert set(dense) == {"weights", "dense K+V"}

    t = plan(a, EngineConfig(kv="hca", kv_budget=0.125, dtype="bfloat16", ctx=M4, device="cuda")).tiers
    n_store = M4 - 16 - 256                                                      # sinks and ring stay exact
    assert t["key store"] == (2 * L * Hkv * 16 * n_store, "device")             # g = d/4 = 16 int16 indices
    assert 2 * L * Hkv * 16 == 2880 == 23040 // 8                               # exactly the 12.5% preset
    assert t["value pool"] == (2 * L * Hkv * d * n_store, "host")               # float16 values
    assert t["sinks+ring K+V"] == (4 * L * Hkv * d * 273, "device")               # + the GPU step's spare row
    assert t["codebooks"] == (L * Hkv * 16 * 1024 * 4 * 4, "device")            # g x c centroids of d/g f32
    assert t["scratch"] == (Hq * n_store * 8, "device")                         # f32 score + i32 index
    t_cpu = plan(a, EngineConfig(kv="hca", kv_budget=0.125, dtype="bfloat16", ctx=M4, device="cpu")).tiers
    assert t_cpu["scratch"] == (Hq * n_store * 10, "device")                    # + u16 level (CPU)
    assert t_cpu["sinks+ring K+V"] == (4 * L * Hkv * d * 272, "device")
    # the CPU kernels also hold the codebooks transposed and their norms, and a fixed decode scratch
    assert t_cpu["codebooks"] == (2 * L * Hkv * 16 * 1024 * 4 * 4 + L * Hkv * 16 * 1024 * 4, "device")
    import numba
    assert t_cpu["decode scratch"] == (Hq * 16 * 1024 * 4 + Hkv * 16 * 1024 * 8 + Hq * 24
                                       + numba.config.NUMBA_NUM_THREADS * Hq * 4096 * 4 + L * Hkv * 16 * 2, "device")
    assert "decode scratch" not in t
    # transient: an exact prefill (auto mode: prompts up to 65536 tokens on a GPU, the trained 8192
    # on a CPU) keeps f32 keys of the store tokens until it ends, on a GPU with a device copy of their
    # values; an anchor prefill (longer prompts) holds 2048 - 16 anchor keys (f32) and, on a GPU, their values
    assert t[PREFILL_KEYS] == (4 * L * Hkv * d * (65536 - 272), "device")
    assert t[PREFILL_VALUES] == (2 * L * Hkv * d * (65536 - 272), "device")
    assert t[ANCHOR_BLOCK] == ((4 + 2) * L * Hkv * d * (2048 - 16), "device")
    assert t_cpu[PREFILL_KEYS] == (4 * L * Hkv * d * (8192 - 272), "host") and PREFILL_VALUES not in t_cpu
    assert t_cpu[ANCHOR_BLOCK] == (4 * L * Hkv * d * (2048 - 16), "device")
    assert t["sinks+ring copies"] == (8 * L * Hkv * d * 272, "device")            # the two rewind points
    assert len(t) == 10

    t25 = plan(a, EngineConfig(kv="hca", kv_budget=0.25, dtype="bfloat16", ctx=M4, device="cuda")).tiers
    assert t25["key store"][0] == 2 * L * Hkv * 32 * n_store                    # g = d/2: 25%
    assert t25["codebooks"][0] == L * Hkv * 32 * 1024 * 2 * 4
    t50 = plan(a, EngineConfig(kv="hca", kv_budget=0.5, dtype="bfloat16", ctx=M4, device="cuda")).tiers
    # the 50% preset keeps exact keys, and HCACache stores them in float32 whatever the dtype
    assert t50["key store"][0] == 4 * L * Hkv * d * n_store
    assert "codebooks" not in t50 and PREFILL_KEYS not in t50


def test_llama3_8b_bytes_per_tier_at_4m():
    a = ModelArgs.from_dict(LLAMA3_8B)
    L, Hkv, d, Hq = 32, 8, 128, 32
    assert param_count(a) == (32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096)
                              + 2 * 128256 * 4096 + 4096) == 8_030_261_248
    dense = plan(a, EngineConfig(kv="dense", dtype="bfloat16", ctx=M4)).tiers
    assert dense["dense K+V"][0] == 128 * KiB * M4 == 512 * GiB                # 128 KiB per token
    assert dense["weights"] == (2 * 8_030_261_248, "device")
    t = plan(a, EngineConfig(kv="hca", kv_budget=0.125, dtype="bfloat16", ctx=M4, device="cuda")).tiers
    n_store = M4 - 272
    assert t["key store"] == (2 * L * Hkv * 32 * n_store, "device")             # 16 KiB per token = 1/8
    assert 2 * L * Hkv * 32 == 16 * KiB
    assert t["value pool"] == (2 * L * Hkv * d * n_store, "host")               # 64 KiB per token
    assert t["sinks+ring K+V"] == (4 * L * Hkv * d * 273, "device")             # 34 MiB (272 + the spare row)
    assert t["codebooks"] == (L * Hkv * 32 * 1024 * 4 * 4, "device")            # 128 MiB
    assert t["scratch"] == (Hq * n_store * 8, "device")
    assert t[PREFILL_KEYS] == (4 * L * Hkv * d * 65264, "device")               # 128 KiB/token f32: ~8 GiB
    assert t[ANCHOR_BLOCK] == ((4 + 2) * L * Hkv * d * 2032, "device")
    assert t["weights"] == dense["weights"]


def test_planner_transient_and_exact_keys_match_the_cache(tiny_model_dir):
    """The prefill-only keys and the f32 exact-key store, as HCACache allocates them."""
    d = tiny_model_dir("gqa-untied")
    ids = torch.randint(4, 300, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    for budget, dtype in ((0.125, "float32"), (0.5, "bfloat16")):
        eng = Engine.load(d, device="cpu", ctx=600, kv="hca", kv_budget=budget, dtype=dtype, centroids=32,
                          window=32, sinks=4, prefill_chunk=100)
        peak = []
        eng.prefill(ids, progress=lambda *_: peak.append(eng.kv_stats()["prefill_keys_bytes"]))
        p, s = plan(eng.args, eng.config).tiers, eng.kv_stats()
        assert p["key store"][0] == s["device_keys_bytes"]
        assert p.get(PREFILL_KEYS, (0,))[0] == max(peak)
        assert ANCHOR_BLOCK not in p                                              # ctx <= exact_prefill_max


def test_refusal_names_the_largest_ctx_that_fits():
    a = ModelArgs.from_dict(SMOLLM2)
    cfg = EngineConfig(kv="dense", dtype="bfloat16", ctx=M4)
    avail = {"host": 4 * GiB, "device": None}
    cpu = torch.device("cpu")
    with pytest.raises(ContextError) as e:
        check_fits(a, cfg, cpu, avail)
    msg = str(e.value)
    assert "\n" not in msg and "the largest context that fits is" in msg
    best = largest_ctx(a, cfg, cpu, avail)
    # by hand: weights + 23040 B/token <= 4 GiB
    weights = 2 * (30 * (576 * 960 + 576 * 576 + 3 * 576 * 1536 + 2 * 576) + 49152 * 576 + 576)
    assert best == (4 * GiB - weights) // 23040
    assert f"--ctx {best}" in msg and f"is {best}" in msg
    check_fits(a, EngineConfig(kv="dense", dtype="bfloat16", ctx=best), cpu, avail)
    with pytest.raises(ContextError):
        check_fits(a, EngineConfig(kv="dense", dtype="bfloat16", ctx=best + 1), cpu, avail)
    # on a GPU the device tiers are checked against the GPU's memory, the value pool against the host's
    hca = EngineConfig(kv="hca", kv_budget=0.125, dtype="bfloat16", ctx=M4)
    gpu = {"host": 1 << 40, "device": 4 * GiB}
    with pytest.raises(ContextError) as e:
        check_fits(a, hca, torch.device("cuda"), gpu)
    best = largest_ctx(a, hca, torch.device("cuda"), gpu)
    assert "GPU memory" in str(e.value) and str(best) in str(e.value)
    assert plan(a, hca, best).bytes_on("device") <= 4 * GiB < plan(a, hca, best + 1).bytes_on("device")


def test_parallel_sequences_each_count_a_cache():
    """serve --parallel N: N caches of ctx tokens, one copy of the weights; a refusal names the
    largest N that fits at this ctx."""
    a = ModelArgs(**SMOLLM2)
    one, four = (plan(a, EngineConfig(kv="dense", ctx=8192, parallel=n)) for n in (1, 4))
    kv = one.tiers["dense K+V"][0]
    assert four.tiers["dense K+V"][0] == 4 * kv and four.tiers["weights"] == one.tiers["weights"]
    avail = {"host": one.bytes_on("device") + 2 * kv + kv // 2, "device": None}
    check_fits(a, EngineConfig(kv="dense", ctx=8192, parallel=2), torch.device("cpu"), avail)
    with pytest.raises(ContextError) as e:
        check_fits(a, EngineConfig(kv="dense", ctx=8192, parallel=4), torch.device("cpu"), avail)
    assert "--parallel 4 x --ctx 8192" in str(e.value) and "or --parallel 3" in str(e.value)


def run(args, capsys):
    try:
        main(args)
    except SystemExit as e:
        assert e.code in (0, None), capsys.readouterr().err
    return capsys.readouterr()


BENCH = ["-p", "16", "-n", "4", "-d", "0,64", "--kv", "dense,hca", "--kv-budget", "0.125", "-r", "2", "--window", "16",
         "--sinks", "4"]


def test_bench_json_csv_markdown(tiny_model_dir, capsys):
    d = str(tiny_model_dir("gqa-untied"))
    out = run(["bench", d, *BENCH, "-o", "json"], capsys)
    assert "bench: hca 0.125 tg4 @ d64" in out.err                           # status lines on stderr
    rows = json.loads(out.out)
    assert len(rows) == 6                                  # 2 modes x (pp16, tg4@d0, tg4@d64)
    assert [(r["kv"], r["test"]) for r in rows] == [(kv, t) for kv in ("dense", "hca")
                                                    for t in ("pp16", "tg4 @ d0", "tg4 @ d64")]
    for r in rows:
        assert list(r) == FIELDS
        assert r["tps_mean"] > 0 and r["tps_std"] >= 0 and len(r["samples"]) == 2 and r["reps"] == 2
        assert r["peak_host_bytes"] > 0 and r["peak_host_scope"] in ("test", "process")
        assert r["ctx"] == 256 and r["dtype"] == "float32" and r["threads"] >= 1
        assert r["model_params"] == 112448 and r["model_bytes"] == 4 * 112448
        pp = r["test"] == "pp16"
        assert (r["n_prompt"], r["n_gen"], r["depth"]) == ((16, 0, 0) if pp else (0, 4, int(r["test"].split("@ d")[1])))
        assert r["kv_stats"]["tokens"] == (16 if pp else max(r["depth"], 1) + 4)   # after the last rep
        assert r["kv_budget"] == (None if r["kv"] == "dense" else 0.125)
        assert r["codebooks"] == ("-" if r["kv"] == "dense" else "fitted")   # no codebook file here
        assert r["context"] == "random" and r["cuda_graphs"] == "off"
        if r["kv"] == "hca" and r["depth"] == 64:                   # a store to select from
            assert 0 < r["selected"] <= 1
        elif r["kv"] == "dense" or pp:
            assert r["selected"] is None
    deep = rows[-1]["kv_stats"]
    assert deep["tokens_store"] == 68 - 4 - 16 and deep["codebook_bytes"] > 0

    table = list(csv.DictReader(io.StringIO(run(["bench", d, *BENCH, "-o", "csv"], capsys).out)))
    assert len(table) == 6 and float(table[0]["tps_mean"]) > 0
    assert [f for f in FIELDS if f != "kv_stats"] == list(table[0])[:len(FIELDS) - 1]
    assert {"kv_tokens", "kv_device_kv_bytes", "kv_host_values_bytes"} <= set(table[0])
    assert len(table[3]["samples"].split()) == 2 and table[0]["kv_budget"] == "" and table[3]["kv_budget"] == "0.125"

    md = run(["bench", d, *BENCH], capsys).out.strip().splitlines()
    assert md[0].startswith("| model | size | params |") and "| t/s |" in md[0] and md[1].startswith("| ---")
    assert len(md) == 2 + 6 and all(line.count("|") == md[0].count("|") for line in md)
    assert "tg4 @ d64" in md[-1] and "±" in md[-1] and "fitted" in md[-1] and "| random |" in md[-1]
    assert md[-1].split("|")[MD_HEAD.index("selected") + 1].strip().endswith("%")


def test_bench_context_text_and_file(tiny_model_dir, tmp_path, capsys):
    d = str(tiny_model_dir("gqa-untied"))
    args = ["-p", "16", "-n", "2", "-d", "40", "--kv", "hca", "-r", "1", "--window", "16", "--sinks", "4", "-o", "json"]
    rows = json.loads(run(["bench", d, *args, "--context", "text"], capsys).out)
    assert [r["context"] for r in rows] == ["text", "text"] and 0 < rows[1]["selected"] <= 1
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document. " * 3)
    rows = json.loads(run(["bench", d, *args, "--context", str(doc)], capsys).out)
    assert [r["context"] for r in rows] == ["doc.txt", "doc.txt"]
    with pytest.raises(SystemExit) as e:
        main(["bench", d, *args, "--context", str(tmp_path / "missing.txt")])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "cannot read --context" in err and "Traceback" not in err


def test_bench_selected_probe_fits_an_exact_ctx(tiny_model_dir, capsys):
    # the selection probe's untimed step must fit a cache of exactly depth + n tokens
    d = str(tiny_model_dir("gqa-untied"))
    rows = json.loads(run(["bench", d, "-p", "0", "-n", "4", "-d", "60", "--kv", "hca", "-r", "1", "--ctx", "64",
                           "--window", "16", "--sinks", "4", "-o", "json"], capsys).out)
    assert rows[0]["ctx"] == 64 and 0 < rows[0]["selected"] <= 1


def test_context_ids(tiny_model_dir):
    from minirun import Engine
    eng = Engine.load(str(tiny_model_dir("gqa-untied")), ctx=256)
    text = Context("text")
    ids = eng.tokenize(text._text)
    assert text.ids(eng, 50, seed=3) == ids[:50]                        # the text's first tokens
    toks, bos = eng.tokenize(text._text, add_bos=False), eng.tokenize("")
    long = text.ids(eng, len(ids) + 7, seed=0)
    assert long == (bos + toks + toks)[:len(ids) + 7]                   # repeated to length, one BOS
    assert ids == bos + toks and long[len(ids):] == toks[:7]
    rnd = Context("random")
    assert rnd.ids(eng, 40, seed=1) == rnd.ids(eng, 40, seed=1) != rnd.ids(eng, 40, seed=2)


def test_bench_options(tiny_model_dir, capsys):
    assert tokens_needed([512, 2048], 32, [0, 4096]) == 4128 and bench_ctx([512, 2048], 32, [0, 4096]) == 4352
    assert tokens_needed([], 4, [0]) == 5 and bench_ctx([16], 4, [0, 64]) == 256
    assert SizeType().convert("80G", None, None) == 80 * GiB == SizeType().convert("80GiB", None, None)
    assert SizeType().convert("512M", None, None) == 512 << 20
    d = str(tiny_model_dir("gqa-untied"))
    assert _modes("dense,hca", "0.125,g64c16") == [("dense", None), ("hca", 0.125), ("hca", "g64c16")]
    for args, err in ((["--kv-budget", "0.3"], "unknown --kv-budget '0.3'"), (["--kv", "paged"], "unknown kv mode"),
                      (["-p", "600", "--ctx", "512"], "too small for these tests"), (["-d", "x"], "-d: expected")):
        with pytest.raises(SystemExit) as e:
            main(["bench", d, *args])
        assert e.value.code == 1 and err in capsys.readouterr().err


def run_plan(args, capsys, code=0):
    """`minirun plan ARGS` -> its output; the exit status is 1 when the plan does not fit (code None:
    either, where the verdict depends on this machine's free host memory)."""
    with pytest.raises(SystemExit) as e:
        main(args)
        raise SystemExit(0)
    out = capsys.readouterr()
    assert (e.value.code or 0) == code or code is None and e.value.code in (0, 1, None), out.err
    return out


def test_plan_bare_llama3_config(tmp_path, capsys, monkeypatch):
    # the host side's MemAvailable moves between the JSON and the text call: hold it still
    real = planner.available_bytes
    monkeypatch.setattr(planner, "available_bytes", lambda device: {**real(device), "host": 20 * GiB})
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA3_8B))
    args = ["plan", str(cfg), "--ctx", "4M", "--kv", "hca", "--kv-budget", "0.125", "--dtype", "bfloat16"]
    r = json.loads(run_plan([*args, "--gpu-mem", "80G", "-o", "json"], capsys, code=1).out)
    n_store = M4 - 272
    tiers = {t["tier"]: t for t in r["tiers"]}
    assert r["ctx"] == M4 and r["params"] == 8_030_261_248 and r["dense_bytes_per_token"] == 128 * KiB
    assert tiers["key store"]["bytes"] == 16 * KiB * n_store and tiers["key store"]["bytes_per_token"] == 16 * KiB
    assert tiers["value pool"]["bytes"] == 64 * KiB * n_store and tiers["value pool"]["where"] == "host"
    assert tiers["value pool"]["bytes_per_token"] == 64 * KiB and tiers["weights"]["bytes_per_token"] is None
    assert tiers[PREFILL_KEYS]["transient"] and not tiers["key store"]["transient"]
    dev = (2 * 8_030_261_248 + 16 * KiB * n_store + 32 * 8 * 128 * 4 * 273 + 32 * 8 * 128 * 8 * 272   # (its copies)
           + 32 * 8 * 32 * 1024 * 16 + 32 * n_store * 8
           + (128 + 64) * KiB * (2032 + 65264))    # prefill: f32 keys and bf16 values (anchor block, exact prefill)
    assert r["device_bytes"] == dev and r["host_bytes"] == 64 * KiB * n_store
    # 4M tokens: 15 GiB weights + 64 GiB keys + 0.5 GiB scratch... > 80 GiB of GPU memory
    assert r["available"]["device"] == 80 * GiB and r["fits"] is False and 0 < r["largest_ctx"] < M4

    text = run_plan(args + ["--gpu-mem", "80G"], capsys, code=1).out
    assert "plan: ctx 4194304, kv hca 0.125, bfloat16, cuda, 8.03 B params" in text
    assert f"| key store | device | {16 * KiB * n_store} | 64.0 GiB | 16384 |" in text
    assert f"| value pool | host | {64 * KiB * n_store} | 256.0 GiB | 65536 |" in text
    assert "key store: 16384 B/token = 12.5% of dense K+V (131072 B/token in bfloat16)" in text
    assert f"GPU total: {dev} B" in text and "does NOT fit: GPU" in text
    assert f"(largest ctx that fits: {r['largest_ctx']})" in text

    if not torch.cuda.is_available():
        text = run_plan(args + ["--device", "cuda"], capsys, code=1).out       # no --gpu-mem, no GPU
        assert "cannot check free GPU memory" in text and "host side does NOT fit" in text
        r = json.loads(run_plan(args + ["--device", "cuda", "-o", "json", "--kv", "dense"], capsys).out)
        assert r["fits"] is None and r["largest_ctx"] is None and r["host_bytes"] == 0
        text = run_plan(args + ["--device", "cuda", "--kv", "dense"], capsys).out
        assert "host side" not in text                    # (nothing of a dense plan is on the host)
        text = run_plan(args, capsys, code=1).out          # --device auto: the CPU, as chat and generate
        assert "plan: ctx 4194304, kv hca 0.125, bfloat16, cpu" in text and "largest ctx that fits" in text
    text = run_plan([*args[:-6], "--kv", "dense", "--dtype", "bfloat16", "--device", "cpu"], capsys, code=1).out
    assert f"| dense K+V | host | {128 * KiB * M4} | 512.0 GiB | 131072 |" in text and "GPU total" not in text
    assert "does NOT fit: host 527.0 GiB" in text and "(largest ctx that fits: " in text   # (+ the weights)


def test_plan_defaults_are_those_of_chat_and_generate(tmp_path, capsys):
    """No options: dense, float32, the device chat would use; it fits (exit 0) with largest_ctx; a
    --ctx past max_position_embeddings (8K here) is noted, in the text and the JSON."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**SMOLLM2, "max_position_embeddings": 8192}))
    r = json.loads(run_plan(["plan", str(cfg), "-o", "json"], capsys).out)
    want_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert (r["kv"], r["dtype"], r["device"], r["ctx"], r["fits"]) == ("dense", "float32", want_device, 8192, True)
    assert r["largest_ctx"] > 8192 and r["trained_ctx"] == 8192 and r["ctx_note"] is None
    r = json.loads(run_plan(["plan", str(cfg), "--ctx", "16K", "--kv", "hca", "-o", "json"], capsys).out)
    assert r["kv_budget"] == 0.25 and "past the 8192 tokens this model was trained on" in r["ctx_note"]
    text = run_plan(["plan", str(cfg), "--ctx", "16K"], capsys).out
    assert text.splitlines()[-1].startswith("note: --ctx 16384 is past the 8192 tokens")


def test_plan_takes_explicit_codebooks(tmp_path, capsys):
    """--kv-budget g64c16 (4-bit codes in nibble pairs): the 12.5% preset's key bytes, the product
    codebooks on the GPU (32 pairs x 256 x 8 floats per layer and kv-head), named in the output."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SMOLLM2))
    args = ["plan", str(cfg), "--ctx", "4M", "--kv", "hca", "--dtype", "bfloat16", "--gpu-mem", "80G", "-o", "json"]
    r = json.loads(run_plan([*args, "--kv-budget", "g64c16"], capsys, code=None).out)
    r8 = json.loads(run_plan([*args, "--kv-budget", "0.125"], capsys, code=None).out)
    tiers = {t["tier"]: t for t in r["tiers"]}
    assert r["kv_budget"] == "g64c16" and r8["kv_budget"] == 0.125
    assert tiers["key store"]["bytes_per_token"] == 30 * 3 * 32 == {t["tier"]: t for t in r8["tiers"]}[
        "key store"]["bytes_per_token"]
    assert tiers["codebooks"]["bytes"] == 30 * 3 * 32 * 256 * 2 * 4
    out = run_plan(["plan", str(cfg), "--kv", "hca", "--kv-budget", "g64c16"], capsys).out
    assert "kv hca g64c16" in out
    with pytest.raises(SystemExit) as e:
        main(["plan", str(cfg), "--kv-budget", "g64"])
    assert e.value.code == 1 and "bad HCA setting 'g64'" in capsys.readouterr().err


def test_plan_prompt_cache_bytes_match_a_file_of_a_full_context(tiny_model_dir, tmp_path):
    """plan_report's prompt_cache_bytes against the prompt-cache file of a context filled to --ctx
    (the difference: the file's header, slot positions, the GPU's spare ring row in the plan)."""
    from minirun.planner import plan_report
    d = tiny_model_dir("gqa-untied")
    ids = torch.randint(4, 300, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    for kw in (dict(kv="dense"), dict(kv="hca", kv_budget=0.125, centroids=32, window=32, sinks=4),
               dict(kv="hca", groups=4, centroids=16, window=32, sinks=4), dict(kv="hca", kv_budget=0.5, window=32, sinks=4)):
        eng = Engine.load(d, device="cpu", ctx=600, **kw)
        eng.prefill(ids)
        size = eng.save_prompt_cache(tmp_path / "full.kv")
        want = plan_report(eng.args, eng.config, "cpu")["prompt_cache_bytes"]
        assert 0 <= size - want <= 16 * KiB, (kw, size, want)


def test_bench_parallel_rows(tiny_model_dir, capsys):
    """--parallel: a tg row per number of sequences decoding together (llama-batched-bench), the
    sequences' tokens counted together; bad counts are one-line errors."""
    d = str(tiny_model_dir("gqa-untied"))
    out = run(["bench", d, "-p", "", "-n", "3", "-d", "20", "--parallel", "1,3", "--kv", "dense,hca",
               "--kv-budget", "0.5", "-r", "1", "-o", "json"], capsys)
    rows = json.loads(out.out)
    assert [(r["kv"], r["test"], r["parallel"]) for r in rows] == [
        (kv, t, b) for kv in ("dense", "hca") for t, b in (("tg3 @ d20", 1), ("tg3 @ d20 x3", 3))]
    for r in rows:
        assert r["tps_mean"] > 0 and r["n_gen"] == 3 and r["kv_stats"]["tokens"] == 20 + 3
    for bad in ("0", "1,x", "65"):
        with pytest.raises(SystemExit) as e:
            main(["bench", d, "-p", "", "-n", "2", "--parallel", bad])
        assert e.value.code != 0
        err = capsys.readouterr().err.strip()
        assert "--parallel" in err and "Traceback" not in err and len(err.splitlines()) == 1, err
