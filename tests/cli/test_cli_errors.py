"""Every bad input gets one line on stderr and a non-zero exit, never a traceback."""
import json
import subprocess
import sys

import pytest

from minirun.cli.main import main


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def assert_one_line_error(code, err, *words):
    assert code != 0
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], lines[0]


def test_missing_model_dir(tmp_path, capsys):
    code, _, err = run_cli(["generate", str(tmp_path / "nope"), "-p", "hi"], capsys)
    assert_one_line_error(code, err, "no such model directory")


def test_corrupt_safetensors(tiny_model_dir, tmp_path, capsys):
    import shutil
    d = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir("gqa-untied"), d)
    (d / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    code, _, err = run_cli(["generate", str(d), "-p", "hi"], capsys)
    assert_one_line_error(code, err, "model.safetensors")


def test_truncated_safetensors(tiny_model_dir, tmp_path, capsys):
    import shutil
    d = tmp_path / "trunc"
    shutil.copytree(tiny_model_dir("gqa-untied"), d)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    code, _, err = run_cli(["generate", str(d), "-p", "hi"], capsys)
    assert_one_line_error(code, err, "model.safetensors")


def test_unknown_architecture(tiny_model_dir, tmp_path, capsys):
    import shutil
    d = tmp_path / "mamba"
    shutil.copytree(tiny_model_dir("gqa-untied"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (d / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(["generate", str(d), "-p", "hi"], capsys)
    assert_one_line_error(code, err, "unknown architecture", "mamba")


def test_prompt_longer_than_ctx(tiny_model_dir, capsys):
    code, _, err = run_cli(["generate", str(tiny_model_dir("gqa-untied")), "-p", "x" * 100, "--ctx", "32"], capsys)
    assert_one_line_error(code, err, "longer than the context of 32")


@pytest.mark.parametrize("kv", ["dense", "hca"])
def test_step_into_a_full_context_is_a_clear_error(tiny_model_dir, kv):
    """Engine.step (the scripting API's teacher forcing) past --ctx: ContextError, the cache intact
    (it was an IndexError deep in the dense cache)."""
    from minirun import Engine
    from minirun.errors import ContextError
    kw = dict(kv="hca", key_store="exact", window=8, sinks=2) if kv == "hca" else {}
    eng = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=40, **kw)
    eng.prefill(list(range(5, 43)))
    eng.step(7)
    eng.step(8)                                     # the 40th token: the context is now full
    with pytest.raises(ContextError, match="context of 40 tokens is full"):
        eng.step(9)
    assert eng.cache.offset == 40
    again = eng.generate(list(range(5, 43)) + [7], max_new_tokens=1, ignore_eos=True)   # the cache still serves
    assert again.reused_tokens == 38 and len(again.tokens) == 1    # (the last prompt token is fed again for its logits)


def test_ctx_too_large_for_memory(tiny_model_dir, capsys):
    code, _, err = run_cli(["generate", str(tiny_model_dir("gqa-untied")), "-p", "hi", "--ctx", "64G"], capsys)
    assert_one_line_error(code, err, "the largest context that fits is")


def test_bad_ctx_value(tiny_model_dir, capsys):
    code, _, err = run_cli(["generate", str(tiny_model_dir("gqa-untied")), "-p", "hi", "--ctx", "lots"], capsys)
    assert code != 0 and "bad context size" in err and "Traceback" not in err


def test_generate_runs_and_streams(tiny_model_dir, capsys):
    main_args = ["generate", str(tiny_model_dir("gqa-untied")), "-p", "hello", "-n", "5"]
    try:
        main(main_args)
    except SystemExit as e:
        assert e.code in (0, None)
    out = capsys.readouterr()
    assert "tok/s" in out.err


def test_chat_repl_multiturn_reset_and_exit(tiny_model_dir):
    """Drive the real console script: two turns, /reset, /exit; the stats line follows each answer."""
    script = "hello\nand again\n/reset\nhi\n/exit\n"
    p = subprocess.run([sys.executable, "-m", "minirun", "chat", str(tiny_model_dir("gqa-untied")),
                        "-n", "4", "--ctx", "512"], input=script, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("[prompt ") == 3   # one stats line per answer
    assert "[conversation reset]" in p.stdout


def test_chat_ctrl_c_returns_to_prompt(tiny_model_dir):
    """SIGINT during an answer stops it and the chat goes on to the next prompt."""
    import os
    import signal
    import time
    p = subprocess.Popen([sys.executable, "-m", "minirun", "chat", str(tiny_model_dir("gqa-untied")),
                          "-n", "100000", "--ctx", "100000", "--ignore-eos"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdin.write("tell me a long story\n")
    p.stdin.flush()
    p.stdout.read(10)          # the answer is streaming (the prompt ">>> " plus its first bytes)
    time.sleep(1)
    os.kill(p.pid, signal.SIGINT)
    time.sleep(0.5)
    out, err = p.communicate("/exit\n", timeout=60)
    assert p.returncode == 0, err
    assert "[interrupted]" in out
    assert "Traceback" not in err
    stats = [ln for ln in err.splitlines() if ln.startswith("[prompt ")]
    assert len(stats) == 1 and " tok (stopped), " in stats[0] and stats[0].endswith(" tok/s]")   # its speed so far


def test_kv_budget_takes_presets_and_explicit_codebooks(tiny_model_dir, capsys):
    """--kv-budget: a preset or gGcC (g16c16 on the tiny model: nibble-pair codes); anything else
    is a one-line error."""
    d = str(tiny_model_dir("gqa-untied"))
    code, _, err = run_cli(["generate", d, "-p", "hi", "--kv", "hca", "--kv-budget", "g16"], capsys)
    assert_one_line_error(code, err, "bad HCA setting")
    code, _, err = run_cli(["generate", d, "-p", "hi", "--kv", "hca", "--kv-budget", "0.3"], capsys)
    assert_one_line_error(code, err, "kv_budget must be 0.5, 0.25 or 0.125")
    try:
        main(["generate", d, "-p", "hello there", "--kv", "hca", "--kv-budget", "g16c16", "-n", "3", "--ctx", "512"])
    except SystemExit as e:
        assert e.code in (0, None), capsys.readouterr().err
    assert "Traceback" not in capsys.readouterr().err


def test_ctx_past_the_trained_context_is_noted_once(tiny_model_dir, capsys):
    """Not an error (the headline runs SmolLM2, trained to 8K, at --ctx 4M), but said once, on
    stderr, when --ctx exceeds config.json's max_position_embeddings (2048 for the tiny model)."""
    d = str(tiny_model_dir("gqa-untied"))
    main(["generate", d, "-p", "hi", "-n", "2", "--ctx", "4K"])
    err = capsys.readouterr().err
    assert err.count("past the 2048 tokens this model was trained on") == 1 and "--ctx 4096" in err
    assert "(--kv hca attends past it with far positions)" in err
    main(["generate", d, "-p", "hi", "-n", "2", "--ctx", "2K"])
    assert "trained on" not in capsys.readouterr().err
    # HCA: far positions are on by default past the trained context (auto), so no note; off: the note
    hca = ["generate", d, "-p", "hi", "-n", "2", "--ctx", "4K", "--kv", "hca", "--kv-budget", "0.5"]
    main(hca)
    err = capsys.readouterr().err
    assert "minirun: note" not in err and "minirun: far positions: tokens older than the 256-token window" in err
    main(hca + ["--hca-opt", "far_positions=off"])
    err = capsys.readouterr().err
    assert "(--hca-opt far_positions=auto or on may help)" in err and "minirun: far positions" not in err
    main(hca[:-6] + ["--ctx", "2K", "--kv", "hca", "--kv-budget", "0.5"])     # inside the trained context: off
    assert "far positions" not in capsys.readouterr().err
