"""Bad inputs, as a new user types them: each gets one clear line and the right exit status, never a
traceback, and numeric options fail where they are parsed, before any model is loaded (the rows
name a model directory that does not exist: a check made after loading would say so instead)."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from shared import run_cli

NO_MODEL = "/nonexistent/minirun-model"
CPUS = os.cpu_count()
HUGE = "99999999999999999999"          # past a C long: an OverflowError deep in torch when not bounded
USAGE, ERROR = 2, 1            # click's status for a bad option value; MiniRunError's


def _numeric_rows():
    """(args, exit status, fragment of the message) for every numeric option's bounds."""
    g = ["generate", NO_MODEL, "-p", "hi"]
    rows = [
        (g + ["--kv", "hca", "--window", "0"], USAGE, "'--window': 0 is not in the range 1<=x<=1099511627776"),
        (g + ["--kv", "hca", "--window", "-5"], USAGE, "'--window': -5 is not in the range 1<=x<=1099511627776"),
        (g + ["--sinks", "-1"], USAGE, "'--sinks': -1 is not in the range 0<=x<=1099511627776"),
        (g + ["-n", "-1"], USAGE, "'--max-tokens': -1 is not in the range 0<=x<=1099511627776"),
        (g + ["--threads", "0"], USAGE, f"'--threads': 0 is not in the range 1<=x<={CPUS}"),
        (g + ["--max-select", "0"], USAGE, "'--max-select': 0 is not in the range 1<=x<=1099511627776"),
        (g + ["--tau", "0"], USAGE, "'--tau': 0.0 is not in the range 0.0<x<=1.0"),
        (g + ["--tau", "1.5"], USAGE, "'--tau': 1.5 is not in the range"),
        (g + ["--tau", "nan"], USAGE, "'--tau': 'nan' is not a finite number"),
        (g + ["--ctx", "0"], USAGE, "context size must be positive"),
        (g + ["--ctx", "-5"], USAGE, "bad context size '-5'"),
        (g + ["--ctx", "lots"], USAGE, "bad context size 'lots'"),
        (g + ["--temperature", "-1"], USAGE, "'--temp': -1.0 is not in the range x>=0.0"),
        (g + ["--temperature", "inf"], USAGE, "'inf' is not a finite number"),
        (g + ["--top-k", "-1"], USAGE, "'--top-k': -1 is not in the range 0<=x<=1099511627776"),
        (g + ["--top-p", "0"], USAGE, "'--top-p': 0.0 is not in the range 0.0<x<=1.0"),
        (g + ["--top-p", "1.5"], USAGE, "'--top-p': 1.5 is not in the range"),
        (g + ["--min-p", "1"], USAGE, "'--min-p': 1.0 is not in the range 0.0<=x<1.0"),
        (g + ["--repetition-penalty", "0"], USAGE, "'--repetition-penalty': 0.0 is not in the range x>0.0"),
        (g + ["--seed", "-1"], USAGE, "'--seed': -1 is not in the range"),
        (["chat", NO_MODEL, "--window", "0"], USAGE, "'--window': 0 is not in the range 1<=x<=1099511627776"),
        (["chat", NO_MODEL, "-n", "-3"], USAGE, "'--max-tokens': -3 is not in the range 0<=x<=1099511627776"),
        (["bench", NO_MODEL, "-r", "0"], USAGE, "'--reps': 0 is not in the range 1<=x<=1000"),
        (["bench", NO_MODEL, "-n", "-1"], USAGE, "'--n-gen': -1 is not in the range 0<=x<=1099511627776"),
        (["bench", NO_MODEL, "--threads", "0"], USAGE, f"'--threads': 0 is not in the range 1<=x<={CPUS}"),
        (["bench", NO_MODEL, "--window", "0"], USAGE, "'--window': 0 is not in the range 1<=x<=1099511627776"),
        (["bench", NO_MODEL, "--tau", "2"], USAGE, "'--tau': 2.0 is not in the range"),
        (["plan", NO_MODEL, "--window", "0"], USAGE, "'--window': 0 is not in the range 1<=x<=1099511627776"),
        (["plan", NO_MODEL, "--sinks", "-1"], USAGE, "'--sinks': -1 is not in the range 0<=x<=1099511627776"),
        (["plan", NO_MODEL, "--gpu-mem", "lots"], USAGE, "bad memory size 'lots'"),
        (["calibrate", NO_MODEL, "--tokens", "0"], USAGE, "'--tokens': 0 is not in the range 1<=x<=1099511627776"),
        (["calibrate", NO_MODEL, "--iters", "0"], USAGE, "'--iters': 0 is not in the range 1<=x<=1000000"),
        (["calibrate", NO_MODEL, "--centroids", "1"], USAGE, "'--centroids': 1 is not in the range 2<=x<=32768"),
        (["eval", NO_MODEL, "--trials", "0"], USAGE, "'--trials': 0 is not in the range 1<=x<=1000000"),
        (["eval", NO_MODEL, "--ppl-tokens", "-1"], USAGE, "'--ppl-tokens': -1 is not in the range 0<=x<=1099511627776"),
        (["eval", NO_MODEL, "--window", "0"], USAGE, "'--window': 0 is not in the range 1<=x<=1099511627776"),
    ]
    huge = [   # every integer option bounded above where it is parsed (sizes read without a float)
        (g + ["--threads", HUGE], USAGE, f"'--threads': {HUGE} is not in the range 1<=x<={CPUS}"),
        (g + ["--threads", str(CPUS + 1)], USAGE, f"is not in the range 1<=x<={CPUS}"),
        (["chat", NO_MODEL, "--threads", HUGE], USAGE, f"'--threads': {HUGE} is not in the range"),
        (["bench", NO_MODEL, "--threads", HUGE], USAGE, f"'--threads': {HUGE} is not in the range"),
        (["serve", NO_MODEL, "--threads", HUGE], USAGE, f"'--threads': {HUGE} is not in the range"),
        (["calibrate", NO_MODEL, "--threads", HUGE], USAGE, f"'--threads': {HUGE} is not in the range"),
        (["eval", NO_MODEL, "--threads", HUGE], USAGE, f"'--threads': {HUGE} is not in the range"),
        (["serve", NO_MODEL, "--max-queue", HUGE], USAGE, "'--max-queue': 99999999999999999999 is not in the range"),
        (["bench", NO_MODEL, "-r", HUGE], USAGE, f"'--reps': {HUGE} is not in the range 1<=x<=1000"),
        (["bench", NO_MODEL, "-n", HUGE], USAGE, f"'--n-gen': {HUGE} is not in the range 0<=x<=1099511627776"),
        (["bench", NO_MODEL, "-p", HUGE], ERROR, f"-p: {HUGE} is more than the largest context minirun takes"),
        (["bench", NO_MODEL, "-d", "0," + HUGE], ERROR, f"-d: {HUGE} is more than the largest context"),
        (["bench", NO_MODEL, "--ctx", HUGE], USAGE, "is more than the largest minirun takes, 1099511627776"),
        (g + ["--ctx", "99999999999999999999999999"], USAGE, "context size '99999999999999999999999999' is more than"),
        (g + ["--ctx", "2049G"], USAGE, "context size '2049G' is more than the largest minirun takes"),
        (g + ["-n", HUGE], USAGE, f"'--max-tokens': {HUGE} is not in the range 0<=x<=1099511627776"),
        (g + ["--top-k", HUGE], USAGE, f"'--top-k': {HUGE} is not in the range"),
        (g + ["--window", HUGE], USAGE, f"'--window': {HUGE} is not in the range 1<=x<=1099511627776"),
        (g + ["--sinks", HUGE], USAGE, f"'--sinks': {HUGE} is not in the range 0<=x<=1099511627776"),
        (g + ["--max-select", HUGE], USAGE, f"'--max-select': {HUGE} is not in the range"),
        (g + ["--hca-opt", "far_distance=" + HUGE], USAGE, f"far_distance must be at most 1099511627776, got {HUGE}"),
        (g + ["--hca-opt", "prefill_chunk=" + HUGE], USAGE, "prefill_chunk must be at most 1099511627776"),
        (g + ["--hca-opt", "far_distance=1e20"], USAGE, "far_distance: '1e20' is not a valid int"),
        (g + ["--kv", "hca", "--kv-budget", f"g{HUGE}c16"], ERROR, f"groups must be at most 65536, got {HUGE}"),
        (["plan", NO_MODEL, "--gpu-mem", "99999999999999999999999T"], USAGE,
         "memory size '99999999999999999999999T' is more than 1024 TiB"),
        (["plan", NO_MODEL, "--window", HUGE], USAGE, f"'--window': {HUGE} is not in the range"),
        (["calibrate", NO_MODEL, "--groups", HUGE], USAGE, f"'--groups': {HUGE} is not in the range 1<=x<=65536"),
        (["calibrate", NO_MODEL, "--tokens", HUGE], USAGE, f"'--tokens': {HUGE} is not in the range"),
        (["eval", NO_MODEL, "--passkey-copies", HUGE], USAGE, f"'--passkey-copies': {HUGE} is not in the range"),
        (["eval", NO_MODEL, "--ppl-tokens", HUGE], USAGE, f"'--ppl-tokens': {HUGE} is not in the range"),
    ]
    return rows + huge


def _file_rows(tmp: Path, tiny: Path):
    """Rows over files made in tmp: broken config.json files, GGUF files, prompt caches."""
    def model_with(config) -> str:
        d = tmp / f"cfg{len(list(tmp.glob('cfg*')))}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        return str(d)
    cfg = json.loads((tiny / "config.json").read_text())
    gguf = tmp / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2, 5) + bytes(8))   # version 3, 2 tensors, 5 keys: cut short
    g = ["-p", "hi"]
    empty, blank = tmp / "empty.txt", tmp / "blank.txt"
    empty.write_bytes(b"")
    blank.write_text(" \n\n\t\n")
    return [
        (["generate", model_with([cfg]), *g], ERROR, "config.json: the top level is a list, not an object"),
        (["generate", model_with({**cfg, "hidden_size": "64"}), *g], ERROR,
         'config.json: hidden_size must be an integer, got a string ("64")'),
        (["generate", model_with({**cfg, "num_key_value_heads": 0}), *g], ERROR,
         "config.json: num_key_value_heads must be at least 1, got 0"),
        (["generate", model_with({**cfg, "num_key_value_heads": 3}), *g], ERROR,
         "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
        (["generate", model_with({**cfg, "num_attention_heads": -4}), *g], ERROR,
         "config.json: num_attention_heads must be at least 1, got -4"),
        (["generate", model_with({**cfg, "rms_norm_eps": None}), *g], ERROR, "rms_norm_eps must be a positive number"),
        (["generate", model_with({k: v for k, v in cfg.items() if k != "vocab_size"}), *g], ERROR,
         "config.json lacks vocab_size"),
        (["plan", model_with({**cfg, "hidden_size": 64.5})], ERROR, "hidden_size must be an integer, got a number"),
        (["generate", str(gguf), *g], ERROR,
         f"is a GGUF file: convert it once with `minirun convert {gguf} {tmp / 'SmolLM2-135M-Instruct'}`"),
        (["convert", str(gguf), str(tmp / "out")], ERROR, "is truncated"),
        (["convert", str(tmp / "nope.gguf"), str(tmp / "out")], ERROR, "GGUF file not found"),
        (["generate", str(tiny), "-p", "hi", "--prompt-cache", str(tmp / "typo.kv"), "--prompt-cache-ro"], ERROR,
         f"--prompt-cache-ro: no such file {tmp / 'typo.kv'}"),
        (["generate", str(tiny), "-f", str(tmp)], USAGE, "is a directory"),
        (["chat", str(tiny), "--file", str(tmp)], ERROR, "cannot read --file"),
        (["chat", str(tiny), "--file", str(tmp / "missing.txt")], ERROR, "cannot read --file"),
        (["chat", str(tiny), "--file", str(empty)], ERROR, f"--file {empty} is empty: nothing to read"),
        (["chat", str(tiny), "--file", str(blank)], ERROR, f"--file {blank} is empty (only white space)"),
        (["generate", str(tiny), "-f", str(empty)], ERROR, f"--file {empty} is empty: nothing to read"),
        (["generate", str(tiny), "-p", ""], ERROR, "empty prompt: give some text with -p"),
        # nothing fits at any context: what does not is named (it was "the largest context that fits is 0")
        (["generate", str(tiny), *g, "--kv", "hca", "--window", str(10**12)], ERROR,
         "--window 1000000000000 does not fit at any context: the 1000000000016 tokens kept exact"),
        (["generate", str(tiny), *g, "--kv", "hca", "--sinks", str(10**12)], ERROR,
         "--sinks 1000000000000 does not fit at any context"),
        (["generate", model_with({**cfg, "vocab_size": 10**12}), *g], ERROR,
         "the model itself does not fit at any context: its weights need"),
    ]


@pytest.mark.parametrize("args,code,fragment", _numeric_rows(), ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_numeric_option_bounds(args, code, fragment, capsys):
    got, _, err = run_cli(args, capsys)
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert got == code and len(lines) == 1 and fragment in lines[0], err
    assert "no such model" not in err                                       # (failed before the model)


def test_bad_files(tiny_model_dir, tmp_path, capsys):
    """config.json field by field, GGUF files given as models or truncated, prompt-cache and --file
    paths that do not exist: one line each naming what is wrong."""
    for args, code, fragment in _file_rows(tmp_path, tiny_model_dir("gqa-untied")):
        got, _, err = run_cli(args, capsys)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert "Traceback" not in err and got == code and len(lines) == 1 and fragment in lines[0], (args, err)


@pytest.mark.parametrize("setting,value,fragment", [
    ("window", 0, "window must be at least 1"), ("window", -5, "window must be at least 1"),
    ("sinks", -1, "sinks must be at least 0"), ("threads", 0, "threads must be at least 1"),
    ("max_select", 0, "max_select must be at least 1"), ("prefill_chunk", 0, "prefill_chunk must be at least 1"),
    ("window", "256", "window must be an integer"), ("tau", 0.0, "tau must be in (0, 1]"),
    ("kv_budget", "0.25", "kv_budget must be a number"),
    ("threads", 10**20, "threads must be at most"), ("threads", (os.cpu_count() or 1) + 1, "(this machine's CPUs)"),
    ("far_distance", 10**20, "far_distance must be at most 1099511627776"),
    ("prefill_chunk", 10**20, "prefill_chunk must be at most"), ("ctx", 10**20, "is more than the largest"),
    ("ctx", "99999999999999999999999999", "is more than the largest"), ("centroids", 1 << 20, "at most 32768")])
def test_engine_settings_fail_before_loading(setting, value, fragment):
    """The same bounds from Python: EngineConfig refuses them before Engine.load looks at the model."""
    from minirun import Engine
    from minirun.errors import MiniRunError
    with pytest.raises(MiniRunError) as e:
        Engine.load(NO_MODEL, kv="hca", **{setting: value})
    assert fragment in str(e.value)


def test_binary_and_non_utf8_files_are_warned_about(tiny_model_dir, tmp_path, capsys):
    d = str(tiny_model_dir("gqa-untied"))
    binary, latin1 = tmp_path / "a.bin", tmp_path / "latin1.txt"
    binary.write_bytes(bytes(range(256)) * 4)
    latin1.write_bytes("café, naïve: façade".encode("latin-1"))
    for path, fragment in ((binary, "looks binary (it holds NUL bytes)"),
                           (latin1, "is not UTF-8 text: 3 undecodable byte sequences")):
        code, _, err = run_cli(["generate", d, "-f", str(path), "-n", "1"], capsys)
        warnings = [ln for ln in err.splitlines() if "warning" in ln]
        assert code == 0 and "Traceback" not in err and len(warnings) == 1 and fragment in warnings[0], err


def test_generate_says_why_it_stopped_at_a_full_context(tiny_model_dir, capsys):
    code, _, err = run_cli(["generate", str(tiny_model_dir("gqa-untied")), "-p", "hello", "-n", "100",
                            "--ctx", "40", "--ignore-eos"], capsys)
    assert code == 0 and "[context full: stopped after" in err and "of 100 tokens (-n)" in err and "(--ctx)" in err
    code, _, err = run_cli(["generate", str(tiny_model_dir("gqa-untied")), "-p", "hello", "-n", "3"], capsys)
    assert code == 0 and "context full" not in err


def test_default_model_lives_in_one_per_user_place(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """`minirun chat` without a model, from any directory, takes the default model from the models
    directory ($MINIRUN_MODELS here) and pulls nothing; every command finds a model there by name."""
    models = tmp_path / "models"
    models.mkdir()
    shutil.copytree(tiny_model_dir("gqa-untied"), models / "SmolLM2-135M-Instruct")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**__import__("os").environ, "MINIRUN_MODELS": str(models)}
    p = subprocess.run([sys.executable, "-m", "minirun", "chat", "-n", "2"], input="hi\n/exit\n", cwd=elsewhere,
                       env={**env, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "minirun chat: SmolLM2-135M-Instruct" in p.stderr, p.stderr
    assert "pulling" not in p.stderr and list(elsewhere.iterdir()) == []
    monkeypatch.setenv("MINIRUN_MODELS", str(models))
    code, _, err = run_cli(["generate", "smollm2", "-p", "hi", "-n", "1"], capsys)
    assert code == 0 and "tok/s" in err
    from minirun.checkpoint.pull import default_models_dir
    monkeypatch.delenv("MINIRUN_MODELS")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_models_dir() == tmp_path / ".cache" / "minirun" / "models"


def test_plan_names_what_never_fits(tiny_model_dir, tmp_path, capsys):
    """`plan` where no context fits: the verdict names the window or the model itself, not
    "largest ctx that fits: 0" (whose --ctx 0 is refused)."""
    cfg = json.loads((tiny_model_dir("gqa-untied") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "vocab_size": 10**12}))
    for args, fragment in (([str(tmp_path / "config.json")], "the model itself does not fit at any context"),
                           ([str(tiny_model_dir("gqa-untied")), "--kv", "hca", "--window", str(10**12)],
                            "--window 1000000000000 does not fit at any context")):
        code, out, err = run_cli(["plan", *args, "--device", "cpu"], capsys)
        verdict = [ln for ln in out.splitlines() if ln.startswith("does NOT fit")]
        assert code == 1 and "Traceback" not in err and len(verdict) == 1 and fragment in verdict[0], out
        assert "largest ctx that fits: 0" not in out
        code, out, _ = run_cli(["plan", *args, "--device", "cpu", "-o", "json"], capsys)
        report = json.loads(out)
        assert report["largest_ctx"] == 0 and fragment in report["note"]


@pytest.mark.parametrize("args,warning", [
    (["--hca-opt", "rescore=true"], "--hca-opt rescore=true does nothing with --kv dense"),
    (["--window", "512"], "--window 512 does nothing with --kv dense"),
    (["--kv-budget", "g16c16"], "--kv-budget g16c16 does nothing with --kv dense"),
    (["--kv", "hca", "--hca-opt", "value_sum=gpu"], "--hca-opt value_sum=gpu does nothing on a CPU"),
    (["--kv", "hca", "--hca-opt", "cuda_graphs=false"], "--hca-opt cuda_graphs=false does nothing on a CPU"),
    (["--kv", "hca", "--kv-budget", "0.5", "--hca-opt", "rescore=true"], "rescore=true does nothing with exact keys"),
    (["--kv", "hca", "--hca-opt", "far_positions=off", "--hca-opt", "far_distance=64"],
     "far_distance=64 does nothing with far_positions=off"),
    (["--kv", "hca", "--hca-opt", "prefill_mode=exact", "--hca-opt", "anchor_tokens=64"],
     "anchor_tokens=64 does nothing with prefill_mode=exact"),
])
def test_settings_that_do_nothing_are_warned_about(args, warning, tiny_model_dir, capsys):
    """One warning line on stderr for a setting the chosen mode ignores (plan: the same check as
    every command taking --hca-opt); the command still runs."""
    code, _, err = run_cli(["plan", str(tiny_model_dir("gqa-untied")), "--device", "cpu", "--ctx", "1K", *args],
                           capsys)
    warnings = [ln for ln in err.splitlines() if "warning" in ln]
    assert code == 0 and len(warnings) == 1 and warning in warnings[0], err


def test_settings_in_use_are_not_warned_about(tiny_model_dir, capsys):
    """The same settings where they act, and defaults given explicitly: no warning; generate and
    bench warn as plan does."""
    d = str(tiny_model_dir("gqa-untied"))
    for args in (["--kv", "hca", "--hca-opt", "rescore=true", "--window", "512"], ["--hca-opt", "rescore=false"],
                 ["--window", "256"], ["--kv", "hca", "--hca-opt", "value_sum=auto"]):
        code, _, err = run_cli(["plan", d, "--device", "cpu", "--ctx", "1K", *args], capsys)
        assert code == 0 and "warning" not in err, (args, err)
    code, _, err = run_cli(["generate", d, "-p", "hi", "-n", "1", "--device", "cpu", "--tau", "0.5"], capsys)
    assert code == 0 and err.count("warning") == 1 and "--tau 0.5 does nothing with --kv dense" in err
    code, _, err = run_cli(["bench", d, "--kv", "dense", "-p", "8", "-n", "0", "-r", "1", "--device", "cpu",
                            "--hca-opt", "rescore=true"], capsys)
    assert code == 0 and err.count("warning") == 1 and "rescore=true does nothing with --kv dense" in err
