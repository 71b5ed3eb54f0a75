"""`minirun convert` never loses a file: --overwrite replaces only the files a conversion writes, the
source GGUF stays where it is, `.` works, a truncated GGUF is named as such."""
from __future__ import annotations

import json

import pytest
from tokenizers import pre_tokenizers

from minirun.checkpoint.convert import convert_gguf
from minirun.checkpoint.model_files import is_conversion_file
from minirun.errors import CheckpointError
from shared import run_cli
from test_convert import bpe_vocab, tiny_weights, train_bpe, write_gguf

UNRELATED = {"notes.txt": "mine", "chat.kv": "a prompt cache", "sub/keep.txt": "nested"}


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory):
    tok = train_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    path = write_gguf(tmp_path_factory.mktemp("src") / "m.gguf", tiny_weights(tok.get_vocab_size()),
                      bpe_vocab(tok, "gpt2"))
    return path.read_bytes()


def cli(args, capsys):
    code, out, err = run_cli(args, capsys)
    assert "Traceback" not in err
    return code, out, err


def put(d, files):
    for name, text in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)


def assert_files(d, files):
    for name, text in files.items():
        assert (d / name).read_text() == text, name


def test_overwrite_replaces_only_the_conversion_files(tmp_path, gguf_bytes, capsys):
    src = tmp_path / "m.gguf"
    src.write_bytes(gguf_bytes)
    out = tmp_path / "model"
    out.mkdir()
    stale = {"model-00001-of-00002.safetensors": "old shard", "model.safetensors.index.json": "{}",
             "codebooks-g16-c1024.safetensors": "fitted to the old weights", "config.json": "{}"}
    put(out, {**UNRELATED, **stale})
    code, _, err = cli(["convert", str(src), str(out)], capsys)
    assert code == 1 and "not empty: --overwrite replaces" in err and "overwrite=True" not in err
    assert_files(out, {**UNRELATED, **stale})                       # refused: nothing touched
    code, printed, err = cli(["convert", str(src), str(out), "--overwrite"], capsys)
    assert code == 0, err
    assert_files(out, UNRELATED)
    assert src.read_bytes() == gguf_bytes
    names = {p.name for p in out.iterdir()}
    assert not names & set(stale) - {"config.json"}                 # stale shards, index and codebooks gone
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 64
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []   # no temporary left


def test_source_inside_the_directory_is_kept(tmp_path, gguf_bytes, capsys):
    out = tmp_path / "model"
    out.mkdir()
    src = out / "m.gguf"
    src.write_bytes(gguf_bytes)
    put(out, UNRELATED)
    assert cli(["convert", str(src), str(out), "--overwrite"], capsys)[0] == 0
    assert cli(["convert", str(src), str(out), "--overwrite"], capsys)[0] == 0     # and again over itself
    assert src.read_bytes() == gguf_bytes
    assert_files(out, UNRELATED)
    assert (out / "model.safetensors").is_file()
    # a source under a name the conversion writes would be replaced: refused, the file intact
    named = out / "model.safetensors"
    named.write_bytes(gguf_bytes)
    with pytest.raises(CheckpointError, match="would be replaced"):
        convert_gguf(named, out, progress=False, overwrite=True)
    assert named.read_bytes() == gguf_bytes


def test_dot_as_the_directory(tmp_path, gguf_bytes, capsys, monkeypatch):
    work = tmp_path / "here"
    work.mkdir()
    (work / "m.gguf").write_bytes(gguf_bytes)
    monkeypatch.chdir(work)
    code, _, err = cli(["convert", "m.gguf", "."], capsys)           # not empty: the GGUF is there
    assert code == 1 and "--overwrite" in err
    code, _, err = cli(["convert", "m.gguf", ".", "--overwrite"], capsys)
    assert code == 0, err
    assert (work / "m.gguf").read_bytes() == gguf_bytes and (work / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here"]    # the temporary beside it is gone
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    assert cli(["convert", str(work / "m.gguf"), "."], capsys)[0] == 0   # an empty `.` needs no flag
    assert (empty / "model.safetensors").is_file()


def test_conversion_files():
    for name in ("config.json", "tokenizer.json", "model.safetensors", "model-00002-of-00003.safetensors",
                 "codebooks-g32-c1024-unrotated.safetensors", "generation_config.json"):
        assert is_conversion_file(name), name
    for name in ("m.gguf", "notes.txt", "book.kv", "model.safetensors.bak", "my-model.safetensors"):
        assert not is_conversion_file(name), name


@pytest.mark.parametrize("keep", [200, -100], ids=["header", "tensor-data"])
def test_truncated_gguf_is_named_truncated(tmp_path, gguf_bytes, capsys, keep):
    (tmp_path / "cut.gguf").write_bytes(gguf_bytes[:keep])
    code, _, err = cli(["convert", str(tmp_path / "cut.gguf"), str(tmp_path / "out")], capsys)
    assert code == 1 and "is truncated" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_failed_install_puts_the_old_model_back(tmp_path, gguf_bytes, monkeypatch):
    """Interrupted while the new files move in: the model files that were there are back, unchanged,
    the unrelated ones untouched, and no temporary directory is left."""
    from minirun.checkpoint import model_files
    src = tmp_path / "m.gguf"
    src.write_bytes(gguf_bytes)
    out = tmp_path / "model"
    convert_gguf(src, out, progress=False)
    put(out, UNRELATED)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    n_model = sum(model_files.is_conversion_file(name) for name in before)
    real, calls = model_files._move, []

    def failing(a, b):
        calls.append(a)
        if len(calls) == n_model + 3:                            # all old model files moved aside, two new ones in
            raise KeyboardInterrupt
        return real(a, b)
    monkeypatch.setattr(model_files, "_move", failing)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(src, out, progress=False, overwrite=True, dtype="float16")
    monkeypatch.setattr(model_files, "_move", real)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "model"]
