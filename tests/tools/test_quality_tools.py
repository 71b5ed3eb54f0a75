"""calibrate writes codebooks the cache then loads; the evaluation functions give sane numbers."""
import json
import shutil

import pytest
import torch

from minirun import Engine
from minirun.tools.calibrate import builtin_text, calibrate, collect_keys, read_text
from minirun.cli.main import main
from minirun.errors import CheckpointError
from minirun.tools.evaluate import (agreement, check_targets, continuation_ppl, format_markdown, passkey, passkey_prompt,
                              perplexity, prose_haystack, teacher_forced_logits)

QUIET = dict(progress=False, log=lambda s: None)


def ids_of(n, seed=0):
    return torch.randint(4, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def calibrated(tiny_model_dir, tmp_path_factory):
    """A copy of the tiny GQA model with a calibrated g=8, c=16 codebook file."""
    d = tmp_path_factory.mktemp("calibrated") / "m"
    shutil.copytree(tiny_model_dir("gqa-untied"), d)
    path = calibrate(d, groups=8, centroids=16, tokens=600, iters=5, window=256, windows=4, **QUIET)
    return d, path


def test_calibrate_writes_codebooks_the_cache_loads(calibrated):
    d, path = calibrated
    assert path.name == "codebooks-g8-c16.safetensors" and path.is_file()
    assert not list(d.glob("*.tmp"))                                       # written via tmp + rename
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        assert f.get_tensor("centroids").shape == (2, 2, 8, 16, 2)     # [L, Hkv, g, c, hd/g]
    assert json.loads(meta["tokens"]) == 600 and "pydoc_data" in json.loads(meta["data"])
    assert {"iters", "date", "windows"} <= set(meta)
    eng = Engine.load(d, device="cpu", ctx=512, kv="hca", groups=8, centroids=16, window=16, sinks=2)
    assert eng.cache.codebooks.source.startswith("calibrated")
    # 16 centroids: held as the product codebooks of group pairs (nibble-pair codes), the file's as factors
    assert eng.cache.codebooks.factors.shape == (2, 2, 8, 16, 2)
    assert eng.cache.codebooks.shape == (2, 2, 4, 256, 4)
    eng.generate(ids_of(200), max_new_tokens=2)
    assert eng.cache.n_encoded == eng.cache.n_store > 0                  # encoded with the file's codebooks


def test_collect_keys_spreads_over_windows_and_positions(tiny_model_dir):
    eng = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=128, kv="dense")
    ids = ids_of(1000)
    keys = collect_keys(eng, ids, window=128, max_tokens=64, windows=4, skip=4)
    assert keys.shape == (2, 2, 64, 16) and torch.isfinite(keys).all()
    # the keys of window 0 at the chosen positions are those of a dense prefill of that window
    eng.prefill(ids[:128])
    pos = torch.tensor([int(i * 124 / 16) for i in range(16)]) + 4
    torch.testing.assert_close(keys[:, :, :16], eng.cache.k[:, :, pos].float())


def test_mismatched_codebook_file_is_one_line_error(calibrated, tiny_model_dir, tmp_path):
    _, path = calibrated
    b = tmp_path / "b"
    shutil.copytree(tiny_model_dir("tied-mha"), b)          # another shape: 4 kv-heads instead of 2
    (b / path.name).write_bytes(path.read_bytes())
    with pytest.raises(CheckpointError) as e:
        Engine.load(b, device="cpu", ctx=256, kv="hca", groups=8, centroids=16)
    assert "\n" not in str(e.value) and "codebook file" in str(e.value)
    (b / path.name).write_bytes(b"\x00" * 40)               # corrupt
    with pytest.raises(CheckpointError) as e:
        Engine.load(b, device="cpu", ctx=256, kv="hca", groups=8, centroids=16)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("args, message", [
    (["--data", "{tmp}/none.txt"], "cannot read --data"),
    (["--data", "{tmp}"], "cannot read --data"),                # a directory
    (["--data", "{tmp}/empty.txt"], "is empty"),
    (["--groups", "5"], "does not divide head_dim"),
])
def test_calibrate_bad_input_is_one_line_error(tiny_model_dir, tmp_path, capsys, args, message):
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(SystemExit) as e:
        main(["calibrate", str(tiny_model_dir("gqa-untied"))] + [a.format(tmp=tmp_path) for a in args])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and len(err.splitlines()) == 1 and message in err


def test_texts_are_disjoint_and_gutenberg_boilerplate_is_dropped(tmp_path):
    cal, src = builtin_text("calibration")
    ev, _ = builtin_text("evaluation")
    assert len(cal) > 100_000 and len(ev) > 100_000 and cal[:2000] not in ev and "calibration half" in src
    p = tmp_path / "book.txt"
    p.write_text("\ufeffProject Gutenberg's X\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\nOnce upon a time."
                 "\n*** END OF THIS PROJECT GUTENBERG EBOOK X ***\nlicense", encoding="utf-8")
    assert read_text(p)[0] == "Once upon a time."


def test_evaluation_functions_are_sane(tiny_model_dir):
    d = tiny_model_dir("gqa-untied")
    dense = Engine.load(d, device="cpu", ctx=512)
    ppl = perplexity(dense, ids_of(300))
    assert 1.0 < ppl < 1e6 and ppl == ppl
    exact = Engine.load(d, device="cpu", ctx=512, kv="hca", key_store="exact", tau=1.0, window=16, sinks=2)
    assert abs(perplexity(exact, ids_of(300)) - ppl) / ppl < 1e-4
    a = agreement(dense, exact, ids_of(200), ids_of(30, seed=1))
    assert a["positions"] == 30 and a["top1_agreement"] == 1.0 and a["mean_kl"] < 1e-6
    ref = teacher_forced_logits(dense, ids_of(200), ids_of(30, seed=1))   # precomputed reference, same result
    assert agreement(ref, exact, ids_of(200), ids_of(30, seed=1)) == a
    approx = Engine.load(d, device="cpu", ctx=512, kv="hca", kv_budget=0.125, centroids=8, tau=0.5, window=16,
                         sinks=2, fit_min_tokens=32)
    sel: dict = {}
    logits = teacher_forced_logits(approx, ids_of(200), ids_of(30, seed=1), selection=sel)
    assert approx.cache.n_encoded == 0                                       # reset after the run
    b = agreement(ref, approx, ids_of(200), ids_of(30, seed=1))
    assert 0.0 <= b["top1_agreement"] <= 1.0 and b["mean_kl"] >= 0.0 and logits.shape == (30, 300)
    assert sel["steps"] == 29 and sel["fraction"].shape == (2, 4)            # one selection per layer per step
    assert ((sel["fraction"] > 0) & (sel["fraction"] <= 1)).all()
    rows = passkey(dense, [80, 120], [0.0, 1.0], trials=2)
    assert [(r["length"], r["depth"]) for r in rows] == [(80, 0.0), (80, 1.0), (120, 0.0), (120, 1.0)]
    assert all(0.0 <= r["accuracy"] <= 1.0 and len(r["answers"]) == 2 for r in rows)
    assert [r["answers"] for r in passkey(exact, [80, 120], [0.0, 1.0], trials=2)] == [r["answers"] for r in rows]


def test_continuation_ppl_is_the_true_tokens_perplexity(tiny_model_dir):
    """continuation_ppl: exp(mean NLL) of the tokens the rows predict (row i -> continuation[i]);
    an exact-key HCA cache at tau 1 gives dense's figure, a uniform row gives the vocabulary size."""
    d = tiny_model_dir("gqa-untied")
    prompt, cont = ids_of(200), ids_of(30, seed=1)
    dense = teacher_forced_logits(Engine.load(d, device="cpu", ctx=512), prompt, cont)
    lp = torch.log_softmax(dense.double(), -1)
    want = float(torch.exp(-lp[torch.arange(30), torch.tensor(cont)].mean()))
    assert continuation_ppl(dense, cont) == pytest.approx(want, rel=1e-5)
    exact = Engine.load(d, device="cpu", ctx=512, kv="hca", key_store="exact", tau=1.0, window=16, sinks=2)
    assert continuation_ppl(teacher_forced_logits(exact, prompt, cont), cont) == pytest.approx(want, rel=1e-4)
    assert continuation_ppl(torch.zeros(30, 300), cont) == pytest.approx(300, rel=1e-5)
    shifted = continuation_ppl(dense[1:], cont[1:])                 # rows paired with other tokens differ
    assert shifted != pytest.approx(continuation_ppl(dense[:-1], cont[1:]), rel=1e-3)


def test_passkey_prompt_places_the_key_and_splits_at_the_question(tiny_model_dir):
    eng = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=512)
    for depth in (0.0, 0.5, 1.0):
        ids, q = passkey_prompt(eng, 1000, depth, 48213)      # one filler sentence is ~90 tiny tokens
        assert 900 <= len(ids) <= 1000 and 0 < q < len(ids)
        head, tail = eng.detokenize(ids[:q]), eng.detokenize(ids[q:])
        assert "48213" in head and tail.startswith("What is the pass key?")
        where = head.find("48213") / len(head)
        assert abs(where - depth) < 0.15


def test_passkey_in_repeated_prose(tiny_model_dir):
    """--passkey-haystack text: the key sits in the text (at a line or sentence end near the depth),
    the text's start `copies` times, the prompt about the asked length, the question split off."""
    eng = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=2048)
    text = " ".join(f"Sentence number {i} is here." + ("\n" if i % 5 == 4 else "") for i in range(400))
    text_ids = eng.tokenize(text, add_bos=False)
    hay = prose_haystack(eng, text_ids, 600, copies=3)
    parts = hay.split("\n\n")
    assert len(parts) == 3 and parts[0] == parts[1] == parts[2] and parts[0].startswith("Sentence number 0 is")
    assert parts[0].endswith("here.")                                        # whole sentences
    assert abs(len(eng.tokenize(hay, add_bos=False)) - 600) < 60
    for depth in (0.0, 0.5, 1.0):
        ids, q = passkey_prompt(eng, 700, depth, 48213, haystack=hay)
        head, tail = eng.detokenize(ids[:q]), eng.detokenize(ids[q:])
        assert "48213" in head and tail.startswith("What is the pass key?")
        body = head[head.find("Sentence number 0"):] if depth > 0 else head
        before = body[:body.find(" The pass key is 48213.")]
        assert before == "" or before.endswith((".", "\n")), before[-20:]      # not inside a sentence
        assert abs(len(before) - depth * len(hay)) < 80
    rows = passkey(eng, [700], [0.5], trials=1, text_ids=text_ids, copies=2)
    assert 600 <= rows[0]["answers"][0]["tokens"] <= 760


def test_eval_command_runs_small_grid(tiny_model_dir, capsys):
    main(["eval", str(tiny_model_dir("gqa-untied")), "--ppl-tokens", "200", "--prompt-tokens", "150",
          "--positions", "10", "--passkey-lengths", "300", "--passkey-depths", "0.5", "--trials", "1",
          "--window", "16", "--sinks", "2", "--kv-budget", "0.5", "-o", "json"])
    r = json.loads(capsys.readouterr().out)
    assert [row["mode"] for row in r["rows"]] == ["dense", "hca 0.5"]
    assert r["rows"][1]["top1_agreement"] >= 0.9 and r["rows"][0]["ppl"] > 1
    assert all(row["cont_ppl"] > 1 for row in r["rows"])        # the continuation's perplexity, every mode
    assert len(r["rows"][1]["selected_fraction_by_layer"]) == 2
    md = format_markdown(r, data=r["data"])
    assert "| hca 0.5 |" in md and "Passkey accuracy per cell" in md
    assert r["settings"]["passkey_haystack"] == "filler" and "(in the text" not in md
    main(["eval", str(tiny_model_dir("gqa-untied")), "--ppl-tokens", "0", "--positions", "0", "--passkey-lengths",
          "300", "--passkey-depths", "0.5", "--trials", "1", "--window", "16", "--sinks", "2", "--kv-budget", "0.5",
          "--passkey-haystack", "text", "--passkey-copies", "2", "-o", "json"])
    prose = json.loads(capsys.readouterr().out)
    assert prose["settings"]["passkey_copies"] == 2 and prose["rows"][1]["passkey"][0]["trials"] == 1
    assert "x 1 trials (in the text, 2 copies)" in format_markdown(prose)
    r["rows"][1]["mode"] = "hca 0.25"
    assert [c["target"] for c in check_targets(r)][0] == "ppl within 2% of dense"


def test_eval_command_far_positions(tiny_model_dir, capsys):
    """--far-positions reaches the HCA engines: the settings record it, and the HCA row changes (700
    tokens: past the first 512-token chunk, whose tokens all sit in the chunk itself)."""
    d = str(tiny_model_dir("gqa-untied"))
    rows = {}
    for far in ("off", "on"):
        main(["eval", d, "--ppl-tokens", "700", "--positions", "0", "--passkey-lengths", "", "--window", "16",
              "--sinks", "2", "--kv-budget", "0.5", "--hca-opt", f"far_positions={far}", "-o", "json"])
        r = json.loads(capsys.readouterr().out)
        assert r["settings"]["far_positions"] == far
        rows[far] = r["rows"][1]["ppl"]
    assert rows["off"] != rows["on"]


def test_unrotated_calibration_for_far_positions(calibrated, capsys):
    """calibrate --unrotated: keys without their RoPE rotation (collect_keys == the rotated ones
    turned back), a file of its own that only far-position caches load; the rotated one is theirs
    no more (a far cache without the unrotated file fits its own, and says which file to make)."""
    from minirun.kv.far_positions import unrotate_keys
    from minirun.model.ops import rope_inv_freq
    d, rotated = calibrated
    eng = Engine.load(d, device="cpu", ctx=256, kv="dense")
    ids = ids_of(300, seed=3)
    k_rot = collect_keys(eng, ids, window=256, max_tokens=64, windows=1)
    k_pre = collect_keys(eng, ids, window=256, max_tokens=64, windows=1, unrotated=True)
    pos = torch.tensor([int(i * 240 / 64) for i in range(64)]) + 16          # collect_keys' spread past skip
    assert (k_pre - unrotate_keys(k_rot, pos, rope_inv_freq(eng.args))).abs().max() < 1e-5
    assert (k_pre - k_rot).abs().max() > 1e-2
    kw = dict(device="cpu", ctx=512, kv="hca", groups=8, centroids=16, window=16, sinks=2, far_positions="on")
    capsys.readouterr()
    assert Engine.load(d, **kw).cache.codebooks is None
    assert "calibrate --unrotated" in capsys.readouterr().err
    main(["calibrate", str(d), "--groups", "8", "--centroids", "16", "--tokens", "600", "--iters", "5",
          "--windows", "4", "--unrotated"])
    path = capsys.readouterr().out.strip()
    assert path.endswith("codebooks-g8-c16-unrotated.safetensors") and rotated.is_file()
    far = Engine.load(d, **kw).cache
    plain = Engine.load(d, **{**kw, "far_positions": "off"}).cache
    assert far.codebooks.source.startswith("calibrated") and plain.codebooks.source.startswith("calibrated")
    assert not torch.equal(far.codebooks.centroids, plain.codebooks.centroids)


def test_eval_command_max_select(tiny_model_dir, capsys):
    """--max-select reaches the HCA engines: recorded in the settings and their markdown line, and
    a cap of 4 tokens per head changes the HCA row's perplexity (700 tokens: past the first chunk)."""
    d = str(tiny_model_dir("gqa-untied"))
    ppl = {}
    for cap in (None, "4"):
        main(["eval", d, "--ppl-tokens", "700", "--positions", "0", "--passkey-lengths", "", "--window", "16",
              "--sinks", "2", "--kv-budget", "0.5", "--tau", "1.0", *(["--max-select", cap] if cap else []),
              "-o", "json"])
        r = json.loads(capsys.readouterr().out)
        assert r["settings"]["max_select"] == (int(cap) if cap else None)
        ppl[cap] = r["rows"][1]["ppl"]
    assert ppl[None] != ppl["4"]
    assert "at most 4 tokens per head" in format_markdown(r)


def test_eval_command_length_scale(tiny_model_dir, capsys):
    """--length-scale reaches the HCA engines: recorded, named in the markdown, and past the trained
    context (64 here) it changes the HCA row's perplexity."""
    d = str(tiny_model_dir("gqa-untied", max_position_embeddings=64))
    ppl = {}
    for ls in ("off", "on"):
        main(["eval", d, "--ppl-tokens", "300", "--positions", "0", "--passkey-lengths", "", "--window", "16",
              "--sinks", "2", "--kv-budget", "0.5", "--hca-opt", "far_positions=on", "--hca-opt", f"length_scale={ls}", "-o", "json"])
        r = json.loads(capsys.readouterr().out)
        assert r["settings"]["length_scale"] == ls
        ppl[ls] = r["rows"][1]["ppl"]
    assert ppl["off"] != ppl["on"]
    assert "length scaling on" in format_markdown(r)
