"""The nibble-pair key store (codebooks of 16 centroids: two 4-bit codes per byte, the index of
their pair's product codebook) in the cache: layout, memory, codebook files, and the fast-scan
decode step against the generic path over the product codebooks."""
import shutil

import numpy as np
import pytest
import torch

from kernels_cpu import fastscan
from minirun import Engine
from minirun.config import EngineConfig, ModelArgs, hca_setting
from minirun.errors import MiniRunError
from minirun.kv.codebooks import Codebooks, codebook_filename
from minirun.kv.hca_layout import resolve_layout
from minirun.kv.key_store_cpu import PairKeys, ProductPairKeys
from minirun.planner import plan


def random_ids(n, seed=0):
    return torch.randint(4, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_layout_and_settings():
    args = ModelArgs(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152)
    lay = resolve_layout(args, EngineConfig(kv="hca", groups=64, centroids=16))
    assert (lay.pairs, lay.groups, lay.centroids, lay.sub_dim, lay.index_bytes) == (True, 32, 256, 2, 1)
    assert lay.codebook_geometry == (64, 16, 1)
    # as many key bytes as the 12.5% preset's int16 indices of 16 groups
    pre = resolve_layout(args, EngineConfig(kv="hca", kv_budget=0.125))
    assert lay.groups * lay.index_bytes == pre.groups * pre.index_bytes == 32
    assert not resolve_layout(args, EngineConfig(kv="hca", groups=64, centroids=32)).pairs
    assert hca_setting("g64c16") == {"groups": 64, "centroids": 16}
    assert hca_setting("0.125") == {"kv_budget": 0.125}
    with pytest.raises(MiniRunError, match="bad HCA setting"):
        hca_setting("g64")


@pytest.mark.parametrize("fast", [True, False])
def test_memory_and_planner(tiny_model_dir, monkeypatch, fast):
    """kv_stats equal the planner's figures, with the fast-scan step (its small tables) and without
    it (a CPU without AVX2: the generic step's tables over the product codebooks)."""
    if fast and not fastscan.available():
        pytest.skip("the fast-scan step needs AVX2")
    monkeypatch.setattr(fastscan, "available", lambda: fast)
    d = tiny_model_dir("gqa-untied")
    ctx = 400
    eng = Engine.load(d, device="cpu", ctx=ctx, kv="hca", groups=16, centroids=16, window=32, sinks=4)
    eng.prefill(random_ids(ctx - 2))
    eng.step(5)
    c, s = eng.cache, eng.kv_stats()
    assert type(c.key_store) is (PairKeys if fast else ProductPairKeys)
    assert c.layout.pairs and c.indices.data.dtype == torch.uint8 and c.indices.data.shape[2] == 8
    assert s["device_keys_bytes"] == c.indices.nbytes == 2 * 2 * c.indices.cap * 8     # L, Hkv, cap, 8 bytes
    assert c.codebooks.factors.shape == (2, 2, 16, 16, 1) and c.codebooks.centroids.shape == (2, 2, 8, 256, 2)
    assert c.codebooks.nbytes == (2 * 2 * 8 * 256 * 2 + 2 * 2 * 16 * 16) * 4          # product + factors
    p = plan(eng.args, eng.config).tiers
    assert p["key store"][0] == s["device_keys_bytes"]
    assert p["codebooks"][0] == s["codebook_bytes"]
    assert p["decode scratch"][0] == s["decode_scratch_bytes"] > 0


def test_calibrated_factor_file_is_paired(tiny_model_dir, tmp_path):
    """A codebooks-g{G}-c16 file (what `minirun calibrate --groups G --centroids 16` writes) is
    loaded as the factors of the product codebooks the cache indexes."""
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir("gqa-untied"), d)
    C = torch.randn(2, 2, 16, 16, 1)
    Codebooks(C).save(d / codebook_filename(16, 16))
    eng = Engine.load(d, device="cpu", ctx=300, kv="hca", groups=16, centroids=16, window=16, sinks=4)
    cb = eng.cache.codebooks
    assert cb.source == "calibrated:codebooks-g16-c16.safetensors"
    assert torch.equal(cb.factors, C)
    a, b = 5, 11                                       # byte a | b << 4 of pair 3: groups 6 and 7
    assert torch.equal(cb.centroids[1, 0, 3, a | (b << 4)], torch.cat([C[1, 0, 6, a], C[1, 0, 7, b]]))


@pytest.mark.skipif(not fastscan.available(), reason="the fast-scan step needs AVX2")
@pytest.mark.parametrize("tau", [1.0, 0.9])
def test_fast_scan_step_matches_the_generic_path(tiny_model_dir, monkeypatch, tau):
    """The same cache decoded by kernels_cpu.fastscan and by the generic packed path over the
    product codebooks: the codes are the same, the scores differ only by the tables' quantization
    (127 levels per group against 65535 / g), so at tau = 1 the logits agree closely and at 0.9
    the greedy tokens do."""
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(300, seed=4)
    runs = []
    for fast in (True, False):
        monkeypatch.setattr(fastscan, "available", lambda: fast)     # (the cache picks its key store by it)
        eng = Engine.load(d, device="cpu", ctx=400, kv="hca", groups=16, centroids=16, tau=tau, window=16,
                          sinks=4, fit_min_tokens=32)
        called = []
        real = fastscan.hca_decode_attend_fs
        fastscan.hca_decode_attend_fs = lambda *a, **k: called.append(1) or real(*a, **k)
        try:
            eng.prefill(ids)
            logits = torch.cat([eng.step(t) for t in random_ids(12, seed=5)])
        finally:
            fastscan.hca_decode_attend_fs = real
        assert len(called) == (12 * 2 if fast else 0)            # 12 steps, 2 layers
        c = eng.cache
        runs.append((logits, c.indices.view(0, c.n_store).clone()))
    (la, ka), (lb, kb) = runs
    assert torch.equal(ka, kb)                                   # the codes (encoded ahead or not) agree
    if tau == 1.0:
        assert (la - lb).abs().max().item() <= 2e-2 * la.abs().max().item()
    assert torch.equal(la.argmax(-1), lb.argmax(-1))
    assert np.isfinite(la.numpy()).all()


def test_views_contiguous_when_pools_grow_apart(tiny_model_dir):
    """The decode step's numpy views are each at its own buffer's capacity: when the indices have
    grown past the values (the pools grow apart), the codes' view stays contiguous (a strided one
    made Numba compile a slower scan, and its prefetch offsets assume rows shape[2] apart), and the
    step's output is the same."""
    d = tiny_model_dir("gqa-untied")
    out = []
    for grow_apart in (False, True):
        eng = Engine.load(d, device="cpu", ctx=8192, kv="hca", groups=16, centroids=16, window=32, sinks=4)
        eng.prefill(random_ids(300))
        c = eng.cache
        if grow_apart:
            c.indices.reserve(c.values.cap + 100)
            assert c.indices.cap > c.values.cap
            for layer in range(c.n_layers):
                views = c._views_of(layer)
                assert all(v.flags["C_CONTIGUOUS"] for v in views if v is not None)
                assert views[2].shape[2] == c.indices.cap
        out.append(eng.step(5))
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=0)
