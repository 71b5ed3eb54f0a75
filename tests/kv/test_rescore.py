"""--rescore (EngineConfig.rescore): the store's keys kept on the host beside the values, the
selected tokens weighted by exact scores (kernels_cpu.rescore), the codebooks only selecting.

What must hold: the kernel equals its NumPy reference; with tau = 1 (every store token selected)
a codebook cache that rescores IS dense attention (1e-4, float32), on every CPU path (the packed
selection, the fast scan of nibble pairs, keys not yet encoded) and on the GPU class (kernels on
the emulator without a GPU); below tau = 1 it differs from the codebook weights; the planner,
kv_stats, prompt-cache files and the command line all know the host-keys tier."""
import contextlib
import json

import numpy as np
import pytest
import torch

import kernels_cpu as kc
import references as ref
from minirun import Engine
from minirun.planner import plan, prompt_cache_bytes

from test_hca_cache import random_ids
from test_hca_cuda import BACKENDS, HCACacheCUDA

HQ, HKV, D = 9, 3, 64
Q2K = (np.arange(HQ) // (HQ // HKV)).astype(np.int32)


@pytest.mark.parametrize("n", [0, 1, 7, 5000])
@pytest.mark.parametrize("kdt", [np.float32, np.float16])
@pytest.mark.parametrize("compact", [False, True])
def test_selected_scores_kernel_vs_reference(n, kdt, compact):
    rng = np.random.default_rng(n + 7 * compact)
    q = (rng.standard_normal((HQ, D)) / 8).astype(np.float32)
    K = rng.standard_normal((HKV, n + 3, D)).astype(kdt)
    counts = rng.integers(0, n + 1, HQ).astype(np.int32)
    if n:
        counts[0], counts[1] = 0, n          # an empty head, and a full one (several 2048-entry chunks)
    idx = np.zeros((HQ, max(n, 1)), np.int32)
    for h in range(HQ):
        idx[h, :counts[h]] = rng.permutation(n)[:counts[h]]
    z = rng.standard_normal((HQ, max(n, 1))).astype(np.float32)
    want = ref.selected_scores_ref(q, K, idx, counts, Q2K, z, compact)
    got = kc.selected_scores(q, K, idx, counts, Q2K, z.copy(), compact)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    untouched = np.ones_like(z, bool)        # entries of unselected tokens keep their old scores
    for h in range(HQ):
        untouched[h, np.arange(counts[h]) if compact else idx[h, :counts[h]]] = False
    assert np.array_equal(got[untouched], z[untouched])


def test_selected_scores_writes_through_a_row_view():
    """z may be the first columns of a wider scratch (as the caches hand it): written in place."""
    rng = np.random.default_rng(1)
    q, K = rng.standard_normal((HQ, D)).astype(np.float32), rng.standard_normal((HKV, 40, D)).astype(np.float32)
    buf = np.zeros((HQ, 64), np.float32)
    idx = np.tile(np.arange(40, dtype=np.int32), (HQ, 1))
    counts = np.full(HQ, 40, np.int32)
    kc.selected_scores(q, K, idx, counts, Q2K, buf[:, :40])
    assert np.allclose(buf[:, :40], np.einsum("hd,hnd->hn", q, K[Q2K]), atol=1e-4)
    assert not buf[:, 40:].any()
    with pytest.raises(ValueError, match="float32"):
        kc.selected_scores(q, K, idx, counts, Q2K, buf.astype(np.float64))


ONE_CALL_CASES = [(272, 5000, 0.9), (272, 5000, 1.0), (16, 1, 0.9), (272, 0, 0.9), (0, 3000, 0.5)]


@pytest.mark.parametrize("pool_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n_exact,n_store,tau", ONE_CALL_CASES)
def test_one_call_step_rescores_as_the_reference(pool_dtype, n_exact, n_store, tau):
    """kernels_cpu.hca_decode_attend with host keys: the level selection, then exact weights over
    the keys (level_sum's lanes), against hca_decode_attend_ref with selected_scores_ref."""
    from kernel_steps import run_fused, setup
    rng = np.random.default_rng([n_exact, n_store, int(tau * 10), 1])
    q, k, v, EK, EV, C, P, V, cap = setup(rng, n_exact, n_store, 16, 1024, pool_dtype)
    K = rng.standard_normal(V.shape).astype(pool_dtype)
    o, counts, _, _ = run_fused(q, k, v, EK, EV, n_exact, C, P, n_store, V, tau, cap, host_keys=K)
    want = ref.hca_decode_attend_ref(q, k, v, EK, EV, n_exact, C, P, n_store, V, tau, Q2K, host_keys=K)
    np.testing.assert_allclose(o, want, rtol=1e-4, atol=1e-4)
    if n_store:   # (the codebook weights give another answer)
        plain = ref.hca_decode_attend_ref(q, k, v, EK, EV, n_exact, C, P, n_store, V, tau, Q2K)
        assert np.abs(plain - want).max() > 1e-2


@pytest.mark.parametrize("pool_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n_exact,n_store,tau", ONE_CALL_CASES)
def test_fast_scan_step_rescores_as_the_reference(pool_dtype, n_exact, n_store, tau):
    from kernels_cpu import fastscan as fs
    from references import hca_decode_attend_fs_ref
    from kernel_steps import factors
    if not fs.available():
        pytest.skip("no AVX2: the fast scan is not built for this CPU")
    rng = np.random.default_rng([n_exact, n_store, int(tau * 10), 2])
    cap = n_store + 13
    q = (rng.standard_normal((HQ, D)) / np.sqrt(D) * 3).astype(np.float32)
    k, v = rng.standard_normal((2, HKV, D)).astype(np.float32)
    EK, EV = rng.standard_normal((2, HKV, n_exact + 5, D)).astype(pool_dtype)
    V, K = rng.standard_normal((2, HKV, cap, D)).astype(pool_dtype)
    F = factors(rng, HKV, D, 1)
    PT = rng.integers(0, 256, (HKV, D // 2, cap), dtype=np.uint8)
    lut = fs.FastScanLUT(HQ, D, kc.lane_map(Q2K, HKV))
    z, idx = np.full((HQ, cap), np.nan, np.float32), np.zeros((HQ, cap), np.int32)
    o = fs.hca_decode_attend_fs(q, k, v, EK, EV, n_exact, F, PT, n_store, V, tau, Q2K, lut, z, idx, host_keys=K)
    want = hca_decode_attend_fs_ref(q, k, v, EK, EV, n_exact, F, PT, n_store, V, tau, Q2K, host_keys=K)
    np.testing.assert_allclose(o, want, rtol=1e-4, atol=1e-4)


def test_one_call_step_checks_the_host_keys():
    from kernel_steps import run_fused, setup
    q, k, v, EK, EV, C, P, V, cap = setup(np.random.default_rng(0), 16, 100, 16, 1024, np.float32)
    with pytest.raises(ValueError, match="host_keys must be"):
        run_fused(q, k, v, EK, EV, 16, C, P, 100, V, 0.9, cap, host_keys=V[:, :50].astype(np.float16))


STORES = {   # codebook stores on the CPU cache's paths (tau = 1 selects every token)
    "packed": dict(groups=8, centroids=32, fit_min_tokens=48),               # packed levels, compact scores
    "pairs": dict(groups=8, centroids=16, fit_min_tokens=48),                # nibble pairs (the fast scan on AVX2)
    # no codebooks until the prompt's end: its HCA-path scores are exact ones (rescored all the same)
    "not-encoded": dict(groups=8, centroids=32, fit_min_tokens=10_000),
}


@pytest.mark.parametrize("store", list(STORES))
def test_tau1_rescore_equals_dense(tiny_model_dir, store):
    """Every store token selected and weighted by its exact score: dense attention, over a
    prompt through the HCA path (every position) and over decode steps."""
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(260, seed=3)
    dense = Engine.load(d, device="cpu", ctx=512)
    kw = dict(device="cpu", ctx=512, kv="hca", tau=1.0, window=16, sinks=4, prefill_chunk=32, **STORES[store])
    hca, plain = Engine.load(d, rescore=True, **kw), Engine.load(d, **kw)
    assert (hca.logits(ids) - dense.logits(ids)).abs().max().item() <= 1e-4
    steps = {}
    for name, eng in (("dense", dense), ("rescore", hca), ("plain", plain)):
        eng.prefill(ids)
        steps[name] = torch.stack([eng.step(t).reshape(-1) for t in (5, 9, 11)])
    assert hca.cache.n_encoded == hca.cache.n_store > 200     # (a prefill's end encodes every store key)
    err = {k: (steps[k] - steps["dense"]).abs().max().item() for k in ("rescore", "plain")}
    assert err["rescore"] <= 1e-4
    assert err["plain"] > 20 * err["rescore"]           # (the codebook weights: what rescoring corrects)


def test_rescore_below_tau_one_changes_the_weights(tiny_model_dir):
    """tau 0.9: the same selection (the codebooks pick), other weights; an exact-key store (0.5)
    takes the flag as what it already does: no host keys, the same logits."""
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(300, seed=4)
    kw = dict(device="cpu", ctx=512, kv="hca", tau=0.9, window=16, sinks=4, prefill_chunk=32)
    dense = Engine.load(d, device="cpu", ctx=512)
    dense.prefill(ids)
    want = torch.stack([dense.step(t).reshape(-1) for t in (5, 9)])
    outs = {}
    for name, extra in (("plain", {}), ("rescore", {"rescore": True})):
        for budget in ("codebook", "exact"):
            store = STORES["packed"] if budget == "codebook" else dict(kv_budget=0.5)
            eng = Engine.load(d, **kw, **store, **extra)
            eng.prefill(ids)
            eng.cache.record_selection = []
            outs[name, budget] = (torch.stack([eng.step(t).reshape(-1) for t in (5, 9)]),
                                  np.stack(eng.cache.record_selection), eng.cache.host_keys)
    # the same selection sizes in layer 0 (the same queries); a later layer's queries come from the
    # layer before, whose sums rescoring changed, so a token at the tau cut may fall either way
    L = dense.args.num_hidden_layers
    sel_plain, sel_rescore = outs["plain", "codebook"][1], outs["rescore", "codebook"][1]
    assert np.array_equal(sel_plain[::L], sel_rescore[::L])
    assert np.abs(sel_plain - sel_rescore).max() <= 0.05
    err = {k: (outs[k, "codebook"][0] - want).abs().mean().item() for k in ("plain", "rescore")}
    assert (outs["plain", "codebook"][0] - outs["rescore", "codebook"][0]).abs().max().item() > 1e-5
    # (below tau 1 what the selection leaves out dominates the error: rescoring the kept tokens'
    # weights need not lower it, and must not raise it by much; at tau 1 it does, tested above)
    assert err["rescore"] < 1.1 * err["plain"]
    assert outs["rescore", "exact"][2] is None
    assert torch.equal(outs["plain", "exact"][0], outs["rescore", "exact"][0])


def test_host_keys_in_kv_stats_and_the_plan(tiny_model_dir):
    d = tiny_model_dir("gqa-untied")
    ctx = 600
    eng = Engine.load(d, device="cpu", ctx=ctx, kv="hca", kv_budget=0.125, centroids=64, window=32, sinks=4,
                      rescore=True)
    eng.prefill(random_ids(ctx))
    s, c = eng.kv_stats(), eng.cache
    assert s["host_keys_bytes"] == c.host_keys.data.numel() * c.host_keys.data.element_size() > 0
    assert s["host_keys_bytes"] == s["host_values_bytes"]          # one key row per value row, same type
    tiers = plan(eng.args, eng.config).tiers
    assert tiers["host keys"] == (s["host_keys_bytes"], "host")
    plain = eng.config.__class__(**{**eng.config.__dict__, "rescore": False})
    assert "host keys" not in plan(eng.args, plain).tiers
    assert prompt_cache_bytes(eng.args, eng.config) - prompt_cache_bytes(eng.args, plain) == s["host_keys_bytes"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_cache_class_rescores_on_the_host(tiny_model_dir, monkeypatch, backend):
    """HCACacheCUDA (the emulator without a GPU): tau = 1 with codebooks and rescoring is dense
    attention, through the host sum's copy-back (the query copied back with the selection); the
    GPU value sum is not taken (the note says why)."""
    import cuda_emu
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(200, seed=5)
    dense = Engine.load(d, device="cpu", ctx=256)
    want = dense.logits(ids)
    kw = dict(ctx=256, kv="hca", tau=1.0, window=16, sinks=4, prefill_chunk=32, groups=8, centroids=32,
              fit_min_tokens=48, rescore=True, value_sum="gpu")
    emulated = cuda_emu.emulated_hca_cuda if backend == "emu" else contextlib.nullcontext
    with emulated():
        eng = Engine.load(d, device="cpu" if backend == "emu" else "cuda", **kw)
        assert isinstance(eng.cache, HCACacheCUDA) and eng.cache.value_sum == "host" and eng.cache.host_keys is not None
        eng.prefill(ids[:150])
        got = torch.cat([eng.prefill(ids[:150 + i + 1])[0][-1:].cpu() for i in range(50)])
    assert eng.cache.n_encoded == eng.cache.n_store > 100
    assert (got - want[150:]).abs().max().item() <= 1e-4


def test_cli_rescore_reaches_the_cache_and_the_plan(tiny_model_dir, capsys):
    from minirun.cli.main import main
    import minirun.engine as me
    d = str(tiny_model_dir("gqa-untied"))
    seen = []
    real = me.Engine.__init__

    def init(self, *a, **kw):
        real(self, *a, **kw)
        seen.append(getattr(self.cache, "host_keys", None) is not None)
    me.Engine.__init__ = init
    try:
        for args in (["generate", d, "-p", "hello there " * 20, "-n", "2", "--kv", "hca", "--kv-budget", "g8c32",
                      "--window", "8", "--sinks", "2", "--ctx", "256", "--hca-opt", "rescore=true"],
                     ["bench", d, "-p", "", "-n", "2", "-d", "64", "--kv", "hca", "--kv-budget", "g8c32", "-r", "1", "--window", "8",
                      "--hca-opt", "rescore=true", "-o", "json"]):
            try:
                main(args)
            except SystemExit as e:
                assert e.code in (0, None)
    finally:
        me.Engine.__init__ = real
    assert seen == [True, True]
    out = capsys.readouterr().out
    rows = json.loads(out[out.index("["):])
    assert rows[0]["rescore"] is True and rows[0]["kv_stats"]["host_keys_bytes"] > 0
    try:
        main(["plan", d, "--ctx", "4K", "--kv", "hca", "--kv-budget", "0.125", "--device", "cpu", "--hca-opt", "rescore=true"])
    except SystemExit as e:
        assert e.code in (0, None)
    assert "| host keys | host |" in capsys.readouterr().out
