"""Prompt-cache files never cost a user's file: a path that holds something else than a prompt cache
(a document named by mistake, another safetensors file, a directory) is refused in one line before
the model loads and is left byte-identical; the temporary file is a new one of a unique name, never
opened through a symlink; the file's mode is kept; a cache of another model or prompt is replaced
with a line saying what it held, or kept as it is under --prompt-cache-ro."""
from __future__ import annotations

import io
import os
import stat
import sys

import pytest

from minirun import Engine
from minirun import prompt_cache as pc
from minirun.errors import MiniRunError
import shared

PROMPT = list(range(5, 105))
NOTES = "My notes, which took a week.\n" * 40
TINY = ["--ctx", "1024", "--kv", "hca", "--window", "32", "--sinks", "4"]


def run_cli(args, capsys, monkeypatch, stdin=""):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    return shared.run_cli(args, capsys)


def _listing(d):
    return sorted(p.name for p in d.iterdir())


def _not_caches(tmp_path, tiny):
    """name -> a path that holds something a prompt cache must not replace."""
    notes = tmp_path / "notes.txt"
    notes.write_text(NOTES)
    short = tmp_path / "short.bin"
    short.write_bytes(b"\x01\x02")
    weights = tmp_path / "weights.safetensors"              # (a safetensors file, but not a prompt cache)
    weights.write_bytes((tiny / "model.safetensors").read_bytes())
    folder = tmp_path / "folder.kv"
    folder.mkdir()
    (folder / "inside.txt").write_text("kept")
    return {"text": notes, "short": short, "safetensors": weights, "directory": folder}


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_a_file_that_is_not_a_prompt_cache_is_refused_before_the_model_loads(tiny_model_dir, tmp_path, capsys,
                                                                             monkeypatch, command):
    """generate -f, chat --file, serve: one line, exit 1 (a directory: click's usage error, 2), the file
    byte-identical and nothing new beside it. The model directory does not exist: a check made after
    loading would say that instead."""
    tiny = tiny_model_dir("gqa-untied")
    doc = tmp_path / "doc.txt"
    doc.write_text("tokens of a document. " * 20)
    targets = _not_caches(tmp_path, tiny)
    before = {p: (p.read_bytes() if p.is_file() else _listing(p)) for p in targets.values()}
    listing = _listing(tmp_path)
    model = str(tmp_path / "no-such-model")
    args = {"generate": ["generate", model, "-f", str(doc)], "chat": ["chat", model, "--file", str(doc)],
            "serve": ["serve", model, "--port", "0"]}[command]
    for name, path in targets.items():
        code, out, err = run_cli(args + ["--prompt-cache", str(path)], capsys, monkeypatch, stdin="hello\n")
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert "Traceback" not in err and len(lines) == 1, (name, err)
        if name == "directory":
            assert code == 2 and "is a directory" in lines[0]
        else:
            assert code == 1 and lines[0] == (f"error: {path} is a file but not a minirun prompt cache: left as it is "
                                              f"(name a new file for the cache, or one minirun wrote)"), err
        assert "no such model" not in err and out == ""
    assert {p: (p.read_bytes() if p.is_file() else _listing(p)) for p in targets.values()} == before
    assert _listing(tmp_path) == listing


def test_the_api_refuses_to_write_over_what_is_not_a_prompt_cache(tiny_model_dir, tmp_path):
    """Engine.save_prompt_cache: MiniRunError in one line for a document, another safetensors file, a
    directory and a symlink to a document; each left as it was."""
    tiny = tiny_model_dir("gqa-untied")
    eng = Engine.load(tiny, device="cpu", ctx=512)
    eng.prefill(PROMPT)
    targets = _not_caches(tmp_path, tiny)
    link = tmp_path / "link.kv"
    link.symlink_to(targets["text"])
    before = {p: p.read_bytes() for p in targets.values() if p.is_file()}
    listing = _listing(tmp_path)
    for path in [*targets.values(), link]:
        with pytest.raises(pc.NotAPromptCache) as e:
            eng.save_prompt_cache(path)
        msg = str(e.value)
        assert isinstance(e.value, MiniRunError) and "\n" not in msg and "not a minirun prompt cache" in msg
    assert {p: p.read_bytes() for p in before} == before and _listing(tmp_path) == listing
    assert link.is_symlink() and _listing(targets["directory"]) == ["inside.txt"]
    # an empty file holds nothing to lose: it becomes the cache; a symlink to a cache: its target is rewritten
    empty = tmp_path / "empty.kv"
    empty.touch()
    assert eng.save_prompt_cache(empty) == empty.stat().st_size
    to_cache = tmp_path / "to-cache.kv"
    to_cache.symlink_to(empty)
    eng.prefill(PROMPT + [3])
    eng.save_prompt_cache(to_cache)
    assert to_cache.is_symlink() and pc.inspect_file(empty)["n_tokens"] == len(PROMPT) + 1


def test_the_temporary_file_is_new_and_never_opened_through_a_symlink(tiny_model_dir, tmp_path, monkeypatch):
    """A symlink at the old fixed temporary name (PATH.tmp) and one at the first name the writer draws:
    the victim file stays byte-identical and both links stay; the cache is written under a second name
    and renamed into place, and nothing else is left beside it."""
    eng = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=512)
    eng.prefill(PROMPT)
    victim = tmp_path / "victim.txt"
    victim.write_text(NOTES)
    f = tmp_path / "p.kv"
    (tmp_path / "p.kv.tmp").symlink_to(victim)
    (tmp_path / ".p.kv.aaaaaaaaaaaa.tmp").symlink_to(victim)
    draws = iter(["aaaaaaaaaaaa", "bbbbbbbbbbbb"])
    monkeypatch.setattr(pc.secrets, "token_hex", lambda n: next(draws))
    nbytes = eng.save_prompt_cache(f)
    assert victim.read_text() == NOTES and f.stat().st_size == nbytes
    assert _listing(tmp_path) == [".p.kv.aaaaaaaaaaaa.tmp", "p.kv", "p.kv.tmp", "victim.txt"]
    assert pc.inspect_file(f)["n_tokens"] == len(PROMPT)


def test_a_failed_write_removes_its_temporary_file(tiny_model_dir, tmp_path, monkeypatch):
    """Ctrl-C in the middle of the data: the old file as it was, no temporary left."""
    eng = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=512)
    eng.prefill(PROMPT)
    f = tmp_path / "p.kv"
    eng.save_prompt_cache(f)
    before = f.read_bytes()

    def interrupted(fh, t):
        raise KeyboardInterrupt
    monkeypatch.setattr(pc, "_write_tensor", interrupted)
    with pytest.raises(KeyboardInterrupt):
        eng.save_prompt_cache(f)
    assert f.read_bytes() == before and _listing(tmp_path) == ["p.kv"]


def test_the_file_mode_is_kept(tiny_model_dir, tmp_path):
    """A 0600 cache is rewritten 0600 (and a 0640 one 0640); a new file gets the umask's mode."""
    eng = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=512)
    eng.prefill(PROMPT)
    old = os.umask(0o022)
    try:
        eng.save_prompt_cache(tmp_path / "new.kv")
        os.umask(0o077)
        eng.save_prompt_cache(tmp_path / "private-new.kv")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.kv").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "private-new.kv").stat().st_mode) == 0o600
    f = tmp_path / "p.kv"
    for mode in (0o600, 0o640):
        eng.save_prompt_cache(f)
        f.chmod(mode)
        eng.prefill(PROMPT + [len(PROMPT)])
        eng.save_prompt_cache(f)
        assert stat.S_IMODE(f.stat().st_mode) == mode


def _held(path) -> str:
    return pc.summary(pc.inspect_file(path))


def test_generate_replaces_another_models_cache_with_a_notice(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """A cache of another model and of another prompt: replaced, with the line saying what the file
    held; under --prompt-cache-ro not loaded and left byte-identical (the answer still comes)."""
    a, b = tiny_model_dir("gqa-untied"), tiny_model_dir("tied-mha")
    f = tmp_path / "p.kv"
    gen = ["-n", "4", "--ignore-eos", *TINY, "--prompt-cache", str(f)]
    code, _, err = run_cli(["generate", str(a), "-p", "a document about cats. " * 10, *gen], capsys, monkeypatch)
    assert code == 0 and "written to" in err
    held_a = _held(f)
    assert held_a.startswith(f"{pc.inspect_file(f)['n_tokens']} tokens of {a.name} (ctx 1024, kv hca")
    before = f.read_bytes()
    code, _, err = run_cli(["generate", str(b), "-p", "a document about cats. " * 10, *gen, "--prompt-cache-ro"],
                           capsys, monkeypatch)
    assert code == 0 and "generated 4 tok" in err and f.read_bytes() == before, err
    assert "was made for another setup (model config" in err
    assert "(--prompt-cache-ro: the file is kept as it is)]" in err
    code, _, err = run_cli(["generate", str(b), "-p", "a document about cats. " * 10, *gen], capsys, monkeypatch)
    assert code == 0 and f", replacing {held_a}]" in err and f.read_bytes() != before, err
    held_b = _held(f)
    assert f"tokens of {b.name}" in held_b
    before = f.read_bytes()
    code, _, err = run_cli(["generate", str(b), "-p", "something else entirely. " * 3, *gen, "--prompt-cache-ro"],
                           capsys, monkeypatch)
    assert code == 0 and f.read_bytes() == before and "kept as it is" in err and "written to" not in err, err
    code, _, err = run_cli(["generate", str(b), "-p", "something else entirely. " * 3, *gen], capsys, monkeypatch)
    assert code == 0 and f", replacing {held_b}]" in err and f.read_bytes() != before, err


def test_chat_replaces_another_documents_cache_with_a_notice(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """chat --file: a cache of another document is replaced with the line saying what it held; under
    --prompt-cache-ro it is left byte-identical, and a cache that fits is loaded and not written."""
    d = tiny_model_dir("gqa-untied")
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    one.write_text("tokens of a document. " * 20)
    two.write_text("another document entirely. " * 12)
    f = tmp_path / "doc.kv"

    def chat(doc, *extra):
        code, _, err = run_cli(["chat", str(d), "--file", str(doc), "-n", "4", *TINY, "--prompt-cache", str(f), *extra],
                               capsys, monkeypatch, stdin="hello\n")
        assert code == 0 and "Traceback" not in err, err
        return err
    assert "written to" in chat(one)
    held_one, before = _held(f), f.read_bytes()
    err = chat(two, "--prompt-cache-ro")
    assert "holds another prompt" in err and "kept as it is" in err and "written to" not in err
    assert f.read_bytes() == before
    err = chat(one, "--prompt-cache-ro")
    assert "loaded from" in err and f.read_bytes() == before
    err = chat(two)
    assert f", replacing {held_one}]" in err and f.read_bytes() != before
    assert [ln for ln in err.splitlines() if "replacing" in ln] == [ln for ln in err.splitlines() if "written to" in ln]


def test_a_document_saved_at_the_path_while_the_cache_is_written_is_kept(tiny_model_dir, tmp_path, monkeypatch):
    """The path is checked again just before the rename: a file put there while the data was being
    written (minutes for a large cache) is left byte-identical, and no temporary file stays."""
    eng = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=512)
    eng.prefill(PROMPT)
    f = tmp_path / "p.kv"
    write = pc._write_tensor

    def meanwhile(fh, t):
        if not f.exists():
            f.write_text(NOTES)
        write(fh, t)
    monkeypatch.setattr(pc, "_write_tensor", meanwhile)
    with pytest.raises(pc.NotAPromptCache):
        eng.save_prompt_cache(f)
    assert f.read_text() == NOTES and _listing(tmp_path) == ["p.kv"]


def test_a_document_put_at_the_path_during_the_prefill_is_kept_and_the_chat_goes_on(tiny_model_dir, tmp_path,
                                                                                     capsys, monkeypatch):
    """chat --file: the path was free when checked, a document is there when the prefill ends: one
    line saying the cache was not written, the document byte-identical, and the question answered."""
    d = tiny_model_dir("gqa-untied")
    doc, f = tmp_path / "doc.txt", tmp_path / "doc.kv"
    doc.write_text("tokens of a document. " * 20)
    prefill = Engine.prefill

    def then_a_document(self, *a, **kw):
        out = prefill(self, *a, **kw)
        if not f.exists():
            f.write_text(NOTES)
        return out
    monkeypatch.setattr(Engine, "prefill", then_a_document)
    code, _, err = run_cli(["chat", str(d), "--file", str(doc), "-n", "4", *TINY, "--prompt-cache", str(f)],
                           capsys, monkeypatch, stdin="hello\n")
    assert code == 0 and "Traceback" not in err, err
    assert f"[prompt cache not written: {f} is a file but not a minirun prompt cache" in err
    assert "answer 4 tok" in err and f.read_text() == NOTES
