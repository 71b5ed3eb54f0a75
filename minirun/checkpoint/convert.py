"""Convert a GGUF (llama.cpp) file of a Llama, Qwen2, Qwen3 or Gemma 3 model (Mistral's are "llama"
GGUFs) into a Hugging Face checkpoint directory.

    convert_gguf("model.gguf", "models/NAME")

writes `config.json`, `model.safetensors` (shards plus `model.safetensors.index.json` when the model is
larger than `shard_bytes`), `tokenizer.json`, `tokenizer_config.json` and `generation_config.json`.
Quantized tensors are dequantized with `gguf.quants`; llama.cpp's row permutation of a Llama's Q and
K projections is undone (Qwen's and Gemma's GGUFs keep HF's rows: their RoPE is the half-split one), so
the result is laid out exactly like a `transformers` checkpoint of the architecture. llama.cpp stores
Gemma's norm weights with the 1 of its (1 + w) added; they are written back zero-centred where
subtracting the 1 gives the stored values back exactly, else as stored with `norm_offset: 0` in
config.json (minirun's loader then adds nothing; transformers would not know to).
The files are written into a temporary directory next to `out_dir` and moved into place at the end; with
`overwrite`, only the files a conversion writes (and calibrated codebooks) are replaced in an existing
directory, never anything else in it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError
from .gguf_config import ARCHITECTURES, as_llama_keys, build_config, build_generation_config
from .model_files import install, prepare_target

GGUF_MAGIC = b"GGUF"
DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16", "f16": "float16",
                  "half": "float16", "float": "float32"}
DEFAULT_SHARD_BYTES = 4 * 2**30

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Gemma 3's four norms a layer (llama.cpp's names as gguf's tensor_mapping gives them)
_GEMMA3_LAYER_NAMES = _LAYER_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Tensors llama.cpp writes that have no HF counterpart (rope_freqs becomes config.rope_scaling).
_SKIPPED = {"rope_freqs.weight"}


def _supported_types() -> set:
    from gguf import GGMLQuantizationType as T

    return {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
            T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}


# --------------------------------------------------------------------------------------------
# reading


class _Truncated(Exception):
    def __init__(self, size: int, needed: int):
        self.size, self.needed = size, needed


def _checked_reader():
    """gguf.GGUFReader whose reads past the end of the file raise _Truncated (the reader slices its
    memmap, so a short file otherwise fails later as a reshape of too few bytes)."""
    from gguf import GGUFReader

    class CheckedReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > len(self.data):
                raise _Truncated(len(self.data), end)
            return super()._get(offset, dtype, count, override_order)
    return CheckedReader


def open_gguf(gguf_path: str | os.PathLike):
    """A `gguf.GGUFReader` for `gguf_path`, or a one-line CheckpointError if it is not a GGUF."""
    path = Path(gguf_path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
    try:
        return _checked_reader()(path, "r")
    except _Truncated as e:
        raise CheckpointError(f"GGUF file {path} is truncated: {e.size} bytes, its header describes at least "
                              f"{e.needed} (an incomplete download or copy?)") from None
    except Exception as e:  # corrupt files raise all sorts of things
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"cannot read GGUF file {path}: {msg}") from None


def read_metadata(reader) -> dict[str, Any]:
    """Every key/value of the GGUF header as plain Python values (strings, numbers, lists)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # an exotic value type we do not need
            continue
    return meta


def _hf_name(name: str, arch: str = "llama") -> str | None:
    """HF tensor name for a GGUF tensor name, None for tensors that are dropped, "" for one the
    architecture has no place for."""
    if name in _SKIPPED:
        return None
    stem, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return ""
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    layer_names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
    return ""


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (interleaved rotary pairs -> HF's half split)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (used by tests to build GGUFs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(t) -> np.ndarray:
    """A reader tensor as float32 numpy, rows x cols (HF orientation: GGUF's ne order reversed)."""
    from gguf.quants import dequantize

    if t.tensor_type not in _supported_types():
        raise CheckpointError(f"tensor {t.name} has unsupported GGUF type {t.tensor_type.name}")
    data = dequantize(np.asarray(t.data), t.tensor_type)
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    data = np.ascontiguousarray(data, dtype=np.float32).reshape(shape)
    return data if data.flags.writeable else data.copy()  # F32 comes back as a read-only memmap view


# --------------------------------------------------------------------------------------------
# writing


def _plan_shards(items: list, nbytes, shard_bytes: int) -> list[list]:
    shards, cur, cur_bytes = [], [], 0
    for item in items:
        size = nbytes(item[2])
        if cur and cur_bytes + size > shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(item)
        cur_bytes += size
    if cur:
        shards.append(cur)
    return shards


def _write_weights(items, tmp: Path, dtype: str | None, meta: dict, shard_bytes: int, progress: bool,
                   permuted: bool = True, norm_shift: float = 0.0) -> dict:
    """Write the tensors as safetensors shards; dtype None keeps the block formats minirun computes
    with as their parts (minirun.quant) and writes the rest as float32; permuted: the Q and K rows
    in llama.cpp's Llama order (undone here); norm_shift: subtracted from the norms' weights (in
    float32). -> {name: format} kept."""
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    from ..quant.checkpoint import kept_blocks, kept_format, planes_for_file

    torch_dtype = getattr(torch, dtype or "float32")
    n_head = int(meta["llama.attention.head_count"])
    n_kv = int(meta.get("llama.attention.head_count_kv", n_head))
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    keep = dtype is None
    shards = _plan_shards(items, lambda t: kept_format(t)[1] if keep and kept_format(t) else
                          int(np.prod(t.shape)) * itemsize, shard_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total, formats = {}, 0, {}
    with tqdm(total=len(items), desc="converting", unit="tensor", disable=not progress) as bar:
        for fname, shard in zip(names, shards):
            tensors = {}
            for hf_name, gguf_name, t in shard:
                blocks = kept_blocks(t) if keep else None
                w = blocks[1] if blocks else dequantize_tensor(t)     # rows are rows either way: [rows, ...]
                if permuted and ".self_attn.q_proj." in hf_name:
                    w = unpermute_qk(w, n_head)
                elif permuted and ".self_attn.k_proj." in hf_name:
                    w = unpermute_qk(w, n_kv)
                if norm_shift and _is_norm(hf_name):
                    w = w - np.float32(norm_shift)
                if blocks:
                    fmt, _, cols = blocks
                    formats[hf_name] = fmt
                    parts = {k: torch.from_numpy(v) for k, v in planes_for_file(hf_name, fmt, w, cols).items()}
                else:
                    parts = {hf_name: torch.from_numpy(np.ascontiguousarray(w)).to(torch_dtype)}
                for k, v in parts.items():
                    tensors[k] = v
                    weight_map[k] = fname
                    total += v.numel() * v.element_size()
                bar.update(1)
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(tmp / "model.safetensors.index.json", index)
    return formats


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_error(e: BaseException, out: Path) -> CheckpointError | None:
    """A failed write into `out` (an OSError, or safetensors' error with the OS error in its text:
    "... No space left on device (os error 28)") as one line naming the path and the space free
    there; None for any other error."""
    code = getattr(e, "errno", None) if isinstance(e, OSError) else None
    if code is None and type(e).__name__ == "SafetensorError":
        m = re.search(r"os error (\d+)", str(e))
        code = int(m.group(1)) if m else None
    if code is None:
        return None
    from ..planner import format_bytes
    where = out if out.is_dir() else out.parent
    try:
        free = f"{format_bytes(shutil.disk_usage(where).free)} free there"
    except OSError:
        free = "its free space unknown"
    what = "it is read-only" if code in (errno.EROFS, errno.EACCES, errno.EPERM) else os.strerror(code)
    return CheckpointError(f"cannot write the model into {out}: {what} ({free}); nothing was written")


def _is_norm(hf_name: str) -> bool:
    return hf_name.endswith("norm.weight")


def gemma_norms_shift(items) -> float:
    """What to subtract from a gemma3 GGUF's norm weights g (llama.cpp's 1 + w): 1.0 when (g - 1) + 1
    gives every g back exactly in float32 (the loader adds the 1 back so), else 0.0 (kept as stored)."""
    one = np.float32(1.0)
    for hf_name, _, t in items:
        if _is_norm(hf_name):
            g = dequantize_tensor(t)
            if not np.array_equal((g - one) + one, g):
                return 0.0
    return 1.0


def llama_tensors(reader, path: Path, arch: str = "llama") -> tuple[list, dict]:
    """The GGUF's tensors as (HF name, GGUF name, tensor) in an HF checkpoint's order (embeddings,
    layers in numeric order, final norm, lm_head), and every tensor by its GGUF name. Raises
    CheckpointError for a tensor the architecture has no place for, or of a type not supported."""
    supported = _supported_types()
    items, by_name = [], {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        hf = _hf_name(t.name, arch)
        if hf == "":
            raise CheckpointError(f"{path}: unexpected tensor {t.name!r} for a {arch} model")
        if t.tensor_type not in supported:
            raise CheckpointError(f"{path}: tensor {t.name} has unsupported GGUF type {t.tensor_type.name}")
        if hf is not None:
            items.append((hf, t.name, t))
    for required in ("token_embd.weight", "output_norm.weight"):
        if required not in by_name:
            raise CheckpointError(f"{path}: tensor {required!r} is missing")

    def order(item):
        name = item[0]
        if name.startswith("model.layers."):
            return (1, int(name.split(".")[2]), name)
        return ({"model.embed_tokens.weight": 0, "model.norm.weight": 2}.get(name, 3), 0, name)
    items.sort(key=order)
    return items, by_name


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str | None = None,
                 progress: bool = True, overwrite: bool = False,
                 shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Convert a GGUF (Llama, Qwen2, Qwen3, Gemma 3) into an HF checkpoint directory at `out_dir`; returns its path.

    `dtype` is the stored weight type: "float32", "bfloat16" or "float16", every tensor dequantized
    to it; None keeps the GGUF block formats minirun computes with (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) as
    they are (Q5_0 as the same values in Q8_0), named in config.json's quantization_config
    (minirun.quant), and writes the other tensors as float32. Raises CheckpointError for a missing
    or unreadable file, another architecture or an unsupported tensor type.
    """
    from .gguf_tokenizer import build_tokenizer, build_tokenizer_config

    if dtype is not None:
        dtype = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"unsupported dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    path = Path(gguf_path)
    out = Path(os.path.abspath(out_dir))     # ("." has no name, and no parent to build beside it in)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported (only "
                              f"{', '.join(repr(a) for a in ARCHITECTURES)})")
    meta = as_llama_keys(meta, arch)

    items, by_name = llama_tensors(reader, path, arch)

    tied = "output.weight" not in by_name
    n_vocab = int(by_name["token_embd.weight"].shape[-1])
    rope_freqs = dequantize_tensor(by_name["rope_freqs.weight"]) if "rope_freqs.weight" in by_name else None
    has_bias = {"attn": any(".self_attn." in i[0] and i[0].endswith(".bias") for i in items),
                "mlp": any(".mlp." in i[0] and i[0].endswith(".bias") for i in items)}
    config = build_config(meta, n_vocab, tied, dtype or "float32", rope_freqs, has_bias, path, arch)
    norm_shift = gemma_norms_shift(items) if arch == "gemma3" else 0.0
    if arch == "gemma3" and not norm_shift:
        config["norm_offset"] = 0.0          # (the norms kept as llama.cpp stores them: 1 + w)
    if dtype is None:
        from ..quant.checkpoint import kept_format, quantization_config
        kept = {hf: kept_format(t)[0] for hf, _, t in items if kept_format(t)}
        if kept:
            config["quantization_config"] = quantization_config(kept)
    try:
        tokenizer = build_tokenizer(meta)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except Exception as e:  # tokenizers rejects an inconsistent vocabulary
        raise CheckpointError(f"{path}: cannot build the tokenizer: {str(e).splitlines()[0] if str(e) else e!r}") from None
    tok_config = build_tokenizer_config(meta, config["max_position_embeddings"])

    try:
        prepare_target(out, path, overwrite)
        if out.is_dir() and not os.access(out, os.W_OK):     # (before the minutes a conversion takes)
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(out))
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))   # (beside it: renamed in)
    except OSError as e:
        raise write_error(e, out) from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; give it a normal directory's mode
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", build_generation_config(meta))
        _write_json(tmp / "tokenizer_config.json", tok_config)
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_weights(items, tmp, dtype, meta, shard_bytes, progress, permuted=arch == "llama", norm_shift=norm_shift)
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~umask)  # safetensors writes 0600 files
        install(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        err = write_error(e, out)
        if err is not None:
            raise err from None
        raise
    return Path(out_dir)
