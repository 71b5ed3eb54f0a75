"""Prompt-cache files (minirun/prompt_cache.py, the caches' state_dict): a cache saved after a prefill and
loaded into another engine decodes exactly as the first one goes on decoding; files of another
model, setting or prompt are refused with the reason; unreadable ones are one-line errors; a
failed write leaves no file; `minirun chat --prompt-cache` prefills once and loads afterwards."""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys

import pytest
import torch

from minirun import Engine
from minirun import prompt_cache as pc
from minirun.errors import MiniRunError
from minirun.prompt_cache import PromptCacheMismatch

PROMPT = list(range(5, 205))          # 200 tokens: past sinks + window below, so the store holds 150
NEXT = (3, 77, 150, 9)
HCA = dict(kv="hca", sinks=4, window=46, fit_min_tokens=64)
CASES = {
    "dense": dict(kv="dense"),
    "hca-0.25": dict(HCA, kv_budget=0.25, centroids=32),                 # codebooks fitted from the prompt
    "hca-g4c16-pairs": dict(HCA, groups=4, centroids=16),                # nibble pairs (fast scan)
    "hca-exact-keys": dict(HCA, kv_budget=0.5),
    "hca-rescore": dict(HCA, kv_budget=0.25, centroids=32, rescore=True),   # host keys beside the values
    "hca-far": dict(HCA, groups=4, centroids=16, far_positions="on"),
    "hca-far-grouped": dict(HCA, groups=4, centroids=16, far_positions="grouped"),
    "hca-short": dict(kv="hca", sinks=4, window=400),                   # the ring not yet full: no store
}


def _continue(eng, tokens=NEXT):
    return torch.stack([eng.step(t).reshape(-1) for t in tokens])


@pytest.mark.parametrize("case", list(CASES))
def test_saved_then_loaded_cache_decodes_as_the_original(tiny_model_dir, tmp_path, monkeypatch, case):
    """Bit-equal logits after the load (the same buffers' values: nothing recomputed differently),
    the same tokens and bytes per tier; the loaded engine's next prompt reuses the loaded tokens.
    The writer's pieces made tiny, so every strided and transposed view is written in pieces."""
    monkeypatch.setattr(pc, "_CHUNK", 100)
    d = tiny_model_dir("gqa-untied", max_position_embeddings=64)   # (grouped: G > 1 at ctx 512)
    kw = dict(ctx=512, **CASES[case])
    a, b = (Engine.load(d, device="cpu", **kw) for _ in range(2))
    a.prefill(PROMPT)
    f = tmp_path / "p.kv"
    nbytes = a.save_prompt_cache(f)
    assert f.stat().st_size == nbytes
    b.prefill([7] * 30)                                   # (something else in b's cache first)
    assert b.load_prompt_cache(f, PROMPT) == len(PROMPT)
    tiers = ("tokens", "tokens_exact", "tokens_store", "device_keys_bytes", "device_kv_bytes", "host_values_bytes",
             "host_keys_bytes")
    assert [b.kv_stats().get(k) for k in tiers] == [a.kv_stats().get(k) for k in tiers]
    assert torch.equal(_continue(b), _continue(a))
    _, reused = b.prefill(PROMPT + list(NEXT) + [11, 12])
    assert reused == len(PROMPT) + len(NEXT)


@pytest.mark.parametrize("case", ["hca-0.25", "hca-rescore"])
def test_gpu_cache_class_round_trip_on_the_emulator(tiny_model_dir, tmp_path, case):
    """HCACacheCUDA (kernels on the CPU emulator): its device key store and pinned value pool (and
    host keys) saved and loaded, the same logits as the engine that prefilled."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found (CPU kernel emulator)")
    import cuda_emu
    from minirun.kv.hca_cuda import HCACacheCUDA
    d = tiny_model_dir("gqa-untied")
    kw = dict(ctx=512, **CASES[case])
    with cuda_emu.emulated_hca_cuda():
        a, b = (Engine.load(d, device="cpu", **kw) for _ in range(2))
        assert isinstance(a.cache, HCACacheCUDA)
        a.prefill(PROMPT)
        a.save_prompt_cache(tmp_path / "p.kv")
        b.load_prompt_cache(tmp_path / "p.kv", PROMPT)
        assert torch.equal(_continue(b), _continue(a))


def test_a_file_of_another_setting_or_prompt_is_refused_and_the_cache_kept(tiny_model_dir, tmp_path):
    d = tiny_model_dir("gqa-untied")
    a = Engine.load(d, device="cpu", ctx=512, **CASES["hca-0.25"])
    a.prefill(PROMPT)
    f = tmp_path / "p.kv"
    a.save_prompt_cache(f)
    other = Engine.load(d, device="cpu", ctx=1024, **CASES["hca-0.25"])
    other.prefill([9] * 20)
    with pytest.raises(PromptCacheMismatch, match=r"setting ctx: 512 in the file, 1024 here"):
        other.load_prompt_cache(f, PROMPT)
    assert other.cache.offset == 20
    with pytest.raises(PromptCacheMismatch, match="setting kv"):
        Engine.load(d, device="cpu", ctx=512).load_prompt_cache(f)
    # a cache without host keys writes what files did before --rescore existed: those still load
    assert "host_keys" not in a.cache.state_signature() and "rescore" not in pc.STATE_SETTINGS
    with pytest.raises(PromptCacheMismatch, match="cache host_keys: None in the file, True here"):   # (--rescore)
        Engine.load(d, device="cpu", ctx=512, **CASES["hca-0.25"], rescore=True).load_prompt_cache(f)
    # --rescore with an exact-key store keeps no host keys: the same state, the same file
    exact = dict(CASES["hca-exact-keys"], ctx=512)
    e = Engine.load(d, device="cpu", **exact)
    e.prefill(PROMPT)
    e.save_prompt_cache(tmp_path / "e.kv")
    assert Engine.load(d, device="cpu", **exact, rescore=True).load_prompt_cache(tmp_path / "e.kv") == len(PROMPT)
    with pytest.raises(PromptCacheMismatch, match="another prompt"):
        a.load_prompt_cache(f, PROMPT[:-1] + [4])
    with pytest.raises(PromptCacheMismatch, match="model config"):
        Engine.load(tiny_model_dir("tied-mha"), device="cpu", ctx=512, **CASES["hca-0.25"]).load_prompt_cache(f)
    # decode-time knobs do not shape the state: a file made with tau 0.9 loads with tau 0.5
    c = Engine.load(d, device="cpu", ctx=512, **{**CASES["hca-0.25"], "tau": 0.5, "max_select": 8})
    assert c.load_prompt_cache(f, PROMPT) == len(PROMPT)


def test_unreadable_files_are_one_line_errors(tiny_model_dir, tmp_path):
    d = tiny_model_dir("gqa-untied")
    eng = Engine.load(d, device="cpu", ctx=512)
    eng.prefill(PROMPT)
    good = tmp_path / "p.kv"
    eng.save_prompt_cache(good)
    cut = tmp_path / "cut.kv"
    cut.write_bytes(good.read_bytes()[:good.stat().st_size // 2])
    junk = tmp_path / "junk.kv"
    junk.write_bytes(b"\x00" * 100)
    for f, msg in ((cut, "unreadable"), (junk, "unreadable"), (tmp_path / "none.kv", "unreadable"),
                   (d / "model.safetensors", "not a minirun prompt cache")):
        with pytest.raises(MiniRunError, match=msg) as e:
            eng.load_prompt_cache(f)
        assert "\n" not in str(e.value)


def _with_meta(data: bytes, edit) -> bytes:
    """A prompt-cache file's bytes with its minirun metadata changed by edit(meta) (the data kept)."""
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    meta = json.loads(header["__metadata__"]["minirun"])
    edit(meta)
    header["__metadata__"]["minirun"] = json.dumps(meta)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[8 + n:]


def test_a_file_with_flipped_bytes_is_refused(tiny_model_dir, tmp_path):
    """The data's CRC-32 is in the header: bytes changed on disk are refused in one line and the cache
    is left as it was (they loaded before, and decoded garbage); a file without a checksum (written
    before there was one) still loads."""
    d = tiny_model_dir("gqa-untied")
    eng = Engine.load(d, device="cpu", ctx=512, **CASES["hca-0.25"])
    eng.prefill(PROMPT)
    good = tmp_path / "p.kv"
    eng.save_prompt_cache(good)
    data = good.read_bytes()
    meta = json.loads(json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])["__metadata__"]["minirun"])
    assert meta["checksum"] == pc.data_checksum(good) and meta["checksum"].startswith("crc32:")
    other = Engine.load(d, device="cpu", ctx=512, **CASES["hca-0.25"])
    for at in (len(data) // 2, len(data) - 9):               # a value row; the last bytes written
        bad = bytearray(data)
        bad[at:at + 4] = bytes(b ^ 0x5A for b in bad[at:at + 4])
        (tmp_path / "bad.kv").write_bytes(bad)
        other.prefill([9] * 20)
        with pytest.raises(MiniRunError, match="is damaged: its data does not match its checksum") as e:
            other.load_prompt_cache(tmp_path / "bad.kv", PROMPT)
        assert "\n" not in str(e.value) and other.cache.offset == 20 and other._cached_ids == [9] * 20
    (tmp_path / "old.kv").write_bytes(_with_meta(data, lambda m: m.pop("checksum")))
    assert other.load_prompt_cache(tmp_path / "old.kv", PROMPT) == len(PROMPT)
    assert torch.equal(_continue(other), _continue(eng))


def test_a_damaged_file_is_prefilled_again_and_rewritten(tiny_model_dir, tmp_path):
    d = tiny_model_dir("gqa-untied")
    doc = tmp_path / "doc.txt"
    doc.write_text("tokens of a document. " * 20)
    f = tmp_path / "doc.kv"
    first = _generate(d, f, "-f", str(doc), "--kv", "dense")
    bad = bytearray(f.read_bytes())
    bad[-20:-10] = bytes(10)
    f.write_bytes(bad)
    again = _generate(d, f, "-f", str(doc), "--kv", "dense")
    assert again.returncode == 0 and again.stdout == first.stdout
    assert "is damaged: its data does not match its checksum: prefilling the prompt]" in again.stderr
    assert "written to" in again.stderr                     # rewritten: the next run loads it
    assert pc.data_checksum(f) == json.loads(json.loads(f.read_bytes()[8:8 + struct.unpack("<Q", f.read_bytes()[:8])[0]])
                                             ["__metadata__"]["minirun"])["checksum"]


def test_a_failed_write_leaves_no_file_and_an_old_one_intact(tiny_model_dir, tmp_path, monkeypatch):
    eng = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=512, **CASES["hca-0.25"])
    eng.prefill(PROMPT[:100])
    f = tmp_path / "p.kv"
    eng.save_prompt_cache(f)
    before = f.read_bytes()
    eng.prefill(PROMPT)
    calls = []

    def failing(fh, t):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(fh, t)
    real = pc._write_tensor
    monkeypatch.setattr(pc, "_write_tensor", failing)
    with pytest.raises(OSError):
        eng.save_prompt_cache(f)
    assert f.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.kv"]
    monkeypatch.setattr(pc, "_write_tensor", real)
    eng.save_prompt_cache(tmp_path / "q.kv")
    monkeypatch.setattr(pc.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(100, 100, 1000))
    with pytest.raises(OSError, match="needed, 1000 B free"):   # (checked before writing)
        eng.save_prompt_cache(tmp_path / "big.kv")
    assert not (tmp_path / "big.kv.tmp").exists()
    monkeypatch.undo()
    eng.reset()
    with pytest.raises(ValueError, match="middle of a prefill"):   # (an anchor prefill's chunks in flight)
        eng.cache.begin_prefill("anchor")
        eng.save_prompt_cache(tmp_path / "r.kv")


def _chat(d, doc, cache_file, script, *extra):
    p = subprocess.run([sys.executable, "-m", "minirun", "chat", str(d), "--file", str(doc), "--ctx", "1024",
                        "-n", "6", "--kv", "hca", "--window", "32", "--sinks", "4", "--prompt-cache", str(cache_file),
                        *extra], input=script, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    return p


def test_chat_prefills_once_then_loads(tiny_model_dir, tmp_path):
    """The first chat prefills the document and writes the file; the second loads it and answers
    the same; /reset after a conversation longer than the ring goes back to the document through the
    cache's copy of the ring, or reloads the file where no copy reaches it; a damaged file is said
    so in one line, prefilled again and rewritten; --prompt-cache without a document is an error."""
    d = tiny_model_dir("gqa-untied")
    doc = tmp_path / "doc.txt"
    doc.write_text("tokens of a document. " * 20)
    f = tmp_path / "doc.kv"
    first = _chat(d, doc, f, "hello\n")
    assert "prefilled in" in first.stderr and "written to" in first.stderr and f.is_file()
    second = _chat(d, doc, f, "hello\n" + "more words " * 5 + "\n/reset\nhello\n")
    assert "loaded from" in second.stderr and "prefilled in" not in second.stderr
    answers = [ln for ln in second.stdout.split(">>> ") if ln.strip() and not ln.startswith("[")]
    assert first.stdout.split(">>> ")[1] == answers[0] == answers[2]
    # the ring overflowed, but the cache went back to the document through its copy of the ring
    # where the second prompt left the first answer (kv/ring_checkpoint.py): no reload
    assert second.stderr.count("loaded from") == 1
    assert "[conversation reset (the document kept)]" in second.stdout
    # a first message longer than the ring leaves no copy that reaches the document: /reset reloads the file
    longer = _chat(d, doc, f, "more words " * 8 + "\n/reset\nhello\n")
    assert longer.stderr.count("loaded from") == 2 and "[conversation reset (the document kept)]" in longer.stdout
    assert [ln for ln in longer.stdout.split(">>> ") if ln.strip() and not ln.startswith("[")][1] == answers[0]
    f.write_bytes(f.read_bytes()[:1000])
    third = _chat(d, doc, f, "hello\n")
    assert "unreadable" in third.stderr and "prefilling again" in third.stderr and "written to" in third.stderr
    other = _chat(d, doc, f, "hello\n", "--window", "64")
    assert "setting window: 32 in the file, 64 here" in other.stderr
    p = subprocess.run([sys.executable, "-m", "minirun", "chat", str(d), "--prompt-cache", str(f)],
                       input="", capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].endswith("give one of them")


def test_load_prefix_loads_only_a_file_that_starts_like_the_prompt(tiny_model_dir, tmp_path):
    """The file holds PROMPT: a prompt that goes on from it loads it (and then prefills only the
    rest); one that starts otherwise leaves the cache as it was."""
    d = tiny_model_dir("gqa-untied")
    kw = dict(ctx=512, **CASES["hca-g4c16-pairs"])
    a, b = (Engine.load(d, device="cpu", **kw) for _ in range(2))
    a.prefill(PROMPT)
    f = tmp_path / "p.kv"
    a.save_prompt_cache(f)
    b.prefill([7] * 30)
    assert pc.load_prefix(b, f, [1] + PROMPT) == (len(PROMPT), 0)
    assert b._cached_ids == [7] * 30                              # not loaded
    assert pc.load_prefix(b, f, PROMPT + [9, 10]) == (len(PROMPT), len(PROMPT))
    assert b._cached_ids == PROMPT
    _, reused = b.prefill(PROMPT + [9, 10])
    assert reused == len(PROMPT)


def _generate(d, cache_file, *args):
    p = subprocess.run([sys.executable, "-m", "minirun", "generate", str(d), "--ctx", "1024", "-n", "8",
                        "--ignore-eos", "--kv", "hca", "--window", "32", "--sinks", "4",
                        "--prompt-cache", str(cache_file), *args], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in p.stderr
    return p


def test_generate_with_a_prompt_cache(tiny_model_dir, tmp_path):
    """generate --prompt-cache: the first run prefills and writes all of the prompt but its last
    token; the second loads them and generates the same text; a longer prompt that starts alike
    loads the file, prefills the rest and rewrites it; --prompt-cache-ro never writes; a file of
    another prompt is not loaded; wrong option combinations are one-line errors."""
    d = tiny_model_dir("gqa-untied")
    doc = tmp_path / "doc.txt"
    doc.write_text("tokens of a document. " * 20)
    f = tmp_path / "doc.kv"
    first = _generate(d, f, "-f", str(doc))
    assert first.returncode == 0, first.stderr
    assert "written to" in first.stderr and f.is_file()
    second = _generate(d, f, "-f", str(doc))
    n = int(second.stderr.split("prompt cache: ")[1].split(" of ")[0])
    assert second.returncode == 0 and f"{n} of {n + 1} prompt tokens from" in second.stderr
    assert "written to" not in second.stderr and second.stdout == first.stdout
    before = f.read_bytes()
    longer = _generate(d, f, "-p", doc.read_text() + " and then some more words", "--prompt-cache-ro")
    loaded = int(longer.stderr.split("prompt cache: ")[1].split(" of ")[0])
    assert n - 2 <= loaded <= n + 1     # (the text's last tokens may merge with what follows them)
    assert "written to" not in longer.stderr and f.read_bytes() == before
    longer = _generate(d, f, "-p", doc.read_text() + " and then some more words")
    assert "written to" in longer.stderr and f.read_bytes() != before
    other = _generate(d, f, "-p", "Something else entirely. " * 4)
    assert "prompt cache: 0 of" in other.stderr and other.returncode == 0
    for bad in (["-p", "x", "-f", str(doc)], []):
        p = _generate(d, f, *bad)
        assert p.returncode != 0 and p.stderr.strip().splitlines()[-1].endswith("(one of them)")
    p = subprocess.run([sys.executable, "-m", "minirun", "generate", str(d), "-p", "x", "--prompt-cache-ro"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr and "give it" in p.stderr
