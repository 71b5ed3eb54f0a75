"""Per-head selection budgets past the trained context: measured on text, kept beside the codebooks.

With far positions on (kv/far_positions.py) every store token sits at one distance from the query,
and a head's softmax over the store flattens: tau = 0.9 of it kept 25-29% of a SmolLM2 store at 16K,
and HCA decoded slower than dense. Heads differ (HeteroCache: budgets by head; DuoAttention: most
heads only read sinks and recent tokens, a few retrieve). `measure` prefills calibration text past
the trained context exactly (the store's keys in full precision) and, for queries at its end, takes
per (layer, query head) the share of the softmax mass that falls on the store and the share of that
mass the top k store tokens hold. `caps_from` turns it into the selection's cap per head (the
step's head_caps: -1 the head skips the store, else at most that many tokens); `minirun calibrate
--unrotated` writes them into its codebook file, and a cache with far positions on reads them
(HCABase); without measured budgets every head gets DEFAULT_CAP (`default_caps`): at 16K tokens
with tau alone each head kept 27% of the store, with a cap of 1024 5.4% and both passkeys answered
(scripts/head_budget_rules.py; a cap of 256 lost one of two).
"""
from __future__ import annotations

import numpy as np
import torch

TOP_K = (64, 128, 256, 512, 1024, 2048, 4096)   # selection sizes whose captured mass is measured
LOST_MASS = 0.05     # caps_from: the share of a head's whole softmax mass its cap may leave out
DEFAULT_CAP = 1024   # default_caps: every head's cap in that rule
MEASURE_PAST = 4096  # minirun calibrate measures at the trained context + this many tokens


def default_caps(L: int, Hq: int, cap: int = DEFAULT_CAP) -> np.ndarray:
    """A rule without measured budgets: every head keeps at most `cap` store tokens (the
    highest-scoring) -> int64 [L, Hq]."""
    return np.full((L, Hq), cap, np.int64)


def caps_from(store_share: np.ndarray, captured: np.ndarray, top_k=TOP_K, lost: float = LOST_MASS) -> np.ndarray:
    """store_share [L, Hq] (mean share of a head's mass on the store), captured [L, Hq, len(top_k)]
    (mean share of the store's mass its top k tokens hold) -> caps int64 [L, Hq]: -1 where the
    store holds at most `lost` of the head's mass (it skips the store), else the least k whose
    left-out mass store_share * (1 - captured_k) is at most `lost` (the largest k when none is)."""
    caps = np.full(store_share.shape, top_k[-1], np.int64)
    caps[store_share <= lost] = -1
    for i in range(len(top_k) - 1, -1, -1):
        ok = (store_share > lost) & (store_share * (1.0 - captured[..., i]) <= lost)
        caps[ok] = top_k[i]
    return caps


@torch.inference_mode()
def measure(eng, ids: list[int], queries: int = 64, top_k=TOP_K) -> dict:
    """Prefill ids (exactly, in eng's HCA cache with far positions on) and observe the last prompt
    chunk's attention: `queries` of its queries, spread over it, per layer and query head ->
    {"store_share": f32 [L, Hq], "captured": f32 [L, Hq, len(top_k)], "store_tokens": n}: the mean
    share of the softmax mass on the store, and the mean share of the store's mass its top k
    tokens hold (exact scores, one far distance), over the queries."""
    cache = eng.cache.full_layers
    if not cache.positions.far:
        raise ValueError("head budgets are measured with far positions on (a context past the trained one)")
    L, Hq = cache.n_layers, eng.args.num_attention_heads
    share = np.zeros((L, Hq), np.float64)
    captured = np.zeros((L, Hq, len(top_k)), np.float64)
    attend = cache.attend
    chunk = eng.config.chunk_for(eng.device.type)
    last = (len(ids) - 1) // chunk * chunk               # the last chunk's first position

    def observed(layer, q, k, v):
        if cache.offset == last and cache.n_store:
            pick = torch.from_numpy(np.unique(np.linspace(0, q.shape[0] - 1, queries).astype(np.int64)))
            s, c = _head_masses(cache, layer, q[pick], k, v, pick, top_k)
            share[layer] += s
            captured[layer] += c
        return attend(layer, q, k, v)
    eng.reset()
    cache.attend = observed
    try:
        eng.prefill(ids)
    finally:
        del cache.attend
    n = cache.n_store
    eng.reset()
    return {"store_share": share.astype(np.float32), "captured": captured.astype(np.float32), "store_tokens": n,
            "top_k": list(top_k)}


def _head_masses(cache, layer, q, k, v, pick, top_k) -> tuple:
    """Queries q [P, Hq, hd] (rows `pick` of the chunk whose keys and values are k, v) -> (mean share of
    the mass on the store [Hq], mean share of the store's mass in its top k [Hq, len(top_k)]).
    The exact part is the chunk's causal attention over sinks + ring + itself, as the cache attends."""
    qs = q.float() * cache._q_scale(k.shape[0])
    # the whole chunk's rows (the others zero), so each query is turned at its own position and
    # the exact tier's partial is the chunk's causal one; the picked rows are read back
    full_q = torch.zeros(k.shape[0], *q.shape[1:])
    full_q[pick] = qs
    full_f = cache.positions.queries(full_q, cache.offset)
    qf = full_f[pick]
    _, me, le = cache._attend_exact_tier(layer, full_q, k, v, full_f)
    lse_exact = (me + le.log())[pick].double()                                         # [P, Hq]
    K = cache.exact_keys.view(layer, cache.n_store).float()                            # [Hkv, n, hd]
    Kq = K[torch.from_numpy(cache.q_to_kv).long()]                                    # [Hq, n, hd]
    z = torch.einsum("phd,hnd->phn", qf, Kq).double()                                  # [P, Hq, n]
    lse_store = torch.logsumexp(z, -1)
    share = torch.sigmoid(lse_store - lse_exact).mean(0).numpy()
    w = torch.exp(z - lse_store[..., None])                                            # store softmax
    top = torch.topk(w, min(top_k[-1], w.shape[-1]), dim=-1).values.cumsum(-1)        # [P, Hq, kmax]
    cap = torch.stack([top[..., min(kk, top.shape[-1]) - 1] for kk in top_k], -1).mean(0).numpy()
    return share, cap


def head_caps_for(config, far: bool, codebook_file, shape: tuple) -> np.ndarray | None:
    """The cache's per-head caps int64 [L, Hq] (-1: the head skips the store), or None (max_select
    alone): with far positions at one distance on (far: the position scheme's `unrotated`) and
    config.head_budgets "auto", the calibrated codebook file's where it holds them, else
    default_caps (every head DEFAULT_CAP); max_select, where set, bounds every head's cap."""
    if config.head_budgets == "off" or not far:
        return None
    caps = load_caps(codebook_file, shape) if codebook_file is not None else None
    if caps is None:     # (no measurement: one cap for every head)
        caps = default_caps(*shape)
    if config.max_select:
        caps = np.where(caps < 0, caps, np.minimum(np.where(caps == 0, config.max_select, caps), config.max_select))
    return caps


def load_caps(path, shape: tuple) -> np.ndarray | None:
    """The "head_caps" tensor [L, Hq] of a codebook file, or None (no file, none in it, another shape)."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), "pt") as f:
            if "head_caps" not in f.keys():
                return None
            caps = f.get_tensor("head_caps").numpy().astype(np.int64)
    except (OSError, ValueError, Exception):   # (safetensors' own error type varies by version)
        return None
    return caps if caps.shape == tuple(shape) else None
