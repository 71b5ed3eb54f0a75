"""The HCA cache: exactness at tau=1 with exact keys, tier invariants through ring wrap-around, accounting."""
import pytest
import torch

from minirun import Engine
from minirun.config import EngineConfig, ModelArgs
from minirun.kv.hca import HCACache
from minirun.planner import plan

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, vocab_size=300, model_type="llama")


def random_ids(n, seed=0):
    return torch.randint(4, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_tau1_exact_keys_equals_dense(tiny_model_dir, chunk):
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(400 if chunk > 1 else 150)
    dense = Engine.load(d, device="cpu", ctx=512).logits(ids)
    hca = Engine.load(d, device="cpu", ctx=512, kv="hca", key_store="exact", tau=1.0, window=32, sinks=4,
                      prefill_chunk=chunk)
    out = hca.logits(ids)   # every position through the HCA path: the prompt is > 4x the ring
    assert (out - dense).abs().max().item() <= 1e-4


def test_tau1_exact_keys_decode_equals_dense(tiny_model_dir):
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(300)
    dense = Engine.load(d, device="cpu", ctx=512)
    hca = Engine.load(d, device="cpu", ctx=512, kv="hca", key_store="exact", tau=1.0, window=16, sinks=2,
                      prefill_mode="hca")
    a = dense.generate(ids, max_new_tokens=12)
    b = hca.generate(ids, max_new_tokens=12)
    assert a.tokens == b.tokens
    ld, lh = dense.prefill(ids + a.tokens)[0], hca.prefill(ids + a.tokens)[0]
    assert (ld - lh).abs().max().item() <= 1e-4


def test_codebook_hca_close_to_dense_on_tiny_model(tiny_model_dir):
    """Codebook keys + tau 0.9 is approximate; on a tiny random model it must stay close to dense."""
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(600)
    dense = Engine.load(d, device="cpu", ctx=1024).logits(ids)
    hca = Engine.load(d, device="cpu", ctx=1024, kv="hca", kv_budget=0.25, centroids=64, window=64, sinks=4,
                      fit_min_tokens=128, prefill_chunk=50)
    out = hca.logits(ids)
    agree = (out.argmax(-1) == dense.argmax(-1)).float().mean().item()
    assert agree >= 0.9
    assert hca.last_logits_cache.codebooks is not None   # fitted from the prompt's own keys


def make_cache(S=3, W=5, cap=64, **cfg):
    args = ModelArgs.from_dict(TINY)
    config = EngineConfig(kv="hca", key_store="exact", sinks=S, window=W, tau=1.0, **cfg)
    return HCACache(args, config, torch.device("cpu"), torch.float32, cap), args


def push(cache, args, T, pos0):
    """Stage keys whose first channel is the position, so tiers can be checked by value."""
    L, Hkv, hd = args.num_hidden_layers, args.num_key_value_heads, args.head_dim
    pos = torch.arange(pos0, pos0 + T, dtype=torch.float32)
    k = pos[:, None, None].expand(T, Hkv, hd).clone()
    for layer in range(L):
        cache._staged[layer] = (k, k + 0.5)
    cache.advance(T)


@pytest.mark.parametrize("chunks", [[1] * 30, [4, 9, 1, 13, 2, 7], [30], [2, 20, 3, 1, 1, 1, 2]])
def test_every_token_in_exactly_one_tier_through_wraparound(chunks):
    cache, args = make_cache()
    pos = 0
    for T in chunks:
        push(cache, args, T, pos)
        pos += T
        S, W, n_store = cache.S, cache.W, cache.n_store
        held = cache.slot_pos[cache.slot_pos >= 0].tolist()
        store = list(range(S, S + n_store))
        assert sorted(held + store) == list(range(pos)), "each position exactly once"
        assert len([p for p in held if p >= S]) <= W
        for slot, p in enumerate(cache.slot_pos.tolist()):
            if p >= 0:   # the key in the slot is the key of position p, and the slot follows the ring rule
                assert cache.ek[0, 0, slot, 0].item() == p
                assert slot == (p if p < S else S + (p - S) % W)
        if n_store:
            stored = cache.exact_keys.view(0, n_store)[0, :, 0]
            assert stored.tolist() == [float(p) for p in store]
            assert cache.values.view(1, n_store)[1, :, 0].tolist() == [p + 0.5 for p in store]


def test_truncate_within_ring_then_continue():
    cache, args = make_cache()
    push(cache, args, 12, 0)            # store holds 3..6, ring 7..11
    assert cache.truncate(9)            # drop 9, 10, 11 (all in the ring)
    assert not cache.truncate(5)        # 5 is in the store: cannot
    push(cache, args, 6, 9)
    held = cache.slot_pos[cache.slot_pos >= 0].tolist()
    assert sorted(held + list(range(3, 3 + cache.n_store))) == list(range(15))


def test_kv_stats_equal_allocated_arrays(tiny_model_dir):
    eng = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=2048, kv="hca", kv_budget=0.125,
                      centroids=32, window=32, sinks=4)
    eng.generate(random_ids(700), max_new_tokens=3)
    c, s = eng.cache, eng.kv_stats()
    assert s["tokens"] == c.offset == 703   # prompt + 3 generated tokens, each fed back
    assert s["tokens_exact"] + s["tokens_store"] == s["tokens"]
    nb = lambda t: t.numel() * t.element_size()
    assert s["device_keys_bytes"] == nb(c.indices.data)
    assert s["host_values_bytes"] == nb(c.values.data)
    assert s["device_ring_sinks_bytes"] == nb(c.ek) + nb(c.ev)
    # the codebooks, and on the CPU the LUT kernel's transposed copy and the encoder's norms
    ks = c.key_store
    assert s["codebook_bytes"] == 2 * nb(c.codebooks.centroids) + ks.cnorm.nbytes
    assert ks.cnorm.nbytes == nb(c.codebooks.centroids) // c.layout.sub_dim
    assert s["decode_scratch_bytes"] == (ks.lut.nbytes + ks.packed.tables.nbytes + c.exact_store.hist.nbytes
                                         + ks.codes.nbytes + c.Hq * 24) > 0
    assert s["prefill_keys_bytes"] == 0            # full-precision prompt keys were dropped
    assert c.indices.data.dtype == torch.uint8   # 32 centroids fit a byte
    assert s["total_bytes"] == sum(v for k, v in s.items() if k.endswith("_bytes") and k != "total_bytes")


@pytest.mark.parametrize("kv_values", ["float", "q8", "q4"])
def test_planner_matches_kv_stats_at_full_context(tiny_model_dir, kv_values):
    # (quantized values: a head dim of 32, one group of channels)
    d = tiny_model_dir("gqa-untied", **({} if kv_values == "float" else {"hidden_size": 128}))
    ctx = 600
    eng = Engine.load(d, device="cpu", ctx=ctx, kv="hca", kv_budget=0.125, centroids=300, window=32, sinks=4,
                      kv_values=kv_values)
    eng.prefill(random_ids(ctx))
    s = eng.kv_stats()
    p = plan(eng.args, eng.config).tiers
    assert p["key store"][0] == s["device_keys_bytes"]
    assert p["value pool"][0] == s["host_values_bytes"]
    per_token = {"float": 16 * 4, "q8": 32 + 2, "q4": 16 + 4}[kv_values]   # bytes per token and kv head
    assert s["host_values_bytes"] == 2 * 2 * (ctx - 36) * per_token      # L = 2, Hkv = 2
    assert p["sinks+ring K+V"][0] == s["device_ring_sinks_bytes"]
    assert p["codebooks"][0] == s["codebook_bytes"]
    assert p["scratch"][0] == s["scratch_bytes"]
    assert p["decode scratch"][0] == s["decode_scratch_bytes"]


@pytest.mark.parametrize("n", [90, 150])
def test_anchor_prefill_equals_exact_within_anchor_plus_neighbourhood(tiny_model_dir, n):
    """Block-wise anchor prefill is exact while the context fits in anchor + ring (+ the chunk)."""
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(n)
    kw = dict(device="cpu", ctx=512, kv="hca", key_store="exact", window=32, sinks=4, anchor_tokens=64,
              prefill_chunk=16)
    exact = Engine.load(d, prefill_mode="exact", **kw)
    anchor = Engine.load(d, prefill_mode="anchor", **kw)
    le, la = exact.prefill(ids)[0], anchor.prefill(ids)[0]
    if n <= 64 + 32:
        assert (le - la).abs().max().item() <= 1e-4
    else:   # beyond anchor + neighbourhood the middle is skipped: no longer exact, but still sane
        assert torch.isfinite(la).all() and (le - la).abs().max().item() > 1e-6
    assert anchor.cache.anchor_k is None        # the anchor copy lives only during prefill


def test_auto_prefill_is_exact_inside_the_trained_context_on_a_cpu(tiny_model_dir):
    """prefill_mode auto on a CPU: exact up to the model's trained context, anchor past it (exact
    attention there costs more than the GEMMs); exact_prefill_max, when given, decides; a GPU reads
    64K tokens exactly whatever the model."""
    from minirun.config import EXACT_PREFILL_GPU, EngineConfig
    d = tiny_model_dir("gqa-untied", max_position_embeddings=64)
    kw = dict(device="cpu", ctx=512, kv="hca", key_store="exact", window=8, sinks=4, prefill_chunk=16)
    modes = []
    for n, extra in ((60, {}), (100, {}), (100, {"exact_prefill_max": 128})):
        eng = Engine.load(d, **kw, **extra)
        eng.prefill(random_ids(n))
        modes.append(eng.last_prefill["mode"])
    assert modes == ["exact", "anchor", "exact"]
    assert EngineConfig().exact_prefill_limit("cuda", 64) == EXACT_PREFILL_GPU
    assert EngineConfig().exact_prefill_limit("cpu", None) == 8192
    assert EngineConfig().exact_prefill_limit("cpu", 1 << 20) == EXACT_PREFILL_GPU
    assert EngineConfig(exact_prefill_max=0).exact_prefill_limit("cuda", 64) == 0


def test_decode_fast_path_equals_general_path(tiny_model_dir):
    """The numpy decode step (full ring, encoded store) gives the general torch path's logits."""
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(400)
    outs, codes, encodes = [], [], []
    for fast in (True, False):
        eng = Engine.load(d, device="cpu", ctx=512, kv="hca", kv_budget=0.25, centroids=32, window=32, sinks=4,
                          fit_min_tokens=64)
        eng.cache._numpy_exact_tier = fast
        eng.prefill(ids)
        calls, real = [], eng.cache._encode
        eng.cache._encode = lambda K: calls.append(K.shape[2]) or real(K)
        outs.append(torch.cat([eng.step(t) for t in (5, 6, 7)]))
        codes.append(eng.cache.indices.data[..., :eng.cache.n_store].clone())
        encodes.append(calls)
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-4
    # the fast step encodes the key leaving the ring itself (no separate encode call), and the
    # store ends up with the same indices as the general path's encode in advance()
    assert encodes == [[], [1, 1, 1]]
    assert torch.equal(codes[0], codes[1])


def test_partial_attention_paths_and_merge_of_splits():
    """The fused (lse) path equals the unfused one, and merging any split of the keys, empty parts
    included, equals attention over all of them."""
    from minirun.kv.attention import merge, partial_attention
    g = torch.Generator().manual_seed(3)
    T, Hq, Hkv, hd, n = 5, 6, 2, 16, 300
    q = torch.randn(T, Hq, hd, generator=g) * 0.3
    K, V = torch.randn(Hkv, n, hd, generator=g), torch.randn(Hkv, n, hd, generator=g)
    full = partial_attention(q, K, V)                                      # fused CPU kernel path
    ref = partial_attention(q, K, V, torch.ones(T, n, dtype=torch.bool))   # unfused path
    assert (full[0] - ref[0]).abs().max() < 1e-5
    assert (full[1] + torch.log(full[2]) - ref[1] - torch.log(ref[2])).abs().max() < 1e-4
    cuts = [0, 0, 17, 17, 150, 299, 300]                                   # empty parts at 0-0, 17-17
    parts = [partial_attention(q, K[:, a:b], V[:, a:b], torch.ones(T, b - a, dtype=torch.bool))
             for a, b in zip(cuts, cuts[1:])]
    o, m, l = merge(*parts)
    assert torch.isfinite(o).all() and (o - ref[0]).abs().max() < 1e-5
    o0, m0, l0 = merge(partial_attention(q, K[:, :0], V[:, :0]), partial_attention(q, K[:, :0], V[:, :0]))
    assert torch.isfinite(o0).all() and (o0 == 0).all() and (l0 == 0).all()


def check_exact_tier_partial(far, live_share, device="cpu", dtype=torch.float32, tol=1e-5):
    """A prompt chunk against sinks + ring + itself as fused parts (exact_tier_partial) equals one
    masked attention over [sinks + ring | chunk] (causal in the chunk, dead slots masked), the
    sinks read with the far queries where far positions are on."""
    from minirun.kv.attention import exact_tier_partial, merge, partial_attention
    g = torch.Generator().manual_seed(5)
    T, Hq, Hkv, hd, S, W = 7, 6, 2, 64, 3, 11
    qs, qf = (torch.randn(T, Hq, hd, generator=g) * 0.2 for _ in range(2))
    ek, ev = (torch.randn(Hkv, S + W, hd, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(T, Hkv, hd, generator=g).to(dtype) for _ in range(2))
    live = torch.rand(S + W, generator=g) < live_share
    got = exact_tier_partial(*(t.to(device) for t in (qs, qf, ek, ev)), live, S, k.to(device), v.to(device), far)
    near = live.clone()
    if far:
        near[:S] = False
    mask = torch.cat([near[None].expand(T, -1), torch.ones(T, T, dtype=torch.bool).tril()], 1)
    ek, ev, k, v = (t.float() for t in (ek, ev, k, v))
    want = partial_attention(qs, torch.cat([ek, k.transpose(0, 1)], 1), torch.cat([ev, v.transpose(0, 1)], 1), mask)
    if far and live[:S].any():
        want = merge(want, partial_attention(qf, ek[:, :S], ev[:, :S], live[:S][None].expand(T, -1)))
    got = [t.cpu() for t in got]
    assert (got[0] - want[0]).abs().max() < tol
    assert (got[1] + torch.log(got[2]) - want[1] - torch.log(want[2])).abs().max() < 10 * tol


@pytest.mark.parametrize("refused", [False, True])
@pytest.mark.parametrize("far", [False, True])
@pytest.mark.parametrize("live_share", [1.0, 0.6, 0.0])
def test_exact_tier_partial_is_the_masked_attention(far, live_share, refused, monkeypatch):
    """On the CPU (its flash kernel): a full, a part-live and an empty ring; and the unfused
    parts a device takes where torch refused its fused attention."""
    from minirun.kv import attention
    if refused:
        monkeypatch.setitem(attention.FUSED_REFUSED, "cpu", "refused")
        monkeypatch.setattr(attention, "_flash_partial", None)   # (not called)
    check_exact_tier_partial(far, live_share)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_exact_tier_partial_is_the_masked_attention(dtype):
    """On a GPU: flash (bfloat16) or the memory-efficient kernel (float32) with their log-sum-exp,
    not refused by torch (else prompt chunks would take the unfused path)."""
    from minirun.kv.attention import FUSED_REFUSED
    for far in (False, True):
        check_exact_tier_partial(far, 0.6, "cuda", dtype, tol=1e-4 if dtype == torch.float32 else 2e-2)
    assert "cuda" not in FUSED_REFUSED


def test_partial_attention_key_blocks_bound_the_scores(monkeypatch):
    """Many queries over many keys: the keys go in blocks of at most SCORE_ELEMS scores (here 256
    keys for 5 x 6 queries), merged exactly: the same (o, m, l) as one block, masked too."""
    import minirun.kv.attention as att
    g = torch.Generator().manual_seed(4)
    T, Hq, Hkv, hd, n = 5, 6, 2, 16, 1000
    q = torch.randn(T, Hq, hd, generator=g) * 0.3
    K, V = torch.randn(Hkv, n, hd, generator=g), torch.randn(Hkv, n, hd, generator=g)
    mask = torch.rand(T, n, generator=g) > 0.3
    one = att.partial_attention(q, K, V, mask)
    bmm_calls = []
    real_bmm = torch.bmm
    monkeypatch.setattr(att.torch, "bmm", lambda *a: bmm_calls.append(a[1].shape[-1]) or real_bmm(*a))
    monkeypatch.setattr(att, "SCORE_ELEMS", T * Hq * 256)
    blocks = att.partial_attention(q, K, V, mask)
    assert max(bmm_calls) == 256 and len(bmm_calls) == 2 * 4             # 4 blocks: scores and values
    for a, b in zip(one, blocks):
        assert (a - b).abs().max() < 1e-5


def test_bfloat16_on_cpu_takes_the_fused_decode_step(tiny_model_dir):
    """bfloat16 runs keep the exact tier as float16 on the CPU, so decode takes the one-call Numba
    step; it must agree with the per-kernel path (the exact tier in torch) it replaces."""
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(500)
    kw = dict(device="cpu", dtype="bfloat16", ctx=1024, kv="hca", kv_budget=0.25, centroids=64, window=32,
              sinks=4, fit_min_tokens=128)
    fast, slow = Engine.load(d, **kw), Engine.load(d, **kw)
    assert fast.cache.ek.dtype == torch.float16 and fast.cache._numpy_exact_tier
    slow.cache._numpy_exact_tier = False
    calls = []
    real = fast.cache._one_call
    fast.cache._one_call = lambda *a, decode: (decode and calls.append(1)) or real(*a, decode=decode)
    lf, ls = [fast.prefill(ids)[0]], [slow.prefill(ids)[0]]
    for t in ids[:8]:
        lf.append(fast.step(t))
        ls.append(slow.step(t))
    assert len(calls) == 8 * 2              # every decode step of both layers went through it
    lf, ls = torch.cat(lf).float(), torch.cat(ls).float()
    assert (lf.argmax(-1) == ls.argmax(-1)).all()
    assert (lf - ls).abs().max().item() <= 0.02 * lf.abs().max().item()


def test_decode_fast_path_across_store_growth(tiny_model_dir, monkeypatch):
    """The fused step keeps numpy views of the store and scratch between steps; when the buffers
    grow (reallocate) mid-decode it must take fresh ones: same logits as the general path."""
    import minirun.kv.store as store
    monkeypatch.setattr(store, "MIN_GROW", 16)          # grow by doubling from 16 rows
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(36 + 250)                          # sinks + ring + 250 store tokens: cap 256
    outs, caps = [], []
    for fast in (True, False):
        eng = Engine.load(d, device="cpu", ctx=512, kv="hca", kv_budget=0.25, centroids=32, window=32, sinks=4,
                          fit_min_tokens=64)
        eng.cache._numpy_exact_tier = fast
        eng.prefill(ids)
        cap0 = eng.cache.values.cap
        outs.append(torch.cat([eng.step(t) for t in range(5, 17)]))
        caps.append((cap0, eng.cache.values.cap))
    assert caps[0][0] < eng.cache.n_store <= caps[0][1]  # the store grew during the decode steps
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-4


def test_exact_keys_decode_takes_the_fused_step(tiny_model_dir):
    """The 50% preset's decode steps go through kernels_cpu.hca_exact_decode_attend (one call per
    layer): at tau 1 the logits equal dense's, at tau 0.9 they stay close to the general torch
    path's (which selects each head's exact minimal set; the fused step cuts at 1/32-logit
    buckets), and the selection is recorded as the codebook path's is."""
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(400)
    dense = Engine.load(d, device="cpu", ctx=512)
    ref = [dense.prefill(ids)[0]] + [dense.step(t) for t in (5, 6, 7)]
    for tau in (1.0, 0.9):
        outs, calls = [], []
        for fast in (True, False):
            eng = Engine.load(d, device="cpu", ctx=512, kv="hca", kv_budget=0.5, tau=tau, window=32, sinks=4,
                              prefill_mode="hca")
            assert eng.cache.layout.exact_keys
            eng.cache._numpy_exact_tier = fast
            real = eng.cache._one_call
            eng.cache._one_call = lambda *a, real=real, decode: (decode and calls.append(fast)) or real(*a, decode=decode)
            eng.cache.record_selection = []
            outs.append([eng.prefill(ids)[0]] + [eng.step(t) for t in (5, 6, 7)])
            if fast:
                assert len(eng.cache.record_selection) == 3 * 2     # one record per decode step and layer
                share = eng.cache.record_selection[-1]
                assert ((share > 0) & (share <= 1)).all() and (share == 1).all() == (tau == 1.0)
        assert calls == [True] * 6                # 3 steps x 2 layers, none from the general path
        fast_l, slow_l = torch.cat(outs[0]), torch.cat(outs[1])
        if tau == 1.0:
            assert (fast_l - torch.cat(ref)).abs().max().item() <= 1e-4
        assert (fast_l - slow_l).abs().max().item() <= 0.02 * slow_l.abs().max().item()


@pytest.mark.parametrize("budget", [0.5, 0.25])
def test_fused_steps_after_a_truncate(tiny_model_dir, budget):
    """A prompt that shares a prefix with the cache truncates it to the prefix: the ring then holds
    fewer than W tokens and stale slots until it refills. The one-call steps read every ring slot;
    they used to attend to the dropped tokens. Now they mask them: the same logits as the general
    path, and still one call per layer and step."""
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(90, seed=1)
    kw = dict(device="cpu", ctx=256, kv="hca", kv_budget=budget, centroids=16, tau=1.0, window=16, sinks=4,
              prefill_chunk=32, fit_min_tokens=32)
    outs = []
    for fast in (True, False):
        eng = Engine.load(d, **kw)
        eng.cache._numpy_exact_tier = fast
        gen = eng.generate(ids, max_new_tokens=10, ignore_eos=True).tokens
        calls, real = [], eng.cache._one_call
        eng.cache._one_call = lambda *a, decode: (decode and fast and calls.append(1)) or real(*a, decode=decode)
        first = eng.prefill(ids + gen[:7])[0]
        c = eng.cache
        assert c.offset < c.S + c.W + c.n_store and (c.slot_pos < 0).any()     # the ring is short
        outs.append(torch.cat([first] + [eng.step(t) for t in gen[7:]]))
        assert len(calls) == (4 * 2 if fast else 0)      # the re-prefilled last token + 3 steps, 2 layers
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("budget", [0.5, 0.125])
def test_one_token_advance_equals_the_general_path(tiny_model_dir, budget):
    """advance(1) takes a few slice copies, with a full ring (a token leaves for the store) and
    with a ring refilling after a truncate (a dead slot taken, the live-slot mask kept up to
    date). Through both states, the same cache contents and logits as the general path."""
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(90, seed=2)
    kw = dict(device="cpu", ctx=256, kv="hca", kv_budget=budget, centroids=16, tau=0.9, window=16, sinks=4,
              prefill_chunk=32, fit_min_tokens=32)
    runs = []
    for one in (True, False):
        eng = Engine.load(d, **kw)
        c = eng.cache
        taken = []
        if one:
            real = c._advance_one
            c._advance_one = lambda pos: taken.append(pos) or real(pos)
        else:
            c._advance_one = lambda pos: c._advance_chunk(1)
        gen = eng.generate(ids, max_new_tokens=24, ignore_eos=True).tokens    # full-ring steps
        eng.prefill(ids + gen[:10])                                        # truncates: ring short
        assert c.offset < c.S + c.W + c.n_store
        logits = [eng.step(t) for t in gen[10:]]                           # refills, then full again
        assert c.offset == c.S + c.W + c.n_store
        n = c.n_store
        runs.append((torch.cat(logits), c.ek.clone(), c.ev.clone(), c.slot_pos.clone(), c.values.view(0, n).clone(),
                     (c.exact_keys if budget == 0.5 else c.indices).view(0, n).clone(), taken))
    (la, eka, eva, spa, va, ka, taken), (lb, ekb, evb, spb, vb, kb, _) = runs
    assert len(taken) >= 24 + 14 - 1                                      # every decode step's advance
    assert torch.equal(spa, spb) and torch.equal(eka, ekb) and torch.equal(eva, evb)
    assert torch.equal(va, vb) and torch.equal(ka, kb)
    assert (la - lb).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planner_matches_kv_stats_with_exact_keys(tiny_model_dir, dtype):
    """The 50% preset: float32 store keys in every dtype, and the decode step's bucket counts."""
    d = tiny_model_dir("gqa-untied")
    ctx = 400
    eng = Engine.load(d, device="cpu", dtype=dtype, ctx=ctx, kv="hca", kv_budget=0.5, window=32, sinks=4)
    eng.prefill(random_ids(ctx - 2))
    eng.step(5)                                  # the one-call step makes its scratch
    s = eng.kv_stats()
    p = plan(eng.args, eng.config).tiers
    assert p["key store"][0] == s["device_keys_bytes"] == eng.cache.exact_keys.nbytes
    assert p["value pool"][0] == s["host_values_bytes"]
    assert p["decode scratch"][0] == s["decode_scratch_bytes"] == eng.cache.exact_store.hist.nbytes
    assert p["scratch"][0] == s["scratch_bytes"]


def test_long_prompt_after_a_short_exchange_prefills_exactly(tiny_model_dir):
    """A prompt that shares a few tokens with a cache holding no store yet (a short exchange: sinks
    + ring) prefills in exact mode, as an empty cache would, not through the HCA path (a server's
    long document after small talk took 4x longer that way): the logits of a fresh engine's exact
    prefill. Once a store exists, a question after it goes through the store."""
    d = tiny_model_dir("gqa-untied")
    kw = dict(device="cpu", ctx=1024, kv="hca", kv_budget=0.25, centroids=32, window=32, sinks=4, fit_min_tokens=64)
    eng = Engine.load(d, **kw)
    head = random_ids(10, seed=5)
    eng.prefill(head + random_ids(20, seed=6))
    assert eng.cache.n_store == 0
    ids = head + random_ids(400, seed=7)
    logits, cached = eng.prefill(ids)
    assert cached == 10 and eng.last_prefill["mode"] == "exact" and eng.cache.n_store > 0
    want = Engine.load(d, **kw).prefill(ids)[0]
    assert (logits - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    eng.prefill(ids + random_ids(5, seed=8))
    assert eng.last_prefill["mode"] == "hca"


def test_reset_inside_an_anchor_prefill_drops_the_anchor_block():
    """A reset mid anchor prefill (an interrupted prompt) leaves no anchor block: the next prompt
    does not fill it, and the cache can be saved again."""
    cache, args = make_cache()
    assert cache.begin_prefill("anchor") == "anchor" and cache.anchor_k is not None
    cache.reset()
    assert cache.anchor_k is None and cache.anchor_v is None
    push(cache, args, 12, 0)                 # (past sinks + ring: 4 tokens reach the store)
    assert cache.n_store == 4
    cache.state_dict()                       # (raised while an anchor block was left)
