"""`minirun convert` onto a full disk or into a read-only directory: one line naming the target and
the space free there, exit status 1, no traceback and nothing half-written (no temporary directory
left beside the target, an existing directory's files untouched)."""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess

import pytest
from tokenizers import pre_tokenizers

from minirun.checkpoint import model_files
from minirun.cli.main import main
from test_convert import bpe_vocab, tiny_weights, train_bpe, write_gguf


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    tok = train_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    return write_gguf(tmp_path_factory.mktemp("src") / "m.gguf", tiny_weights(tok.get_vocab_size()),
                      bpe_vocab(tok, "gpt2"))


def convert(args, capsys) -> tuple[int, str]:
    try:
        main(["convert", *map(str, args)])
        code = 0
    except SystemExit as e:
        code = e.code or 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def one_line(err: str) -> str:
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip() and not ln.startswith("converting")]
    assert len(lines) == 1, err            # (beside the progress bar)
    return lines[0]


def leftovers(parent) -> list[str]:
    """Temporary directories of a conversion (.NAME.tmp-*, .NAME.old-*) left in `parent`."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_full_disk_while_writing_the_weights(gguf_path, tmp_path, monkeypatch, capsys):
    """safetensors raises its own error type for ENOSPC, the OS error only in its text."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "model"
    code, err = convert([gguf_path, out, "--dtype", "float32"], capsys)
    line = one_line(err)
    assert code == 1 and f"cannot write the model into {out}: No space left on device (" in line, line
    assert "free there); nothing was written" in line
    assert not out.exists() and leftovers(tmp_path) == []


def test_read_only_file_system_when_moving_into_place(gguf_path, tmp_path, monkeypatch, capsys):
    """EROFS where the finished directory is renamed into place (a read-only mount)."""
    def read_only(src, dst):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dst))
    monkeypatch.setattr(model_files.os, "replace", read_only)
    out = tmp_path / "model"
    code, err = convert([gguf_path, out], capsys)
    line = one_line(err)
    assert code == 1 and f"cannot write the model into {out}: it is read-only (" in line, line
    assert not out.exists() and leftovers(tmp_path) == []


def test_existing_read_only_directory(gguf_path, tmp_path, monkeypatch, capsys):
    """An existing directory without write permission (mode 0555) is refused before any work; root
    ignores the mode, so there os.access answers as it does for any other user."""
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    out.chmod(0o555)
    try:
        if os.geteuid() == 0:
            real = os.access
            def access(p, mode, **k):
                return real(p, mode, **k) and not (str(p) == str(out) and mode & os.W_OK)
            monkeypatch.setattr(os, "access", access)
        code, err = convert([gguf_path, out, "--overwrite"], capsys)
    finally:
        out.chmod(0o755)
    line = one_line(err)
    assert code == 1 and f"cannot write the model into {out}: it is read-only (" in line, line
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and leftovers(tmp_path) == []


@contextlib.contextmanager
def small_tmpfs(where, options: str):
    """A tmpfs mounted at `where` with `options` (mounting needs root: else the test is skipped, the
    mocked tests above covering the same path)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("mount is not permitted here")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_really_full_disk(gguf_path, tmp_path, capsys):
    """A real 64 KiB file system: the conversion's ~200 KiB do not fit."""
    with small_tmpfs(tmp_path / "small", "size=64k") as mnt:
        code, err = convert([gguf_path, mnt / "model", "--dtype", "float32"], capsys)
        line = one_line(err)
        assert code == 1 and "No space left on device" in line and "free there" in line, line
        assert list(mnt.iterdir()) == []


def test_really_read_only_file_system(gguf_path, tmp_path, capsys):
    """A read-only mount: into a new directory on it, or into the mount point itself (an existing
    directory), one line each."""
    with small_tmpfs(tmp_path / "ro", "size=1m,ro") as mnt:
        for out, extra in ((mnt / "model", []), (mnt, ["--overwrite"])):
            code, err = convert([gguf_path, out, *extra], capsys)
            line = one_line(err)
            assert code == 1 and f"cannot write the model into {out}: it is read-only (" in line, line
        assert list(mnt.iterdir()) == [] and leftovers(tmp_path) == []
