"""Every HCA decode path on every backend against dense attention, at the cache's interface.

A cache (made by kv.make_cache, as an engine makes it) is filled with random keys and values, then
one decode step per layer is compared with exact attention over every key, the same q, k, v:
- tau = 1 with exact scores (an exact-key store, or codebooks with --rescore's exact weights):
  equal to dense attention within 1e-4;
- tau < 1 with exact keys: the selection is a top set by score whose softmax mass (the true
  mass: exact keys) is at least tau times exp(-1/32) (the CPU's level buckets) or tau minus 0.005
  (the GPU's histogram of 4096 bins over 64 logits: one bin's mass at most).
Paths: on the CPU, the one-call steps (exact keys; codebooks scored from packed tables; nibble pairs
by fast scan), with and without a cap, a ring full and short after a truncate, one decode token
and a chunk of queries in hca mode (each its own call over the exact tier with the chunk's keys
appended); the GPU cache class with the host's value sum and with the GPU's (on the kernel
emulator here, on a GPU where there is one).
"""
from __future__ import annotations

import contextlib
import shutil

import numpy as np
import pytest
import torch

import kernels_cuda
from minirun.config import EngineConfig, ModelArgs
from minirun.kv import make_cache

HAVE_GPU = kernels_cuda.available()
HAVE_GXX = shutil.which("g++") is not None
ARGS = ModelArgs.from_dict(dict(hidden_size=192, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                                num_key_value_heads=2, vocab_size=300, model_type="llama"))   # head dim 32
L, HQ, HKV, HD = 2, 6, 2, 32
N_PROMPT = 300
CPU_LEVEL_TOL = float(np.exp(-1 / 32))      # kernels_cpu.level_select: mass >= tau * exp(-w)
GPU_HIST_TOL = 0.005

STORES = {"exact": dict(key_store="exact"), "codebook": dict(groups=8, centroids=64),
          "pairs": dict(groups=16, centroids=16)}


def backends():
    out = [pytest.param("cpu", id="cpu")]
    if HAVE_GPU:
        out += [pytest.param("gpu-host", id="gpu-host"), pytest.param("gpu-gpu", id="gpu-gpu")]
    elif HAVE_GXX:
        out += [pytest.param("emu-host", id="emu-host"), pytest.param("emu-gpu", id="emu-gpu")]
    return out


def build(backend, store, tau, **kw):
    """(cache, launch context, device) for a backend: "cpu", "emu-*" (the GPU class on the CPU
    emulator) or "gpu-*"; the suffix is the value sum. Float values (tau = 1 equals dense only with
    them; "auto" would be q8 codes on a CPU device)."""
    cfg = dict(kv="hca", tau=tau, window=16, sinks=4, fit_min_tokens=64, prefill_chunk=64, kv_values="float",
               **STORES[store], **kw)
    if backend == "cpu":
        config = EngineConfig(device="cpu", **cfg)
        return make_cache(ARGS, config, torch.device("cpu"), torch.float32, 512), contextlib.nullcontext, "cpu"
    config = EngineConfig(value_sum=backend.split("-")[1], **cfg)
    if backend.startswith("gpu"):
        dev = torch.device("cuda")
        return make_cache(ARGS, config, dev, torch.float32, 512), contextlib.nullcontext, dev
    import cuda_emu
    from minirun.kv.hca_cuda import HCACacheCUDA
    with cuda_emu.emulated():
        cache = HCACacheCUDA(ARGS, config, torch.device("cpu"), torch.float32, 512)
    return cache, cuda_emu.emulated, "cpu"


def qkv(g, T, device):
    """Queries, keys and values [T, heads, hd] with a spread of score scales across heads."""
    scale = torch.tensor([0.3, 1.0, 3.0, 0.5, 2.0, 6.0])[None, :, None]
    q = torch.randn(T, HQ, HD, generator=g) * scale
    k, v = torch.randn(T, HKV, HD, generator=g), torch.randn(T, HKV, HD, generator=g)
    return q.to(device), k.to(device), v.to(device)


def run(backend, store, tau, truncate=0, seed=0, chunk=1, **kw):
    """Fill a cache with N_PROMPT tokens (chunks of 64, anchor-free exact prefill), optionally drop
    the last `truncate` (the ring short), then one decode step (chunk > 1: that many queries in one
    call). -> (outputs [L, Hq, hd] ([L, chunk, Hq, hd]), every key and value [L, Hkv, n + chunk, hd],
    the step's query [Hq, hd] ([chunk, Hq, hd]), the selection fractions or None, the cache)."""
    cache, ctx, dev = build(backend, store, tau, **kw)
    g = torch.Generator().manual_seed(seed)
    Ks, Vs = [[] for _ in range(L)], [[] for _ in range(L)]
    with ctx(), torch.inference_mode():
        cache.begin_prefill("exact")
        for c0 in range(0, N_PROMPT, 64):
            T = min(64, N_PROMPT - c0)
            for layer in range(L):
                q, k, v = qkv(g, T, dev)
                cache.attend(layer, q, k, v)
                Ks[layer].append(k.cpu())
                Vs[layer].append(v.cpu())
            cache.advance(T)
        cache.end_prefill()
        n = N_PROMPT - truncate
        assert cache.truncate(n)
        cache.record_selection = []
        q, k, v = qkv(g, chunk, dev)
        outs = [cache.attend(layer, q, k, v).float().cpu().clone() for layer in range(L)]   # (GPU: a reused buffer)
        cache.advance(chunk)
    K = torch.stack([torch.cat(Ks[layer])[:n] for layer in range(L)]).transpose(1, 2)   # [L, Hkv, n, hd]
    V = torch.stack([torch.cat(Vs[layer])[:n] for layer in range(L)]).transpose(1, 2)
    K = torch.cat([K, k.cpu().transpose(0, 1)[None].expand(L, -1, -1, -1)], 2)   # (every layer: the same k)
    V = torch.cat([V, v.cpu().transpose(0, 1)[None].expand(L, -1, -1, -1)], 2)
    sel = cache.record_selection
    if chunk == 1:
        return torch.stack(outs)[:, 0], K, V, q[0].float().cpu(), sel, cache
    return torch.stack(outs), K, V, q.float().cpu(), sel, cache


def dense(K, V, q):
    """Exact attention of q [Hq, hd] over K, V [Hkv, n, hd] (float64) -> o [Hq, hd], scores [Hq, n]."""
    g = HQ // HKV
    s = torch.stack([K[h // g].double() @ q[h].double() for h in range(HQ)]) / HD ** 0.5
    p = torch.softmax(s, -1)
    return torch.stack([p[h] @ V[h // g].double() for h in range(HQ)]), s


EXACT_PATHS = [("exact", {}), ("exact", {"max_select": 10 ** 6}), ("codebook", {"rescore": True}),
               ("codebook", {"rescore": True, "max_select": 10 ** 6}), ("pairs", {"rescore": True})]


EXACT_IDS = ["exact", "exact-capped", "codebook-rescore", "codebook-rescore-capped", "pairs-rescore"]
# (the GPU cache has one step for every setting: its rescore with a cap is codebook-rescore's step)
EXACT_CASES = [pytest.param(b, store, kw, id=f"{b}-{name}") for b in (p.values[0] for p in backends())
               for (store, kw), name in zip(EXACT_PATHS, EXACT_IDS)
               if b == "cpu" or store == "exact" or not kw.get("max_select")]


@pytest.mark.parametrize("backend,store,kw", EXACT_CASES)
@pytest.mark.parametrize("truncate", [0, 5], ids=["ring-full", "ring-short"])
def test_tau1_exact_scores_equal_dense(backend, store, kw, truncate):
    o, K, V, q, _, cache = run(backend, store, 1.0, truncate, **kw)
    assert cache.n_store > 200
    for layer in range(L):
        want, _ = dense(K[layer], V[layer], q)
        assert (o[layer].double() - want).abs().max().item() <= 1e-4, layer


@pytest.mark.parametrize("backend,store,kw", [c for c in EXACT_CASES if c.values[0] == "cpu"] +
                         [c for c in EXACT_CASES if c.values[0] != "cpu" and c.values[1] == "exact"][:1])
def test_tau1_chunk_equals_dense(backend, store, kw):
    """Five queries in one call in hca mode (a question after a document): each equals dense
    attention over the store, the ring and the chunk up to itself."""
    o, K, V, q, _, cache = run(backend, store, 1.0, chunk=5, **kw)
    n = K.shape[2] - 5
    for layer in range(L):
        for i in range(5):
            want, _ = dense(K[layer, :, :n + i + 1], V[layer, :, :n + i + 1], q[i])
            assert (o[layer, i].double() - want).abs().max().item() <= 1e-4, (layer, i)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("tau", [0.5, 0.9, 0.99])
@pytest.mark.parametrize("kw", [{}, {"max_select": 10 ** 6}], ids=["one-call", "capped"])
def test_tau_below_one_keeps_the_stated_mass(backend, tau, kw):
    """The selection holds at least tau (minus the binning's stated tolerance) of the true softmax
    mass over the store: a top set by score, counts[h] tokens, whose mass is summed here."""
    o, K, V, q, sel, cache = run(backend, "exact", tau, seed=3, **kw)
    n_store = cache.n_store - 1                      # (the step's own token went to the ring after it)
    S = cache.S
    assert len(sel) == L
    for layer in range(L):
        _, s = dense(K[layer], V[layer], q)
        store = s[:, S:S + n_store]                   # the store: after the sinks, before the ring
        p = torch.softmax(store, -1)
        counts = np.rint(np.asarray(sel[layer]) * n_store).astype(int)
        for h in range(HQ):
            kept = p[h].sort(descending=True).values[:counts[h]].sum().item()
            low = tau * CPU_LEVEL_TOL if backend == "cpu" else tau - GPU_HIST_TOL
            assert kept >= low - 1e-6, (layer, h, kept, counts[h])
        assert not np.all(counts == n_store)          # (something was left out: the cut did cut)
