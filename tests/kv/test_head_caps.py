"""Per-head selection caps in the CPU decode steps (kernels_cpu.level_select.head_caps: > 0 at most
that many store tokens, 0 tau alone, < 0 the head skips the store) against the references, which cut
each head as the uniform cap would; and a step whose every head skips the store equals attention
over sinks + ring and the token alone."""
import numpy as np
import pytest

import kernels_cpu as kc
import references as ref
from kernels_cpu import fastscan as fs
from kernels_cpu.level_select import head_caps

HQ, HKV, D = 9, 3, 64
Q2K = (np.arange(HQ) // (HQ // HKV)).astype(np.int32)
CAPS = np.array([-1, 0, 40, 5, -1, 100000, 1, 0, 300])       # skip, tau alone, capped, over the store


def inputs(rng, n_exact, n_store, pool=np.float32):
    q = (rng.standard_normal((HQ, D)) / np.sqrt(D) * 3).astype(np.float32)
    k, v = rng.standard_normal((2, HKV, D)).astype(np.float32)
    EK, EV = rng.standard_normal((2, HKV, n_exact + 5, D)).astype(pool)
    V = rng.standard_normal((HKV, n_store + 13, D)).astype(pool)
    return q, k, v, EK, EV, V


def test_head_caps_shapes():
    np.testing.assert_array_equal(head_caps(None, 3), [0, 0, 0])
    np.testing.assert_array_equal(head_caps(7, 2), [7, 7])
    np.testing.assert_array_equal(head_caps([1, -1, 0], 3), [1, -1, 0])
    with pytest.raises(ValueError, match="Hq=4"):
        head_caps([1, 2], 4)


def _check_counts(counts, free, caps):
    assert (counts[caps < 0] == 0).all()                               # skipped heads read nothing
    np.testing.assert_array_equal(counts[caps == 0], free[caps == 0])  # tau alone: as uncapped
    capped = caps > 1
    assert (counts[capped] <= np.minimum(caps[capped], free[capped])).all()


@pytest.mark.parametrize("tau", [0.9, 1.0])
def test_packed_step_per_head_caps(tau):
    rng = np.random.default_rng([11, int(tau * 10)])
    n, g, c = 5000, 16, 1024
    q, k, v, EK, EV, V = inputs(rng, 272, n)
    C = rng.standard_normal((HKV, g, c, D // g)).astype(np.float32)
    P = rng.integers(0, c, size=(HKV, n + 13, g)).astype(np.int16)
    lanes = kc.lane_map(Q2K, HKV)

    def run(cap):
        packed = kc.PackedLUT(np.empty((lanes.shape[0], g, c), np.uint64), lanes, np.empty(HQ, np.float32),
                              np.empty(HQ, np.float32))
        counts = np.zeros(HQ, np.int32)
        o = kc.hca_decode_attend(q, k, v, EK, EV, 272, ref.codebooks_t(C), ref.group_major(P), n, V, tau, Q2K,
                                 packed, np.empty((HQ, g, c), np.float32), np.zeros((HQ, n + 13), np.float32),
                                 np.zeros((HQ, n + 13), np.int32), counts, cap=cap)
        return o, counts
    o, counts = run(CAPS)
    np.testing.assert_allclose(o, ref.hca_decode_attend_ref(q, k, v, EK, EV, 272, C, P, n, V, tau, Q2K, cap=CAPS),
                               rtol=1e-4, atol=1e-4)
    _, rcounts, _, _, _ = ref.packed_select_ref(ref.build_lut_ref(q, C, Q2K), P, Q2K, n, tau, CAPS)
    np.testing.assert_array_equal(counts, rcounts)
    _check_counts(counts, run(0)[1], CAPS)


@pytest.mark.skipif(not fs.available(), reason="fast scan needs AVX2 (the packed step above on every CPU)")
def test_fastscan_step_per_head_caps():
    rng = np.random.default_rng(12)
    n = 5000
    q, k, v, EK, EV, V = inputs(rng, 272, n, np.float16)
    F = rng.standard_normal((HKV, D, 1, 16)).astype(np.float32)
    PT = rng.integers(0, 256, (HKV, D // 2, n + 13), dtype=np.uint8)

    def run(cap):
        counts = np.zeros(HQ, np.int32)
        o = fs.hca_decode_attend_fs(q, k, v, EK, EV, 272, F, PT, n, V, 0.9, Q2K,
                                    fs.FastScanLUT(HQ, D, kc.lane_map(Q2K, HKV)), np.zeros((HQ, n + 13), np.float32),
                                    np.zeros((HQ, n + 13), np.int32), counts, cap=cap)
        return o, counts
    o, counts = run(CAPS)
    want = ref.hca_decode_attend_fs_ref(q, k, v, EK, EV, 272, F, PT, n, V, 0.9, Q2K, cap=CAPS)
    np.testing.assert_allclose(o, want, rtol=1e-4, atol=1e-4)
    Q, scale, offset = ref.fs_lut_ref(q, F, Q2K)
    _, rcounts, _, _, _ = ref.levels_select_ref(ref.fs_levels_ref(Q, PT, Q2K, n), Q.max(axis=2).sum(axis=1),
                                                scale, offset, 0.9, CAPS)
    np.testing.assert_array_equal(counts, rcounts)
    _check_counts(counts, run(0)[1], CAPS)


@pytest.mark.parametrize("tau", [0.9, 1.0])
def test_exact_step_per_head_caps(tau):
    rng = np.random.default_rng([13, int(tau * 10)])
    n = 3000
    q, k, v, EK, EV, V = inputs(rng, 40, n)
    q *= 0.3
    K = rng.standard_normal((HKV, n + 3, D)).astype(np.float32)

    def run(cap):
        z, counts = np.full((HQ, n + 13), np.nan, np.float32), np.zeros(HQ, np.int32)
        o = kc.hca_exact_decode_attend(q, k, v, EK, EV, 40, K, n, V, tau, Q2K, kc.lane_map(Q2K, HKV), z,
                                       kc.level_hist(HQ), counts, cap=cap)
        return o, counts, z[:, :n]
    o, counts, z = run(CAPS)
    sel = ref.exact_select_ref(z, tau, CAPS)
    np.testing.assert_array_equal(counts, sel.sum(1))
    want = ref.hca_exact_decode_attend_ref(q, k, v, EK, EV, 40, K, n, V, tau, Q2K, z=z, cap=CAPS)
    np.testing.assert_allclose(o, want, rtol=2e-5, atol=2e-6)
    _check_counts(counts, run(0)[1], CAPS)


def test_every_head_skipping_is_the_exact_tier_alone():
    """All heads skip: the store adds nothing, the step is the exact tier and the token itself."""
    rng = np.random.default_rng(14)
    n = 2000
    q, k, v, EK, EV, V = inputs(rng, 100, n)
    K = rng.standard_normal((HKV, n + 3, D)).astype(np.float32)
    z, counts = np.zeros((HQ, n + 13), np.float32), np.zeros(HQ, np.int32)
    o = kc.hca_exact_decode_attend(q, k, v, EK, EV, 100, K, n, V, 0.9, Q2K, kc.lane_map(Q2K, HKV), z,
                                   kc.level_hist(HQ), counts, cap=np.full(HQ, -1))
    assert (counts == 0).all()
    want = ref.hca_exact_decode_attend_ref(q, k, v, EK, EV, 100, K, 0, V, 0.9, Q2K)
    np.testing.assert_allclose(o, want, rtol=2e-5, atol=2e-6)


@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="g++ not found (CPU kernel emulator)")
@pytest.mark.parametrize("order", ["forward", "random"])
@pytest.mark.parametrize("tau", [0.9, 1.0])
def test_emu_zcut_per_head_caps(order, tau):
    """The GPU's zcut with per-head caps (kernels_cuda scores.cu, on the emulator): each head's
    selection is the one a uniform cap of its own value makes (0: the uncapped one), none where its
    cap is negative: the same contract as the CPU's head_caps."""
    import cuda_wrappers as cw
    from cuda_checks import Env, np_
    rng = np.random.default_rng(40)
    z = (rng.standard_normal((HQ, 3000)) * 2).astype(np.float32)
    z[4, :200] = 3.0                                   # a top bin of 200 tokens: above the small caps
    env = Env("emu", order=order)
    with env.ctx():
        zt = env.t(z)
        idx, counts, _, _ = cw.threshold_select(zt, tau, caps=env.t(CAPS.astype(np.int32)))
        idx, counts = np_(idx), np_(counts)
        for h, cap in enumerate(CAPS):
            if cap < 0:
                assert counts[h] == 0
                continue
            i1, c1, _, _ = cw.threshold_select(zt[h:h + 1].contiguous(), tau, cap=int(cap) or None)
            assert set(idx[h, :counts[h]].tolist()) == set(np_(i1)[0, :int(np_(c1)[0])].tolist()), h


@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="g++ not found (CPU kernel emulator)")
def test_emulated_gpu_cache_keeps_the_cpu_caches_head_caps(tiny_model_dir):
    """Far positions on, per-head caps (a head skipping the store, one capped at 6 tokens, one at
    tau alone): the CPU cache and the GPU cache on the emulator select alike per head (skipping
    heads none, capped ones at most their cap) and decode the same tokens."""
    import torch
    import cuda_emu
    from minirun import Engine
    from minirun.kv import head_budgets as hb
    d = tiny_model_dir("gqa-untied")
    ids = torch.randint(4, 300, (140,), generator=torch.Generator().manual_seed(5)).tolist()
    kw = dict(ctx=256, kv="hca", key_store="exact", tau=0.9, window=16, sinks=4, prefill_chunk=32,
              far_positions="on")
    cpu = Engine.load(d, device="cpu", **kw)
    with cuda_emu.emulated_hca_cuda():
        gpu = Engine.load(d, device="cpu", **kw)
    L, Hq = cpu.args.num_hidden_layers, cpu.args.num_attention_heads
    caps = np.tile(np.array([-1, 6, 0, 2])[:Hq], (L, 1))
    outs = []
    for eng, where in ((cpu, __import__("contextlib").nullcontext), (gpu, cuda_emu.emulated_hca_cuda)):
        # (no calibrated file: every head's default cap, larger than this store)
        assert (eng.cache.head_caps == hb.DEFAULT_CAP).all()
        eng.cache.set_head_caps(caps)
        with where():
            eng.prefill(ids)
            eng.cache.record_selection = []
            outs.append(torch.stack([eng.step(t).reshape(-1) for t in (3, 7, 12)]))
        n = eng.cache.n_store                                       # (the steps' stores: n - 3 .. n - 1)
        sel = np.stack(eng.cache.record_selection)                  # [steps * L, Hq] shares selected
        assert n > 100 and (sel[:, 0] == 0).all()
        assert (sel[:, 1] <= 6 / (n - 3) + 1e-9).all() and (sel[:, 3] <= 2 / (n - 3) + 1e-9).all()
        assert (sel[:, 2] > 6 / (n - 3)).any()                      # tau alone reads more than the caps
    assert (outs[0].argmax(-1) == outs[1].argmax(-1)).all()
    assert (outs[0] - outs[1]).abs().max().item() <= 0.01


def test_caps_from_measured_mass():
    """A head whose store holds <= 5% of its mass skips it; the others keep the fewest top tokens
    that leave at most 5% of the whole mass out (the largest k measured when none does)."""
    from minirun.kv import head_budgets as hb
    share = np.array([[0.03, 0.5, 0.5, 0.9]])
    cap = np.zeros((1, 4, len(hb.TOP_K)))
    cap[0, 1] = [0.5, 0.8, 0.95, 0.99, 1, 1, 1]           # 0.5 * (1 - 0.95) = 0.025 <= 0.05 at k = 256
    cap[0, 2] = [0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]       # never: the largest k
    cap[0, 3] = [0.96, 1, 1, 1, 1, 1, 1]                  # 0.9 * 0.04 = 0.036 at k = 64
    np.testing.assert_array_equal(hb.caps_from(share, cap), [[-1, 256, hb.TOP_K[-1], 64]])


def test_head_caps_file_and_rule(tmp_path):
    """The cache's caps: none without far positions or with head_budgets off; the codebook file's
    where it holds them (max_select bounding them), else every head's default cap."""
    import torch
    from minirun.kv import head_budgets as hb
    from minirun.config import EngineConfig
    from minirun.kv.codebooks import Codebooks
    f = tmp_path / "cb.safetensors"
    caps = np.array([[-1, 300, 5000], [64, 0, -1]])
    Codebooks(torch.zeros(2, 1, 1, 2, 4)).save(f, extra={"head_caps": torch.from_numpy(caps.astype(np.int32))})
    cfg = EngineConfig(kv="hca")
    assert hb.head_caps_for(cfg, False, f, (2, 3)) is None
    assert hb.head_caps_for(EngineConfig(kv="hca", head_budgets="off"), True, f, (2, 3)) is None
    np.testing.assert_array_equal(hb.head_caps_for(cfg, True, f, (2, 3)), caps)
    np.testing.assert_array_equal(hb.head_caps_for(EngineConfig(kv="hca", max_select=1000), True, f, (2, 3)),
                                  [[-1, 300, 1000], [64, 1000, -1]])
    default = np.full((3, 3), hb.DEFAULT_CAP)
    np.testing.assert_array_equal(hb.head_caps_for(cfg, True, f, (3, 3)), default)      # another model's file
    np.testing.assert_array_equal(hb.head_caps_for(cfg, True, tmp_path / "none", (2, 3)), default[:2])
    np.testing.assert_array_equal(hb.head_caps_for(cfg, True, None, (2, 3)), default[:2])
    np.testing.assert_array_equal(hb.head_caps_for(EngineConfig(kv="hca", max_select=100), True, None, (2, 3)),
                                  np.full((2, 3), 100))


def test_measure_store_share_and_top_k(tiny_model_dir):
    """head_budgets.measure on a tiny model with far positions on: per (layer, head) a share of the
    mass on the store in [0, 1] and top-k shares growing with k to all of it past the store's size."""
    import torch
    from minirun import Engine
    from minirun.kv import head_budgets as hb
    eng = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=512, kv="hca", kv_budget=0.5,
                      prefill_mode="exact", far_positions="on", window=16, sinks=4, prefill_chunk=64)
    ids = torch.randint(4, 300, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    m = hb.measure(eng, ids, queries=8, top_k=(4, 16, 1024))
    L, Hq = eng.args.num_hidden_layers, eng.args.num_attention_heads
    share, cap = m["store_share"], m["captured"]
    assert share.shape == (L, Hq) and cap.shape == (L, Hq, 3) and m["store_tokens"] > 200
    assert (share >= 0).all() and (share <= 1).all() and share.max() > 0.05
    assert (np.diff(cap, axis=-1) >= -1e-6).all() and np.allclose(cap[..., -1], 1.0, atol=1e-5)
    assert eng.cache.offset == 0                                   # (the engine reset afterwards)
