"""Offline codebooks: run the model over text, collect post-RoPE keys, fit per-group k-means.

`minirun calibrate MODEL` writes `codebooks-g{G}-c{C}.safetensors` into the model directory; the
HCA cache loads it from there (kv/hca.py). Keys come from dense prefills over windows of the
calibration text (a DenseCache holds post-RoPE keys), sub-sampled evenly across windows and
positions; the first `skip` positions of each window (attention sinks, whose keys are unusual and
which HCA keeps exact anyway) are left out.
"""
from __future__ import annotations

import math
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..errors import MiniRunError
from ..kv.codebooks import Codebooks, codebook_filename

# Defaults measured on SmolLM2-135M (2-core CPU; see docs/QUALITY.md): 12 windows of 2048 tokens
# (~40 s of dense prefill) give 16384 keys per (layer, kv-head); 40 mini-batch steps of 4096 samples
# take ~50 s for 1440 or 2880 problems of 1024 centroids. 8192 vs 24576 keys and 40 vs 100 steps
# changed held-out key error and attention-mass recall only in the third digit.
DEFAULT_WINDOW = 2048
DEFAULT_WINDOWS = 12
DEFAULT_TOKENS = 16384
DEFAULT_ITERS = 40
DEFAULT_SKIP = 16


def builtin_text(part: str = "calibration") -> tuple[str, str]:
    """Text every Python install has (the stdlib's pydoc topics), split into two disjoint halves by
    topic name: "calibration" for codebooks and "evaluation" for the quality tools.
    Returns (text, source description)."""
    import pydoc_data.topics
    topics = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    half = len(topics) // 2
    chosen = topics[:half] if part == "calibration" else topics[half:]
    return "\n\n".join(chosen), f"pydoc_data.topics ({part} half: {len(chosen)} of {len(topics)} topics)"


def strip_gutenberg(text: str) -> str:
    """The body of a Project Gutenberg e-text (between its START and END markers), else text as is."""
    start, end = text.find("*** START OF"), text.find("*** END OF")
    if start >= 0:
        nl = text.find("\n", start)
        text = text[nl + 1 if nl >= 0 else start:end if end > start else None]
    elif end >= 0:
        text = text[:end]
    return text.strip()


def read_text(data: str | Path | None, part: str = "calibration", flag: str = "--data") -> tuple[str, str]:
    """(text, source): the file's text (Gutenberg boilerplate removed) or the built-in text; flag
    names the option in the one-line errors."""
    if data is None:
        return builtin_text(part)
    p = Path(data)
    try:
        text = p.read_text(encoding="utf-8-sig", errors="replace")
    except OSError as e:
        raise MiniRunError(f"cannot read {flag} {p}: {e.strerror or e}") from None
    text = strip_gutenberg(text)
    if not text.strip():
        raise MiniRunError(f"{flag} {p} is empty")
    return text, f"{p.name} ({len(text)} chars)"


def _spread(n_items: int, k: int) -> list[int]:
    """k indices spread evenly over range(n_items) (all of them when k >= n_items)."""
    if k >= n_items:
        return list(range(n_items))
    return [int(i * n_items / k) for i in range(k)]


@torch.inference_mode()
def collect_keys(eng, ids: list[int], window: int = DEFAULT_WINDOW, max_tokens: int = DEFAULT_TOKENS,
                 windows: int = DEFAULT_WINDOWS, skip: int = DEFAULT_SKIP, progress=None,
                 unrotated: bool = False) -> torch.Tensor:
    """Post-RoPE keys [L, Hkv, n <= max_tokens, hd] (float32) from dense prefills.

    The text is cut into consecutive windows of `window` tokens; up to `windows` of them, spread
    evenly over the text, are prefilled (each in a fresh cache, so every window starts at position
    0 like a prompt does). From each, about max_tokens / windows positions spread evenly over
    [skip, len) are kept. progress: optional callable(done_windows, total_windows). unrotated: the
    keys without their RoPE rotation (what the far-position cache stores: kv/far_positions.py).
    """
    from ..kv.far_positions import unrotate_keys
    starts = list(range(0, len(ids), window))
    if starts and len(ids) - starts[-1] < window // 2 and len(starts) > 1:
        starts.pop()                                   # a short tail window: drop it
    starts = [starts[i] for i in _spread(len(starts), max(1, windows))]
    usable = [min(window, len(ids) - s) - skip for s in starts]
    if not starts or sum(u for u in usable if u > 0) < 64:
        raise MiniRunError(f"calibration text is too short: {len(ids)} tokens; need a few hundred at least")
    per = math.ceil(max_tokens / len(starts))
    chunks = []
    for i, s in enumerate(starts):
        win = ids[s:s + window]
        if len(win) <= skip + 1:
            continue
        eng.reset()
        eng.prefill(win)
        pos = torch.tensor(_spread(len(win) - skip, per)) + skip
        k = eng.cache.full_layers.k[:, :, pos].float()     # (a model's global layers: the ones with a store)
        chunks.append(unrotate_keys(k, pos, eng.model.inv_freq) if unrotated else k.clone())
        if progress:
            progress(i + 1, len(starts))
    eng.reset()
    keys = torch.cat(chunks, 2)
    if keys.shape[2] > max_tokens:                     # rounding: thin out evenly, not by truncation
        keys = keys[:, :, _spread(keys.shape[2], max_tokens)]
    return keys


def calibrate(model_dir: str | Path, groups: int, centroids: int = 1024, data=None,
              tokens: int = DEFAULT_TOKENS, iters: int = DEFAULT_ITERS, window: int = DEFAULT_WINDOW,
              windows: int = DEFAULT_WINDOWS, dtype: str = "float32", seed: int = 0, progress: bool = True,
              unrotated: bool = False, log=print, budgets: bool = True) -> Path:
    """Fit and write `codebooks-g{G}-c{C}.safetensors` (unrotated: `...-unrotated.safetensors`, of
    keys without their RoPE rotation, for far positions, and with budgets the per-head selection
    caps measured past the trained context: head_budgets) into model_dir; returns its path."""
    from ..config import ModelArgs
    from ..engine import Engine
    model_dir = Path(model_dir)
    args = ModelArgs.from_path(model_dir)                       # a bad model dir fails before the text is read
    if groups < 1 or args.head_dim % groups:
        raise MiniRunError(f"--groups {groups} does not divide head_dim {args.head_dim}")
    if not 2 <= centroids <= 32768:
        raise MiniRunError(f"--centroids must be in [2, 32768], got {centroids}")
    if tokens < 1 or iters < 1:
        raise MiniRunError("--tokens and --iters must be positive")
    text, source = read_text(data)
    eng = Engine.load(model_dir, device="cpu", dtype=dtype, ctx=window, kv="dense")
    ids = eng.tokenize(text)
    bar = _bar(progress, "keys", "window")
    t0 = time.perf_counter()
    keys = collect_keys(eng, ids, window=window, max_tokens=tokens, windows=windows,
                        progress=bar.tick if bar else None, unrotated=unrotated)
    if bar:
        bar.close()
    t_keys = time.perf_counter() - t0
    log(f"calibrate: {keys.shape[2]} keys per (layer, kv-head) from {len(ids)} tokens of {source} "
        f"in {t_keys:.1f}s")
    del eng
    bar = _bar(progress, "k-means", "step")
    t0 = time.perf_counter()
    cb = Codebooks.fit(keys, groups, centroids, iters=iters, seed=seed, progress=bar.tick if bar else None,
                       source="calibrated")
    if bar:
        bar.close()
    t_fit = time.perf_counter() - t0
    log(f"calibrate: fitted {keys.shape[0] * keys.shape[1] * groups} codebooks of {centroids} centroids "
        f"({iters} steps) in {t_fit:.1f}s")
    path = model_dir / codebook_filename(groups, centroids, unrotated)
    meta = {"data": source, "tokens": int(keys.shape[2]), "text_tokens": len(ids), "iters": iters,
            "windows": windows, "window": window, "seed": seed, "unrotated": unrotated,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "seconds": round(t_keys + t_fit, 1)}
    extra = head_budgets(model_dir, args, ids, dtype, meta, log) if unrotated and budgets else None
    return cb.save(path, meta=meta, extra=extra)


def head_budgets(model_dir: Path, args, ids: list[int], dtype: str, meta: dict, log=print) -> dict | None:
    """The per-head selection caps for far positions (minirun/kv/head_budgets.py), measured past the
    trained context on the calibration text (repeated to length) -> the file's extra tensors
    {"head_caps" int32 [L, Hq], "store_share" f32 [L, Hq]}, with what was measured in meta; None
    when the model states no trained context."""
    from ..kv import head_budgets as hb
    from ..engine import Engine
    trained = args.max_position_embeddings
    if not trained:
        return None
    n = trained + hb.MEASURE_PAST
    t0 = time.perf_counter()
    eng = Engine.load(model_dir, device="cpu", dtype=dtype, ctx=n + 64, kv="hca", kv_budget=0.5, prefill_mode="exact")
    m = hb.measure(eng, (ids * (n // max(1, len(ids)) + 1))[:n])
    caps = hb.caps_from(m["store_share"], m["captured"])
    meta.update(head_budget_tokens=n, head_budget_lost=hb.LOST_MASS,
                heads_skipping=int((caps < 0).sum()), heads=int(caps.size))
    log(f"calibrate: per-head budgets at {n} tokens in {time.perf_counter() - t0:.1f}s: {int((caps < 0).sum())} of "
        f"{caps.size} heads skip the store, the others keep at most {int(caps[caps > 0].mean()) if (caps > 0).any() else 0} "
        f"tokens on average")
    return {"head_caps": torch.from_numpy(caps.astype("int32")), "store_share": torch.from_numpy(m["store_share"])}


class _Bar:
    def __init__(self, desc, unit):
        from tqdm import tqdm
        self.bar = tqdm(total=1, desc=desc, unit=unit, leave=False)

    def tick(self, done, total):
        self.bar.total = total
        self.bar.update(done - self.bar.n)

    def close(self):
        self.bar.close()


def _bar(progress: bool, desc: str, unit: str):
    return _Bar(desc, unit) if progress else None
