"""Prompt-cache files (`minirun chat --file BOOK --prompt-cache BOOK.kv`): the KV cache after a
document's prefill, saved once and loaded by later chats instead of prefilling again.

Why: a long document's prefill is the slow part of a chat over it (minutes on a CPU at 64K tokens,
6.5 minutes on an H100 at 4M) and is the same every time. llama.cpp's --prompt-cache does this
for its cache; here the file holds whatever the cache holds (its state_dict): dense K and V, or the
HCA tiers (sinks and ring, key codes, host values, codebooks).

Format: a safetensors file (one tensor per name, little-endian, readable by any safetensors reader),
written by streaming the cache's own buffers (no second copy of a 45 GB value pool in memory) to a
temporary file of its own beside FILE (created exclusively, never through a symlink), synced and
renamed over FILE when complete: never a half-written file, and FILE keeps its mode. FILE is written
only where nothing is or a prompt cache is (inspect_file(), before the write and again before the
rename: a document named by mistake is refused, not replaced). Its metadata (`minirun`: JSON, first in the header) holds the format version, the
model's fingerprint (config.json, and each weight file's size and first MiB), the engine settings
that shape the state, the cache signature, the counters and the token ids, and a CRC-32 of the data
that follows the header (`checksum`: computed while the data is written, checked when a file is
loaded: a file whose bytes changed on disk is refused instead of decoding garbage; files without one
load unchecked). A file that does not match the engine is refused with the reason
(PromptCacheMismatch), one that cannot be read or fails its checksum with a one-line error: the chat
then prefills again and replaces it, saying what it held (--prompt-cache-ro: keeps it).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import shutil
import stat
import struct
import zlib
from pathlib import Path

import torch

from .errors import MiniRunError
from .planner import format_bytes

FORMAT, VERSION = "minirun-prompt-cache", 1
# engine settings that shape the saved state (tau, max_select, length scaling and the like only
# steer later steps: a file made with other values of those still fits)
STATE_SETTINGS = ("ctx", "dtype", "weights", "kv", "kv_budget", "groups", "centroids", "key_store", "window", "sinks",
                  "far_positions", "far_distance")
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
           torch.int32: "I32", torch.int16: "I16", torch.uint8: "U8"}
_CHUNK = 64 << 20   # device or strided tensors are copied out in pieces of at most this many bytes


class PromptCacheMismatch(MiniRunError):
    """The file is a prompt cache, but of another model, setting or prompt."""


class NotAPromptCache(MiniRunError):
    """The path holds something else than a prompt cache (a document, a directory): never written over."""


CHECKSUM_PENDING = "crc32:" + "?" * 8     # written in the header first, patched with f"crc32:{crc:08x}" at the end


class _Crc32Writer:
    """A file's write() that keeps the CRC-32 of everything written through it."""

    def __init__(self, f):
        self.f, self.crc = f, 0

    def write(self, b) -> int:
        self.crc = zlib.crc32(b, self.crc)
        return self.f.write(b)


def data_checksum(path: Path) -> str:
    """f"crc32:{crc:08x}" of a prompt-cache file's data (everything after its safetensors header)."""
    crc = 0
    with open(path, "rb") as f:
        f.seek(8 + struct.unpack("<Q", f.read(8))[0])
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"crc32:{crc:08x}"


def model_fingerprint(model_dir: Path) -> dict:
    """config.json's hash and each weight file's size and hash of its first MiB (the header and the
    first tensors: a re-converted or re-quantized checkpoint differs there)."""
    def head_hash(p: Path, n: int | None = None) -> str:
        with open(p, "rb") as f:
            return hashlib.sha256(f.read(n) if n else f.read()).hexdigest()[:16]
    weights = sorted(model_dir.glob("*.safetensors"))
    return {"config": head_hash(model_dir / "config.json"),
            "weights": [[p.name, p.stat().st_size, head_hash(p, 1 << 20)] for p in weights
                        if not p.name.startswith("codebooks-")]}


def _meta(eng) -> dict:
    cfg = eng.config
    return {"format": FORMAT, "version": VERSION, "model": model_fingerprint(eng.path), "model_name": eng.path.name,
            "settings": {k: getattr(cfg, k) for k in STATE_SETTINGS}, "device": eng.device.type,
            "cache": eng.cache.state_signature()}


def _write_tensor(f, t: torch.Tensor) -> None:
    """t's elements in C order: a contiguous CPU tensor as it is (no copy), anything else (a device
    tensor, a strided or transposed view) in pieces of at most _CHUNK bytes, split along the
    leading dimensions (never a host copy of a whole value pool, nor a copy per row)."""
    if t.numel() == 0:
        return
    if t.device.type == "cpu" and t.is_contiguous():
        f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    elif t.numel() * t.element_size() <= _CHUNK:
        _write_tensor(f, t.cpu().contiguous())
    elif t.shape[0] == 1:
        _write_tensor(f, t[0])
    else:
        step = max(1, _CHUNK // (t[0].numel() * t.element_size()))
        for i in range(0, t.shape[0], step):
            _write_tensor(f, t[i:i + step])


def _header(eng) -> tuple[bytes, int, list]:
    """-> (the safetensors header, padded to 8 bytes; where its checksum goes; (name, tensor) in the
    file's order). The metadata comes first: inspect_file() knows a file cut short for one of ours."""
    scalars, tensors = eng.cache.state_dict()
    tensors = [("tokens", torch.tensor(eng._cached_ids, dtype=torch.int64))] + tensors
    meta = {**_meta(eng), "scalars": scalars, "checksum": CHECKSUM_PENDING}
    header, off = {"__metadata__": {"minirun": json.dumps(meta)}}, 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return raw, raw.index(CHECKSUM_PENDING.encode()), tensors


def _create_beside(target: Path) -> tuple[int, Path]:
    """A new, empty file of a unique name in target's directory -> (fd, path). O_EXCL and O_NOFOLLOW:
    never a file that was there, nor one a symlink points to. Its mode: the umask's."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = target.with_name(f".{target.name[:200]}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o666)   # (the umask and the directory's default ACL apply)
        except FileExistsError:
            continue
        return fd, tmp
    raise FileExistsError(errno.EEXIST, f"no free temporary name beside {target}")


def _sync_dir(d: Path) -> None:
    """Make a rename in d durable (where the platform lets a directory be opened and synced)."""
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save(eng, path) -> int:
    """Write the engine's cache and its token ids to path (atomically, through a symlink at path to its
    target) -> bytes written. NotAPromptCache: path holds something else (left as it is)."""
    target = Path(os.path.realpath(path))
    inspect_file(target)
    raw, pending, tensors = _header(eng)
    total = 8 + len(raw) + sum(t.numel() * t.element_size() for _, t in tensors)
    free = shutil.disk_usage(target.parent).free
    if total > free:   # (say so before writing tens of GiB, not after)
        raise OSError(errno.ENOSPC, f"{format_bytes(total)} needed, {format_bytes(free)} free")
    try:
        mode = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        mode = None
    fd, tmp = _create_beside(target)
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:       # (a 0600 file stays 0600)
                os.fchmod(f.fileno(), mode)
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            data = _Crc32Writer(f)
            for _, t in tensors:
                _write_tensor(data, t)
            f.seek(8 + pending)
            f.write(f"crc32:{data.crc:08x}".encode())
            f.flush()
            os.fsync(f.fileno())
        inspect_file(target)    # again: a large cache takes minutes to write; a document saved there meanwhile stays
        os.replace(tmp, target)
    except BaseException:   # (a full disk, Ctrl-C, NotAPromptCache: no half-written file, at either name)
        tmp.unlink(missing_ok=True)
        raise
    _sync_dir(target.parent)
    return total


# the start of the metadata's format field, as it stands (escaped) inside the safetensors header
_MARK = json.dumps(f'"format": "{FORMAT}"')[1:-1].encode()
_MAX_HEADER = 100 << 20    # (safetensors' own limit)


def inspect_file(path) -> dict | None:
    """What is at path, from the header alone (the data unread): None where nothing is (no file, or an
    empty one); the file's minirun metadata and "n_tokens" for a prompt cache; {"damaged": True} for
    one whose header is cut short or garbled (still ours to replace). NotAPromptCache for anything
    else (a directory, a document, another safetensors file), MiniRunError where it cannot be read."""
    path = Path(path)
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise NotAPromptCache(f"{path} is {kind}, not a minirun prompt cache")
        if st.st_size == 0:
            return None
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8).ljust(8, b"\xff"))[0]
            raw = f.read(n) if n <= _MAX_HEADER else b""
    except FileNotFoundError:
        return None
    except OSError as e:
        raise MiniRunError(f"cannot read prompt cache {path} ({e.strerror or e})") from None
    if not (raw.startswith(b"{") and _MARK in raw):
        raise NotAPromptCache(f"{path} is a file but not a minirun prompt cache: left as it is (name a new "
                              f"file for the cache, or one minirun wrote)")
    try:
        header = json.loads(raw)
        return {**json.loads(header["__metadata__"]["minirun"]), "n_tokens": header["tokens"]["shape"][0]}
    except (ValueError, KeyError, TypeError, IndexError):
        return {"damaged": True}


def summary(info: dict) -> str:
    """What a prompt-cache file holds, from inspect_file(), in a few words:
    "1046 tokens of SmolLM2-135M-Instruct (ctx 4096, kv hca, dtype float32)"."""
    if info.get("damaged"):
        return "a damaged prompt cache"
    s = info.get("settings") or {}
    model = info.get("model_name") or f"the model with config {str((info.get('model') or {}).get('config'))[:8]}"
    return f"{info.get('n_tokens')} tokens of {model} (ctx {s.get('ctx')}, kv {s.get('kv')}, dtype {s.get('dtype')})"


def _mismatch(want: dict, have: dict, what: str) -> str | None:
    for k in list(want) + [k for k in have if k not in want]:   # (the settings' order: ctx, dtype, kv first)
        if want.get(k) != have.get(k):
            return f"{what} {k}: {have.get(k)!r} in the file, {want.get(k)!r} here"
    return None


def _unreadable(path, e: Exception) -> MiniRunError:
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return MiniRunError(f"prompt cache {path} is unreadable ({first})")


def _open(path: Path):
    """-> (safe_open handle, metadata, saved token ids); MiniRunError when not a readable prompt cache."""
    from safetensors import SafetensorError, safe_open
    try:
        f = safe_open(str(path), framework="pt", device="cpu")
        meta = json.loads((f.metadata() or {}).get("minirun", "null"))
        saved = f.get_tensor("tokens").tolist() if isinstance(meta, dict) and meta.get("format") == FORMAT else None
    except (SafetensorError, OSError, ValueError) as e:
        raise _unreadable(path, e) from None
    if saved is None:
        raise MiniRunError(f"{path} is not a minirun prompt cache")
    return f, meta, saved


def _shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def load(eng, path, tokens: list[int] | None = None) -> int:
    """Make the engine's cache what the file holds. tokens: the prompt the file must hold exactly
    (None: any). -> tokens loaded. PromptCacheMismatch: another model, setting or prompt (the reason
    in one line; the cache untouched); MiniRunError: not a readable prompt cache."""
    from safetensors import SafetensorError
    path = Path(path)
    f, meta, saved = _open(path)
    if meta.get("version") != VERSION:
        raise PromptCacheMismatch(f"prompt cache {path} has format version {meta.get('version')}, "
                                  f"this minirun reads {VERSION}")
    want = _meta(eng)
    why = (_mismatch(want["model"], meta.get("model", {}), "model")
           or _mismatch(want["settings"], meta.get("settings", {}), "setting")
           or _mismatch({"device": want["device"]}, {"device": meta.get("device")}, "the")
           or _mismatch(want["cache"], meta.get("cache", {}), "cache"))
    if why:
        raise PromptCacheMismatch(f"prompt cache {path} was made for another setup ({why})")
    if tokens is not None and saved != list(tokens):
        raise PromptCacheMismatch(f"prompt cache {path} holds another prompt ({len(saved)} tokens against "
                                  f"{len(tokens)} here, from token {_shared_prefix(saved, tokens)} on)")
    if "checksum" in meta and data_checksum(path) != meta["checksum"]:
        raise MiniRunError(f"prompt cache {path} is damaged: its data does not match its checksum")
    try:
        eng.reset()
        eng.cache.load_state_dict(meta["scalars"], f.get_tensor)
    except (SafetensorError, KeyError, RuntimeError, ValueError) as e:
        eng.reset()
        raise _unreadable(path, e) from None
    eng._cached_ids = saved
    return len(saved)


def load_prefix(eng, path, ids: list[int]) -> tuple[int, int]:
    """llama.cpp's --prompt-cache: load the file when the prompt it holds and `ids` start alike, so
    the next prefill of `ids` computes only the rest (a file that shares nothing is not loaded).
    -> (tokens in the file, tokens shared with ids). Errors as load()."""
    _, _, saved = _open(Path(path))
    shared = _shared_prefix(saved, ids)
    if shared:
        eng.load_prompt_cache(path)   # (under inference mode: the cache's buffers are inference tensors)
    return len(saved), shared
