"""HCACacheCUDA (minirun/kv/hca_cuda.py) against the CPU HCA cache and dense attention.

Backends: "gpu" (a CUDA device + cupy: Engine.load(device="cuda") picks the class by itself) and
"emu" (no GPU: the same class on a CPU device, kernels_cuda launches routed to the CPU kernel
emulator tests/support/cuda_emu.py, no streams/events/pinning; needs g++). The emu runs exercise all the
host-side logic (selection copy-back, widths, scatter, value sum, merge, eviction, prefill modes),
not the stream/event ordering.

Tolerances (float32 model):
  tau = 1, exact keys          vs dense            max |logit diff| <= 1e-4 (same as the CPU class)
  tau = 1, same codebooks      vs CPU HCA          <= 1e-3 (same selection = all tokens; float32
                               rounding of LUT / scores in a different order; a rare encode
                               near-tie can flip one code: the bound allows one such token)
  tau = 0.9, same codebooks    vs CPU HCA          argmax agreement >= 0.95 and max diff <= 0.1: the
                               GPU selection is the CPU's minimal set plus at most the rest of its
                               1/64-wide histogram bin (kernels_cuda README), so sets may differ
"""
import contextlib
import dataclasses
import shutil

import numpy as np
import pytest
import torch

import kernels_cuda
from minirun import Engine
from minirun.planner import plan
from minirun.kv.codebooks import Codebooks, codebook_filename
from minirun.kv.hca import HCACache
from minirun.kv.hca_cuda import HCACacheCUDA
from shared import decode_launches

HAVE_GPU = kernels_cuda.available()
HAVE_GXX = shutil.which("g++") is not None
NO_GPU_REASON = "no CUDA device / cupy: HCACacheCUDA GPU tests skipped"
if not HAVE_GPU:
    print(NO_GPU_REASON)

BACKENDS = [pytest.param("gpu", marks=pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)),
            pytest.param("emu", marks=pytest.mark.skipif(HAVE_GPU or not HAVE_GXX,
                                                         reason="GPU present (gpu runs instead) or no g++"))]


def random_ids(n, seed=0):
    return torch.randint(4, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(params=BACKENDS)
def gpu_engine(request):
    """gpu_engine(model_dir, **kw) -> (Engine with an HCACacheCUDA cache, launch context)."""
    kind = request.param
    if kind == "emu":
        import cuda_emu

        emulated = cuda_emu.emulated_hca_cuda   # (only engines loaded inside get the GPU class: not the CPU references)

        def load(d, **kw):
            with emulated():
                return Engine.load(d, device="cpu", **kw)
        return load, emulated
    return (lambda d, **kw: Engine.load(d, device="cuda", **kw)), contextlib.nullcontext


def cpu_and_gpu_steps(gpu_engine, d, ids, kw, tokens=(3, 7, 12)):
    """Prefill ids, then decode `tokens` one step each, on the CPU cache and on the GPU cache (its
    selection sizes recorded) -> (CPU logits, GPU logits [len(tokens), V], the GPU engine)."""
    load, ctx = gpu_engine
    cpu = Engine.load(d, device="cpu", **kw)
    cpu.prefill(ids)
    want = torch.stack([cpu.step(t).reshape(-1) for t in tokens])
    eng = load(d, **kw)
    with ctx():
        eng.prefill(ids)
        eng.cache.record_selection = []
        got = torch.stack([eng.step(t).reshape(-1).cpu() for t in tokens])
    return want, got, eng


def with_codebooks(tiny_model_dir, tmp_path, g, c, ids):
    """A copy of the tiny model with a codebook file fitted (on the CPU) from `ids`' keys."""
    src = tiny_model_dir("gqa-untied")
    d = tmp_path / "model"
    shutil.copytree(src, d)
    eng = Engine.load(d, device="cpu", ctx=1024, kv="hca", groups=g, centroids=c, window=16, sinks=4,
                      fit_min_tokens=64)
    eng.logits(ids)
    cb = eng.last_logits_cache.codebooks
    Codebooks(cb.centroids.cpu()).save(d / codebook_filename(g, c))
    return d


@pytest.mark.parametrize("chunk,width", [(1, 1024), (1, 4), (7, 1024)])
def test_tau1_exact_keys_equals_dense(tiny_model_dir, gpu_engine, monkeypatch, chunk, width):
    """width 4: the copy-back's first guess is always too narrow (tau = 1 selects all): the
    second, wider copy runs on every step."""
    monkeypatch.setattr("minirun.kv.hca_cuda.INITIAL_WIDTH", width)
    load, ctx = gpu_engine
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(100)
    dense = Engine.load(d, device="cpu", ctx=256).logits(ids)
    eng = load(d, ctx=256, kv="hca", key_store="exact", tau=1.0, window=16, sinks=4, prefill_chunk=chunk,
               value_sum="host")
    with ctx():
        out = eng.logits(ids)   # chunk 1: every position through the decode step; 7: several queries
    assert isinstance(eng.last_logits_cache, HCACacheCUDA)
    assert (out - dense).abs().max().item() <= 1e-4
    assert (eng.last_logits_cache.second_copies > 0) == (width < 100)


def test_hca_prefill_tau_below_one_close_to_cpu(tiny_model_dir, gpu_engine):
    """hca-mode prefill (one selection round trip per query, no decode_prep: the histogram zeroed
    per query) at tau 0.9 on exact keys: the GPU's selection is the CPU's plus at most the rest of
    a 1/64-wide bin (kernels_cuda README), so logits stay close. (Emulator, random weights: max
    1.0e-4, mean 5.6e-6; with the histogram left unzeroed between queries 8.8e-4 and 8.7e-5.)"""
    load, ctx = gpu_engine
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(120, seed=7)
    kw = dict(ctx=256, kv="hca", key_store="exact", tau=0.9, window=16, sinks=4, prefill_chunk=32,
              prefill_mode="hca")
    ref = Engine.load(d, device="cpu", **kw).logits(ids)
    eng = load(d, **kw)
    with ctx():
        got = eng.logits(ids).cpu()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.95
    assert (got - ref).abs().max().item() <= 4e-4 and (got - ref).abs().mean().item() <= 3e-5


@pytest.mark.parametrize("mode", ["exact", "anchor", "hca"])
def test_prefill_modes_then_decode_match_cpu(tiny_model_dir, gpu_engine, mode):
    """Exact/anchor/hca prompt then decode steps (ring wrap-around, eviction every step)."""
    load, ctx = gpu_engine
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(90, seed=1)
    kw = dict(ctx=256, kv="hca", key_store="exact", tau=1.0, window=16, sinks=4, prefill_chunk=32,
              prefill_mode=mode, anchor_tokens=40)
    cpu = Engine.load(d, device="cpu", **kw)
    a = cpu.generate(ids, max_new_tokens=10, ignore_eos=True)
    eng = load(d, **kw)
    with ctx():
        b = eng.generate(ids, max_new_tokens=10, ignore_eos=True)
        lg = eng.prefill(ids + b.tokens)[0].cpu()
    assert a.tokens == b.tokens
    assert (lg - cpu.prefill(ids + a.tokens)[0]).abs().max().item() <= 1e-4
    s = eng.kv_stats()
    assert s["prefill_values_bytes"] == 0                       # freed at end_prefill
    assert s["host_values_bytes"] == eng.cache.values.data.numel() * eng.cache.values.data.element_size()


def test_decode_step_after_a_truncate_masks_dead_slots(tiny_model_dir, gpu_engine):
    """A prompt sharing a prefix with the cache truncates it: the ring holds fewer than W tokens
    and stale slots until it refills. The decode step still runs (attend_exact masks the dead
    slots; it used to fall back to the general torch path), with the CPU cache's logits."""
    load, ctx = gpu_engine
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(90, seed=1)
    kw = dict(ctx=256, kv="hca", key_store="exact", tau=1.0, window=16, sinks=4, prefill_chunk=32)
    outs = []
    for make in (lambda: Engine.load(d, device="cpu", **kw), lambda: load(d, **kw)):
        eng = make()
        with ctx():
            gen = eng.generate(ids, max_new_tokens=10, ignore_eos=True).tokens
            c = eng.cache
            calls = []
            if isinstance(c, HCACacheCUDA):
                real = c._attend_hca
                c._attend_hca = lambda *a: calls.append(1) or real(*a)
            first = eng.prefill(ids + gen[:7])[0]
            assert c.offset < c.S + c.W + c.n_store and (c.slot_pos < 0).any()     # the ring is short
            outs.append(torch.cat([first.reshape(1, -1)] + [eng.step(t).reshape(1, -1) for t in gen[7:]]).cpu())
        if isinstance(c, HCACacheCUDA):
            assert len(calls) == 4 * 2    # the re-prefilled last token + 3 steps, 2 layers: all one step each
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-5   # (unmasked stale slots: 3e-4)


@pytest.mark.parametrize("key_store,tau,far", [("exact", 1.0, "on"), ("codebook", 1.0, "on"), ("exact", 1.0, "grouped"),
                                              ("codebook", 1.0, "grouped")])
def test_far_positions_match_cpu(tiny_model_dir, gpu_engine, key_store, tau, far):
    """Far positions (sinks and store unrotated, read at distance W; minirun/kv/far_positions.py):
    the decode step splits sinks (far query) from the ring (true one); prompt, decode steps and a
    truncate, against the CPU cache. Codebooks fitted from the prompt's unrotated keys (the same
    fit on both: same keys, same seed)."""
    load, ctx = gpu_engine
    d = tiny_model_dir("gqa-untied", **({"max_position_embeddings": 64} if far == "grouped" else {}))   # (G = 6)
    ids = random_ids(90, seed=6)
    kw = dict(ctx=256, kv="hca", key_store=key_store, tau=tau, window=16, sinks=4, prefill_chunk=32,
              far_positions=far, fit_min_tokens=32, centroids=16)
    cpu = Engine.load(d, device="cpu", **kw)
    a = cpu.generate(ids, max_new_tokens=10, ignore_eos=True)
    eng = load(d, **kw)
    with ctx():
        b = eng.generate(ids, max_new_tokens=10, ignore_eos=True)
        assert eng.cache.far and eng.cache.n_store > 0
        lg = eng.prefill(ids + b.tokens[:6])[0].cpu()                 # truncates: the ring is short
        steps = torch.stack([eng.step(t).reshape(-1).cpu() for t in b.tokens[6:]])
    assert a.tokens == b.tokens
    lc = cpu.prefill(ids + a.tokens[:6])[0]
    sc = torch.stack([cpu.step(t).reshape(-1) for t in a.tokens[6:]])
    tol = 1e-4 if key_store == "exact" else 1e-3
    assert (lg - lc).abs().max().item() <= tol and (steps - sc).abs().max().item() <= tol


def test_length_scale_matches_cpu(tiny_model_dir, gpu_engine):
    """--length-scale on past the trained context (64 here): the GPU cache scales its queries as
    the CPU cache does (decode_prep's scale and the prompt path): exact keys, tau 1, far positions."""
    d = tiny_model_dir("gqa-untied", max_position_embeddings=64)
    ids = random_ids(100, seed=13)
    kw = dict(ctx=256, kv="hca", key_store="exact", tau=1.0, window=16, sinks=4, prefill_chunk=32,
              far_positions="on", length_scale="on")
    want, got, _ = cpu_and_gpu_steps(gpu_engine, d, ids, kw)
    off = Engine.load(d, device="cpu", **{**kw, "length_scale": "off"})
    off.prefill(ids)
    plain = torch.stack([off.step(t).reshape(-1) for t in (3, 7, 12)])
    assert (got - want).abs().max().item() <= 1e-4                   # (seen: 6e-8)
    assert (want - plain).abs().max().item() > 5e-5                  # the factor matters (seen: 2.9e-4)


@pytest.mark.parametrize("tau", [1.0, 0.9])
def test_codebooks_match_cpu_backend(tiny_model_dir, gpu_engine, tmp_path, tau):
    load, ctx = gpu_engine
    ids = random_ids(110, seed=2)
    d = with_codebooks(tiny_model_dir, tmp_path, 8, 32, ids)
    kw = dict(ctx=256, kv="hca", groups=8, centroids=32, tau=tau, window=16, sinks=4, prefill_chunk=1)
    cpu = Engine.load(d, device="cpu", **kw).logits(ids)
    eng = load(d, **kw)
    with ctx():
        out = eng.logits(ids)
    cache = eng.last_logits_cache
    assert cache.n_encoded == cache.n_store > 0 and cache.codebooks.source.startswith("calibrated")
    diff = (out - cpu).abs().max().item()
    if tau == 1.0:
        assert diff <= 1e-3
    else:
        assert (out.argmax(-1) == cpu.argmax(-1)).float().mean().item() >= 0.95
        assert diff <= 0.1


def test_prompt_fitted_codebooks_close_to_dense(tiny_model_dir, gpu_engine):
    """No codebook file: fit on the device at fit_min_tokens, then encode on the device."""
    load, ctx = gpu_engine
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(120, seed=3)
    dense = Engine.load(d, device="cpu", ctx=256).logits(ids)
    eng = load(d, ctx=256, kv="hca", groups=8, centroids=32, window=16, sinks=4, fit_min_tokens=48,
               prefill_chunk=4)
    with ctx():
        out = eng.logits(ids)
    assert eng.last_logits_cache.codebooks is not None
    assert (out.argmax(-1) == dense.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("key_store", ["exact", "codebook"])
def test_max_select_matches_cpu(tiny_model_dir, gpu_engine, key_store):
    """The selection cap at tau = 1: at most 6 store tokens per head, whole score buckets from the
    top on both backends (the CPU's levels, the GPU's histogram bins: different widths, so the
    sets may differ at the cap's edge). Logits stay close; argmax agrees."""
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(140, seed=10)
    kw = dict(ctx=256, kv="hca", key_store=key_store, tau=1.0, max_select=6, window=16, sinks=4,
              prefill_chunk=32, fit_min_tokens=48, centroids=32, groups=8)
    if key_store == "exact":
        kw.pop("groups"), kw.pop("centroids")
    want, got, eng = cpu_and_gpu_steps(gpu_engine, d, ids, kw)
    n = eng.cache.n_store
    assert n > 100 and all(np.all(f <= 6 / (n - 3) + 1e-9) for f in eng.cache.record_selection)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    if key_store == "exact":
        assert (got - want).abs().max().item() <= 0.005


def test_max_select_below_tau_one_capped_in_the_histogram(tiny_model_dir, gpu_engine):
    """tau 0.9 with a cap: the GPU caps inside its selection histogram (whole bins from the top,
    kernels_cuda scores.cu zcut), the CPU by a sort: both keep top tokens, the GPU at most the cap
    and possibly fewer (the bin that would cross it is left out), so logits stay close."""
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(140, seed=11)
    kw = dict(ctx=256, kv="hca", key_store="exact", tau=0.9, max_select=8, window=16, sinks=4, prefill_chunk=32)
    want, got, eng = cpu_and_gpu_steps(gpu_engine, d, ids, kw)
    n = eng.cache.n_store                                      # (the steps' store sizes: n - 3 .. n - 1)
    sel = np.concatenate(eng.cache.record_selection)
    assert n > 100 and sel.max() <= 8 / (n - 3) + 1e-9 and sel.min() >= 1 / n - 1e-9
    sel = sel * n
    print(f"GPU selected per head: mean {sel.mean():.2f} of at most 8; max |logit diff| "
          f"{(got - want).abs().max().item():.4f}")
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert (got - want).abs().max().item() <= 0.005        # (seen: 0.0006, 7.75 tokens per head)


def test_key_store_allocated_once_at_capacity(tiny_model_dir, gpu_engine):
    """The device key store is allocated at the ctx's capacity by its first token (no doubling: a
    4M prompt held old + new copies and peaked at 2.4x its indices on an H100), so kv_stats'
    device key bytes equal the planner's key store figure whatever the prompt's length."""
    from minirun.planner import plan
    load, ctx = gpu_engine
    d = tiny_model_dir("gqa-untied")
    eng = load(d, ctx=8192, kv="hca", groups=8, centroids=32, window=16, sinks=4, fit_min_tokens=48)
    with ctx():   # (8192: past store.MIN_GROW, the doubling store's first allocation)
        eng.generate(random_ids(100, seed=4), max_new_tokens=2, ignore_eos=True)
        first = eng.cache.indices.data
        eng.generate(random_ids(300, seed=5), max_new_tokens=2, ignore_eos=True)
    assert eng.cache.n_store > 250 and eng.cache.indices.data.data_ptr() == first.data_ptr()
    key_store = plan(eng.args, eng.config).tiers["key store"][0]
    assert eng.cache.stats()["device_keys_bytes"] == key_store == eng.cache.indices.nbytes
    # the exact tier as allocated, its spare row (the decode step's token) included, is the GPU plan's
    ring = plan(eng.args, dataclasses.replace(eng.config, device="cuda")).tiers["sinks+ring K+V"][0]
    ekx = eng.cache._ekx
    assert eng.cache.stats()["device_ring_sinks_bytes"] == ring == 2 * ekx.numel() * ekx.element_size()
    assert ekx.shape[2] == 4 + 16 + 1


@pytest.mark.parametrize("kw", [dict(kv_budget=0.125, centroids=32, rescore=True), dict(kv_budget=0.5),
                                dict(groups=4, centroids=16, kv_values="q4"), dict(kv_budget=0.5, kv_values="q8")],
                         ids=["codebooks-rescore", "exact-keys", "pairs-q4-values", "exact-keys-q8-values"])
def test_caches_allocate_the_declared_tiers(tiny_model_dir, gpu_engine, kw):
    """Both backends take every buffer's bound, width and dtype from the one declaration that `minirun
    plan` counts (kv/hca_layout.hca_tiers, prefill_buffers): the store's buffers, the scratch, the
    exact tier (the GPU's spare row included) and the rewind points' copies."""
    load, ctx = gpu_engine
    d = tiny_model_dir("gqa-untied", **({"hidden_size": 128} if "kv_values" in kw else {}))   # (head dim 32)
    kw = dict(ctx=300, kv="hca", window=16, sinks=4, **kw)
    for eng, run in ((Engine.load(d, device="cpu", **kw), contextlib.nullcontext), (load(d, **kw), ctx)):
        c = eng.cache
        with run():   # (a second prompt that leaves the first one's tokens: both rewind points copied)
            ids = random_ids(200, seed=2)
            eng.prefill(ids)
            eng.prefill(ids[:190] + random_ids(20, seed=3))
        t, pre = c.tiers, c.prefill_specs
        pairs = [(c.values, t["value pool"].buffers["values"])]
        pairs += [(c.host_keys, t["host keys"].buffers["host_keys"])] if "host keys" in t else []
        pairs += [(c.indices, t["key store"].buffers["indices"])] if c.indices is not None else []
        pairs += [(c.exact_keys, t["key store"].buffers.get("exact_keys") or pre["exact_keys"])]
        pairs += list(zip(c.scratch, t["scratch"].buffers.values(), strict=True))
        pairs += [(c.prefill_values, pre["prefill_values"])] if c.backend == "cuda" else []
        for buf, spec in pairs:
            assert (buf.lead, buf.max_cap, buf.width, buf.dtype) == (spec.lead, spec.rows, spec.width, spec.dtype)
        ring = t["sinks+ring K+V"].buffers["ek"]
        ek = c._ekx if c.backend == "cuda" else c.ek
        assert (tuple(ek.shape), ek.dtype) == ((*ring.lead, ring.rows, ring.width), ring.dtype)
        assert c.rewind_points.nbytes == t["sinks+ring copies"].nbytes
        for name, copy in c.rewind_points.copies.items():
            spec = t["sinks+ring copies"].buffers[f"{name}.ek"]
            assert (tuple(copy.ek.shape), copy.ek.dtype) == ((*spec.lead, spec.rows, spec.width), spec.dtype)
        assert dict(plan(eng.args, dataclasses.replace(eng.config, device=c.backend)).tiers)["value pool"][0] == \
            t["value pool"].nbytes


GATHER_CASES = {
    "exact-tau1": dict(key_store="exact", tau=1.0),
    "codebook-tau0.9": dict(groups=8, centroids=32, tau=0.9, fit_min_tokens=48),
    "far-positions": dict(key_store="exact", tau=1.0, far_positions="on"),
    "cap-tau1": dict(key_store="exact", tau=1.0, max_select=6),
    "cap-histogram": dict(key_store="exact", tau=0.9, max_select=8),
}


@pytest.mark.parametrize("case", list(GATHER_CASES))
def test_value_sum_on_gpu_matches_host_sum(tiny_model_dir, gpu_engine, monkeypatch, case):
    """value_sum "gpu" (kernels_cuda.decode's gather reads the mapped host pool, no copy-back; a
    row read once per kv group, at tau 1 too) against the host's Numba sum in the same
    cache class: the same selection on the device, so the same tokens and logits up to float32
    summation order. Generate 8 tokens (ring wrap-around, eviction every step), a prefill that
    truncates (the ring short), 3 steps."""
    import kernels_cuda.decode as kd
    load, ctx = gpu_engine
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(120, seed=21)
    # graphs off: a replayed token does not call DecodeStep.gather (its kernels are in the graph)
    kw = dict(ctx=256, kv="hca", window=16, sinks=4, prefill_chunk=32, cuda_graphs=False, **GATHER_CASES[case])
    gathers = []
    real = kd.DecodeStep.gather
    monkeypatch.setattr(kd.DecodeStep, "gather",
                        lambda self, *a, **k: gathers.append(a[3]) or real(self, *a, **k))   # (its n)
    outs = {}
    for vs in ("host", "gpu"):
        gathers.clear()
        eng = load(d, value_sum=vs, **kw)
        with ctx():
            gen = eng.generate(ids, max_new_tokens=8, ignore_eos=True).tokens
            assert eng.cache.value_sum == vs == eng.kv_stats()["value_sum"] and eng.cache.n_store > 80
            lg = [eng.prefill(ids + gen[:5])[0].reshape(1, -1)]
            lg += [eng.step(t).reshape(1, -1) for t in gen[5:]]
        outs[vs] = (gen, torch.cat(lg).cpu(), eng.cache.second_copies, list(gathers))
    L = 2   # the tiny model's layers: 7 decode steps of generate, 3 steps, and (maybe) the prefill's last token
    assert outs["host"][3] == [] and outs["gpu"][2] == 0
    assert len(outs["gpu"][3]) >= 10 * L and min(outs["gpu"][3]) > 80    # every step's store through the gather
    assert outs["host"][0] == outs["gpu"][0]
    diff = (outs["host"][1] - outs["gpu"][1]).abs().max().item()
    print(f"{case}: max |logit diff| gpu vs host value sum {diff:.2e}")
    assert diff <= 1e-4


def test_value_sum_choice(capsys):
    """auto is the GPU's sum unless --rescore asks for the host's or the query heads per kv head
    are no group the gather takes; gpu asked for there says why it sums on the host; an unknown
    choice is refused where the config is made."""
    from minirun.config import EngineConfig
    from minirun.errors import MiniRunError
    from minirun.kv.hca_cuda import value_sum_choice
    cpu = torch.device("cpu")
    assert value_sum_choice("auto", cpu, False, 3) == "gpu" and value_sum_choice("host", cpu, False, 3) == "host"
    assert value_sum_choice("auto", cpu, True, 3) == "host" and capsys.readouterr().err == ""
    assert value_sum_choice("gpu", cpu, True, 3) == "host" and "rescore" in capsys.readouterr().err
    assert value_sum_choice("gpu", cpu, False, 0) == "host" and "group" in capsys.readouterr().err
    with pytest.raises(MiniRunError, match="use auto, gpu or host"):
        EngineConfig(value_sum="tpu")


@pytest.mark.skipif(HAVE_GPU or not HAVE_GXX, reason="emulator launch log (CPU only)")
@pytest.mark.parametrize("value_sum", ["host", "gpu"])
def test_decode_launch_count(tiny_model_dir, gpu_engine, tmp_path, monkeypatch, value_sum):
    """kernels_cuda launches of one decode step per layer == decode_launches; also
    prints the aten ops of the step (torch-side launch upper bound, in kernels_cuda/README.md)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    load, emulated = gpu_engine
    ids = random_ids(60, seed=4)
    d = with_codebooks(tiny_model_dir, tmp_path, 8, 32, ids)
    eng = load(d, ctx=128, kv="hca", groups=8, centroids=32, tau=0.9, window=16, sinks=4, prefill_mode="exact",
               value_sum=value_sum)
    aten = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            aten.append(str(func))
            return func(*args, **(kwargs or {}))

    with emulated() as be:
        eng.prefill(ids)
        cache = eng.cache
        assert cache.n_store > 0 and cache.n_encoded == cache.n_store
        q = torch.randn(1, cache.Hq, cache.hd)
        k, v = torch.randn(1, cache.Hkv, cache.hd), torch.randn(1, cache.Hkv, cache.hd)
        with torch.inference_mode():
            cache.attend(0, q, k, v)            # the first step allocates the step's buffers
        be.launches.clear()
        with torch.inference_mode(), Count():
            cache.attend(0, q, k, v)
    names = [x[0] for x in be.launches]
    want = decode_launches(0.9, dtype=torch.float32, value_sum=value_sum)
    assert len(names) == want["kernels_cuda"], names
    assert any(x.startswith("pack_selection" if value_sum == "host" else "gather_value_sum") for x in names), names
    assert names[0].startswith("decode_prep") and names[-1].startswith("lse_merge_staged"), names
    # no device kernel: views, same-dtype casts, the emulator's own 0xff fills of wrapper outputs,
    # numpy bridges (host side)
    free = {"view", "slice", "select", "unsqueeze", "t", "transpose", "alias", "detach", "_unsafe_view",
            "expand", "as_strided", "to", "empty", "empty_like", "fill_", "resolve_conj", "resolve_neg",
            "lift_fresh"}
    compute = [a for a in aten if a.split(".")[1] not in free]
    # the D2H pack and the H2D stage are the step's only device-side torch ops (copies); none with
    # the GPU's value sum
    assert [a for a in compute if a != "aten.copy_.default"] == [] and len(compute) == want["memcpy"], compute
    print(f"\none decode step, one layer: {len(names)} kernels_cuda launches {names}; "
          f"{len(compute)} non-view aten ops {compute}")


def test_make_cache_picks_backend(tiny_model_dir):
    d = tiny_model_dir("gqa-untied")
    eng = Engine.load(d, device="cpu", ctx=64, kv="hca")
    assert type(eng.cache) is HCACache
    if HAVE_GPU:
        assert type(Engine.load(d, device="cuda", ctx=64, kv="hca").cache) is HCACacheCUDA
