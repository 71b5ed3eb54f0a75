"""calibrate writes codebooks the cache then loads; the evaluation functions give sane numbers."""
import json

import pytest
import torch

from minirun import Engine
from minirun.calibrate import calibrate
from minirun.cli import main
from minirun.errors import CheckpointError
from minirun.evaluate import agreement, passkey, perplexity


def ids_of(n, seed=0):
    return torch.randint(4, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_calibrate_writes_codebooks_the_cache_loads(tiny_model_dir, tmp_path):
    import shutil
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir("gqa-untied"), d)
    path = calibrate(d, groups=8, centroids=16, tokens=600, iters=5, window=256, progress=False, log=lambda s: None)
    assert path.name == "codebooks-g8-c16.safetensors" and path.is_file()
    eng = Engine.load(d, device="cpu", ctx=512, kv="hca", groups=8, centroids=16, window=16, sinks=2)
    assert eng.cache.codebooks.source.startswith("calibrated")
    assert eng.cache.codebooks.shape == (2, 2, 8, 16, 2)
    eng.generate(ids_of(200), max_new_tokens=2)
    assert eng.cache.n_encoded == eng.cache.n_store > 0


def test_mismatched_codebook_file_is_one_line_error(tiny_model_dir, tmp_path):
    import shutil
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(tiny_model_dir("gqa-untied"), a)
    shutil.copytree(tiny_model_dir("tied-mha"), b)        # another shape: 4 kv-heads instead of 2
    calibrate(a, groups=8, centroids=16, tokens=300, iters=2, window=256, progress=False, log=lambda s: None)
    cb = (a / "codebooks-g8-c16.safetensors").read_bytes()
    (b / "codebooks-g8-c16.safetensors").write_bytes(cb)
    with pytest.raises(CheckpointError) as e:
        Engine.load(b, device="cpu", ctx=256, kv="hca", groups=8, centroids=16)
    assert "\n" not in str(e.value) and "codebook file" in str(e.value)
    (b / "codebooks-g8-c16.safetensors").write_bytes(b"\x00" * 40)   # corrupt
    with pytest.raises(CheckpointError):
        Engine.load(b, device="cpu", ctx=256, kv="hca", groups=8, centroids=16)


def test_calibrate_missing_data_file_is_one_line_error(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["calibrate", str(tiny_model_dir("gqa-untied")), "--data", str(tmp_path / "none.txt")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and len(err.splitlines()) == 1 and "cannot read --data" in err


def test_evaluation_functions_are_sane(tiny_model_dir):
    d = tiny_model_dir("gqa-untied")
    dense = Engine.load(d, device="cpu", ctx=512)
    ppl = perplexity(dense, ids_of(300))
    assert 1.0 < ppl < 1e6 and ppl == ppl
    exact = Engine.load(d, device="cpu", ctx=512, kv="hca", key_store="exact", tau=1.0, window=16, sinks=2)
    assert abs(perplexity(exact, ids_of(300)) - ppl) / ppl < 1e-4
    a = agreement(dense, exact, ids_of(200), ids_of(30, seed=1))
    assert a["positions"] == 30 and a["top1_agreement"] == 1.0 and abs(a["mean_kl"]) < 1e-6
    approx = Engine.load(d, device="cpu", ctx=512, kv="hca", kv_budget=0.125, centroids=8, tau=0.5, window=16,
                         sinks=2, fit_min_tokens=32)
    b = agreement(dense, approx, ids_of(200), ids_of(30, seed=1))
    assert 0.0 <= b["top1_agreement"] <= 1.0 and b["mean_kl"] >= 0.0
    assert approx.cache.n_encoded == approx.cache.n_store > 150      # the approximate path was taken
    rows = passkey(dense, [80, 120], [0.5], trials=1)
    assert [(r["length"], r["depth"]) for r in rows] == [(80, 0.5), (120, 0.5)]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows)


def test_eval_command_runs_small_grid(tiny_model_dir, capsys):
    try:
        main(["eval", str(tiny_model_dir("gqa-untied")), "--ppl-tokens", "200", "--prompt-tokens", "150",
              "--positions", "10", "--passkey-lengths", "100", "--passkey-depths", "0.5", "--window", "16",
              "--sinks", "2", "--kv-budget", "0.5", "-o", "json"])
    except SystemExit as e:
        assert e.code in (0, None)
    r = json.loads(capsys.readouterr().out)
    assert [row["mode"] for row in r["rows"]] == ["dense", "hca 0.5"]
    assert r["rows"][1]["top1_agreement"] >= 0.9 and r["rows"][0]["ppl"] > 1
