"""The sliding-window layers' ring (kv/sliding.py) against sliding-window attention over every key,
its rewind points, its saved state, and the cache per layer kind that a model with such layers
gets (kv/layer_kinds.py): what it holds, what `minirun plan` counts, a prompt cache round trip."""
import math

import pytest
import torch

from minirun import Engine, EngineConfig, ModelArgs
from minirun.kv import make_cache
from minirun.kv.layer_kinds import LayerKindCache, layer_split
from minirun.kv.sliding import SlidingWindowCache
from minirun.planner import SLIDING, plan

Hq, Hkv, HD, W = 4, 2, 16, 8


def reference(q, K, V, pos0, window):
    """q [T, Hq, hd] at pos0..; K, V [n, Hkv, hd] of positions 0.. -> [T, Hq, hd]: each query reads
    the keys at j with p - window < j <= p."""
    T, rep = q.shape[0], Hq // Hkv
    Kr, Vr = K.repeat_interleave(rep, 1).float(), V.repeat_interleave(rep, 1).float()
    out = torch.empty(q.shape)
    for t in range(T):
        p = pos0 + t
        lo = max(0, p + 1 - window)
        s = torch.einsum("hd,nhd->hn", q[t].float(), Kr[lo:p + 1]) / math.sqrt(HD)
        out[t] = torch.einsum("hn,nhd->hd", s.softmax(-1), Vr[lo:p + 1])
    return out


def _qkv(n, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, HD, generator=g).to(dtype) for h in (Hq, Hkv, Hkv)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunks", [(5, 1, 1, 20, 3, 1, 1), (8, 8, 1), (20, 10, 1), (30, 1, 1, 1), (3,) + (1,) * 40])
def test_ring_attends_as_a_window_over_every_key(dtype, chunks):
    """Prompt chunks shorter and longer than the window and one-token steps (the numpy path for
    float32 and bfloat16 alike) give each query the window's attention."""
    q, k, v = _qkv(sum(chunks), 0, dtype)
    cache = SlidingWindowCache(2, Hkv, HD, W, 256, dtype, torch.device("cpu"))
    ref = reference(q, k, v, 0, W)
    pos = 0
    for T in chunks:
        for layer in range(2):
            o = cache.attend(layer, q[pos:pos + T], k[pos:pos + T], v[pos:pos + T])
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert torch.allclose(o.float(), ref[pos:pos + T], atol=tol), (T, pos, layer)
        cache.advance(T)
        pos += T
    assert cache.k.shape == (2, Hkv, 3 * W, HD)


def test_rewinds_while_the_window_is_held_and_through_copies():
    """The buffer (3W slots) keeps W to 2W positions more than the window: truncate goes back
    there; further back only through a rewind point whose tokens nothing has rewritten since."""
    q, k, v = _qkv(80, 1, torch.float32)
    cache = SlidingWindowCache(1, Hkv, HD, W, 256, torch.float32, torch.device("cpu"))

    def feed(a, b, step=None):
        for s in range(a, b, step or b - a):
            e = min(b, s + (step or b - a))
            cache.attend(0, q[s:e], k[s:e], v[s:e])
            cache.advance(e - s)
    feed(0, 6)
    assert cache.truncate(2) and cache.offset == 2          # nothing moved out yet: any n
    feed(2, 40)                                             # one chunk past the buffer: 24..39 stay
    assert cache.base == 24 and cache.truncate(35) and not cache.truncate(30)
    cache.checkpoint("prompt")
    feed(35, 60, step=1)                                    # one-token steps move the buffer on
    assert cache.base > 35 - W and not cache.truncate(30)
    assert cache.truncate(33) and cache.offset == 33        # through the copy taken at 35
    o = cache.attend(0, q[33:34], k[33:34], v[33:34])
    assert torch.allclose(o, reference(q[33:34], k, v, 33, W), atol=1e-5)
    cache.advance(1)
    feed(34, 60, step=1)                                    # (the same tokens again, written since)
    assert not cache.truncate(35)                           # the copy may restore up to 33 only
    assert cache.truncate(33)
    cache.reset()
    assert cache.copies == {} and cache.base == 0


def test_a_copy_is_not_restored_over_tokens_written_since():
    q, k, v = _qkv(40, 2, torch.float32)
    cache = SlidingWindowCache(1, Hkv, HD, W, 256, torch.float32, torch.device("cpu"))
    cache.attend(0, q[:30], k[:30], v[:30])
    cache.advance(30)
    cache.checkpoint("shared")
    assert cache.copies["shared"].valid_to == 30
    assert cache.truncate(25) and cache.copies["shared"].valid_to == 25


def test_state_round_trip_keeps_the_window():
    q, k, v = _qkv(30, 3, torch.float32)
    a = SlidingWindowCache(2, Hkv, HD, W, 64, torch.float32, torch.device("cpu"))
    for layer in range(2):
        a.attend(layer, q[:27], k[:27], v[:27])
    a.advance(27)
    scalars, tensors = a.state_dict()
    assert tensors[0][1].shape == (Hkv, W, HD)             # (the window before the offset)
    b = SlidingWindowCache(2, Hkv, HD, W, 64, torch.float32, torch.device("cpu"))
    b.load_state_dict(scalars, dict(tensors).__getitem__)
    assert b.offset == 27 and b.state_signature() == a.state_signature()
    oa, ob = (c.attend(1, q[27:28], k[27:28], v[27:28]) for c in (a, b))
    assert torch.equal(oa, ob)


GEMMA = dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=6,
             num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=300, sliding_window=512,
             sliding_window_pattern=6, max_position_embeddings=131072)


def test_a_model_with_sliding_layers_gets_a_ring_beside_its_global_layers_cache():
    args = ModelArgs.from_dict(GEMMA)
    assert layer_split(args) == ((0, 1, 2, 3, 4), (5,))
    for kv in ("dense", "hca"):
        cfg = EngineConfig(kv=kv, ctx=4096)
        cache = make_cache(args, cfg, torch.device("cpu"), torch.float32, 4096)
        assert isinstance(cache, LayerKindCache) and cache.local.k.shape == (5, 1, 3 * 512, 16)
        assert cache.full_layers.n_layers == 1 and cache.route[5] == (cache.whole, 0)


def test_plan_counts_each_layer_kind_and_the_rings_do_not_grow():
    """At 128K, Gemma 3-270M's shape (18 layers, 3 global, 1 kv-head of 256, window 512) holds its
    KV in less than a quarter of all-dense: a sixth with a dense cache on its global layers, less
    with HCA's."""
    args = ModelArgs.from_dict({**GEMMA, "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
                                "head_dim": 256, "vocab_size": 262144})
    all_dense = 2 * 18 * 256 * 4 * 131072
    for kv, most in (("dense", 0.25), ("hca", 0.25)):
        p = plan(args, EngineConfig(kv=kv, ctx=131072, dtype="float32"))
        kv_bytes = sum(b for name, (b, _) in p.tiers.items() if name != "weights" and "(prefill)" not in name)
        assert kv_bytes <= most * all_dense, (kv, kv_bytes / all_dense)
        assert p.tiers[SLIDING][0] == 2 * 15 * 256 * 4 * 3 * 512
    small = plan(args, EngineConfig(kv="dense", ctx=100, dtype="float32"))
    assert small.tiers[SLIDING][0] == 2 * 15 * 256 * 4 * 100


def test_prompt_cache_and_rewind_through_an_engine(tmp_path):
    """A Gemma-shaped random model, window 16: a second question after a first answer comes back
    to the document's end without starting over, and a saved prompt cache loads into the same
    answer."""
    from minirun.checkpoint.random_checkpoint import write_random_checkpoint
    d = write_random_checkpoint({**GEMMA, "sliding_window": 16, "sliding_window_pattern": 3,
                                 "max_position_embeddings": 4096}, tmp_path / "g")
    eng = Engine.load(d, device="cpu", ctx=256)
    doc = list(range(5, 105))
    eng.prefill(doc)
    eng.save_prompt_cache(tmp_path / "doc.kv")
    first = eng.generate(doc + [7, 8], max_new_tokens=6, ignore_eos=True).tokens
    resets = []
    reset = eng.cache.reset
    eng.cache.reset = lambda: (resets.append(1), reset())[1]
    again = eng.generate(doc + [9, 10, 11], max_new_tokens=6, ignore_eos=True).tokens
    assert resets == [] and eng.last_prefill["tokens"] == 3
    fresh = Engine.load(d, device="cpu", ctx=256)
    assert fresh.generate(doc + [9, 10, 11], max_new_tokens=6, ignore_eos=True).tokens == again
    loaded = Engine.load(d, device="cpu", ctx=256)
    loaded.load_prompt_cache(tmp_path / "doc.kv")
    assert loaded.generate(doc + [7, 8], max_new_tokens=6, ignore_eos=True).tokens == first
    assert loaded.last_prefill["tokens"] == 2
