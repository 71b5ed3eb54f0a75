"""Offline codebooks: run the model over text, collect post-RoPE keys, fit per-group k-means."""
from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from .errors import MiniRunError
from .kv.codebooks import Codebooks, codebook_filename


def builtin_text(part: str = "calibration") -> tuple[str, str]:
    """Text every Python install has (the stdlib's pydoc topics), split into two disjoint halves:
    "calibration" for codebooks and "evaluation" for the quality tools. Returns (text, source)."""
    import pydoc_data.topics
    topics = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    half = len(topics) // 2
    chosen = topics[:half] if part == "calibration" else topics[half:]
    return "\n\n".join(chosen), f"pydoc_data.topics ({part} half: {len(chosen)} topics)"


def read_text(data: str | Path | None, part: str = "calibration") -> tuple[str, str]:
    if data is None:
        return builtin_text(part)
    p = Path(data)
    try:
        text = p.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise MiniRunError(f"cannot read --data {p}: {e.strerror or e}") from None
    if not text.strip():
        raise MiniRunError(f"--data {p} is empty")
    return text, str(p)


@torch.inference_mode()
def collect_keys(eng, ids: list[int], window: int = 2048, max_tokens: int = 16384, skip: int = 16) -> torch.Tensor:
    """Post-RoPE keys [L, Hkv, n, hd] (float32) from dense prefills over consecutive windows of ids.

    The first `skip` positions of each window (attention sinks, unusual keys) are left out.
    """
    chunks, n = [], 0
    for w0 in range(0, len(ids), window):
        win = ids[w0:w0 + window]
        if len(win) <= skip + 1:
            break
        eng.reset()
        eng.prefill(win)
        k = eng.cache.k[:, :, skip:len(win)].float().clone()
        chunks.append(k)
        n += k.shape[2]
        if n >= max_tokens:
            break
    eng.reset()
    if not chunks:
        raise MiniRunError("calibration text is too short: need at least a few hundred tokens")
    return torch.cat(chunks, 2)[:, :, :max_tokens]


def calibrate(model_dir: str | Path, groups: int, centroids: int, data=None, tokens: int = 16384,
              iters: int = 40, window: int = 2048, dtype: str = "float32", progress: bool = True,
              log=print) -> Path:
    """Fit and write `codebooks-g{G}-c{C}.safetensors` into model_dir; returns its path."""
    from .engine import Engine
    model_dir = Path(model_dir)
    text, source = read_text(data)
    eng = Engine.load(model_dir, device="cpu", dtype=dtype, ctx=window, kv="dense")
    hd = eng.args.head_dim
    if hd % groups:
        raise MiniRunError(f"--groups {groups} does not divide head_dim {hd}")
    ids = eng.tokenize(text)
    t0 = time.perf_counter()
    keys = collect_keys(eng, ids, window=window, max_tokens=tokens)
    log(f"calibrate: {keys.shape[2]} keys per (layer, kv-head) from {source} in {time.perf_counter() - t0:.1f}s")
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=1, desc="k-means", unit="step")

    def tick(done, total):
        bar.total = total
        bar.update(done - bar.n)

    t0 = time.perf_counter()
    cb = Codebooks.fit(keys, groups, centroids, iters=iters, progress=tick if bar else None,
                       source="calibrated")
    if bar:
        bar.close()
    log(f"calibrate: fitted {keys.shape[0] * keys.shape[1] * groups} codebooks of {centroids} centroids "
        f"in {time.perf_counter() - t0:.1f}s")
    path = model_dir / codebook_filename(groups, centroids)
    meta = {"data": source, "tokens": int(keys.shape[2]), "iters": iters,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d")}
    return cb.save(path, meta=meta)
