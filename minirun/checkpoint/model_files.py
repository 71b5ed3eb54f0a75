"""Which files of a model directory a conversion owns, and putting a finished conversion in place.

convert_gguf writes into a temporary directory beside the target and calls `install` at the end: a
new directory is renamed into place whole; into an existing one only the files a conversion writes
(and calibrated codebooks, fitted to the weights being replaced) are replaced, so that nothing else
in the directory (notes, prompt caches, the source GGUF itself) is ever lost.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from pathlib import Path

from ..errors import CheckpointError

# what a conversion writes (and shards model-0000i-of-0000n.safetensors): all that `overwrite` replaces
CONVERSION_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "model.safetensors", "model.safetensors.index.json")


def is_conversion_file(name: str) -> bool:
    """Whether a file in a model directory is one a conversion writes or one derived from its weights
    (calibrated codebooks): what `overwrite` replaces. Anything else in the directory is left alone."""
    return (name in CONVERSION_FILES or name.startswith("codebooks-") and name.endswith(".safetensors")
            or bool(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name)))


def prepare_target(out: Path, source: Path, overwrite: bool) -> None:
    """Refuse (one line) what would lose something: a file where the directory goes, a directory
    holding files without `overwrite`, a source the conversion would replace."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"output path {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"output directory {out} is not empty: --overwrite replaces the model files in it "
                              f"(config, weights, tokenizer, codebooks) and leaves every other file")
    if os.path.realpath(source.parent) == os.path.realpath(out) and is_conversion_file(source.name):
        raise CheckpointError(f"{source} would be replaced by the conversion's own {source.name}: "
                              f"convert into another directory")
    out.parent.mkdir(parents=True, exist_ok=True)


def _move(src: Path, dst: Path) -> None:
    try:
        os.replace(src, dst)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        shutil.move(str(src), str(dst))       # (a directory that is a mount point of its own)


def install(tmp: Path, out: Path) -> None:
    """Move the finished files of `tmp` into `out`. A new directory is renamed into place whole; into
    an existing one (overwrite, or an empty one such as `.`) the model files it held move aside, the
    new ones move in, and the old ones are deleted last: on a failure they are put back."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    moved_out, moved_in = [], []
    try:
        for f in sorted(out.iterdir()):
            if f.is_file() and is_conversion_file(f.name):
                _move(f, old / f.name)
                moved_out.append(f.name)
        for f in sorted(tmp.iterdir()):
            _move(f, out / f.name)
            moved_in.append(f.name)
    except BaseException:
        for name in moved_in:
            (out / name).unlink(missing_ok=True)
        for name in moved_out:
            _move(old / name, out / name)
        shutil.rmtree(old, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    tmp.rmdir()
