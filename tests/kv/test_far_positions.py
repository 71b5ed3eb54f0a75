"""Far positions (minirun/kv/far_positions.py): sinks and store tokens attended at distance W,
unrotated keys, against a plain-torch reference of the same rule."""
import math

import pytest
import torch

import minirun.engine as me
from minirun import Engine
from minirun.config import EngineConfig
from minirun.errors import MiniRunError
from minirun.kv.base import KVCache
from minirun.kv.far_positions import (FarFrame, default_far_distance, far_group, far_positions_on, rotate,
                                      unrotate_keys)
from minirun.model.ops import apply_rope, rope_inv_freq

from test_hca_cache import random_ids

S, W = 4, 8


def rope(x, pos, inv, sign=1):
    """x [T, H, hd] rotated by sign * pos (ops.apply_rope, the model's own convention)."""
    c, s = _cs(pos, inv)
    return apply_rope(x, c, sign * s)


def _cs(pos, inv):
    ang = torch.as_tensor(pos, dtype=torch.float64)[:, None] * inv.double()[None, :]
    return ang.cos().float(), ang.sin().float()


class FarReference(KVCache):
    """Dense attention with the far-position rule: a query of the chunk starting at c0 reads key j
    at its true distance when j is in the chunk (causal) or in the ring (max(S, c0 - W) <= j < c0),
    and at distance D otherwise (j < S, or j < c0 - W): <R(D) q_pre, k_pre>. group G > 0 (grouped
    far positions): those far keys at distance f(p) - g(j), f(p) = p // G + W - W // G, g(j) = j // G:
    <R(f(p)) q_pre, R(g(j)) k_pre>."""

    def __init__(self, args, cap, D, length_ctx=None, group=0):
        super().__init__(args.num_hidden_layers, cap)
        self.D, self.length_ctx = D, length_ctx   # length_ctx: logits x max(1, log end / log N) (a chunk's last)
        self.group = group
        self.inv = rope_inv_freq(args)
        self.k = torch.zeros(args.num_hidden_layers, cap, args.num_key_value_heads, args.head_dim)
        self.v = torch.zeros_like(self.k)

    def attend(self, layer, q, k, v):
        T, Hq, hd = q.shape
        c0, end = self.offset, self.offset + T
        self.k[layer, c0:end], self.v[layer, c0:end] = k.float(), v.float()
        pos = torch.arange(c0, end)
        rep = Hq // k.shape[1]
        K = self.k[layer, :end].repeat_interleave(rep, 1)                     # [n, Hq, hd]
        V = self.v[layer, :end].repeat_interleave(rep, 1)
        K_pre = rope(K, torch.arange(end), self.inv, -1)
        G = self.group
        q_at = pos // G + W - W // G if G else torch.full((T,), self.D)
        q_far = rope(rope(q.float(), pos, self.inv, -1), q_at, self.inv)
        if G:
            K_pre = rope(K_pre, torch.arange(end) // G, self.inv)
        near = torch.einsum("thd,nhd->htn", q.float(), K)
        far = torch.einsum("thd,nhd->htn", q_far, K_pre)
        j = torch.arange(end)[None, :]
        is_far = (j < c0) & ((j < S) | (j < c0 - W))
        s = torch.where(is_far[None], far, near) / math.sqrt(hd)
        if self.length_ctx:
            s = s * max(1.0, math.log(end) / math.log(self.length_ctx))
        s = s.masked_fill((j > pos[:, None])[None], float("-inf"))
        return torch.einsum("htn,nhd->thd", s.softmax(-1), V).to(q.dtype)


def test_rotations():
    args = type("A", (), {"rope_theta": 10000.0, "head_dim": 64, "rope_scaling": None})()
    inv = rope_inv_freq(args)
    q, k = torch.randn(3, 9, 64), torch.randn(5, 3, 64)
    qp, kp = rope(q, torch.arange(100, 103), inv), rope(k, torch.arange(10, 15), inv)
    k_pre = unrotate_keys(kp.transpose(0, 1), torch.arange(10, 15), inv)            # [3, 5, 64]
    assert (k_pre - k.transpose(0, 1)).abs().max() < 1e-5
    assert (rotate(k_pre, torch.arange(10, 15), inv) - kp.transpose(0, 1)).abs().max() < 1e-5
    want = rope(q, torch.full((3,), 7), inv)                                       # R(7) q_pre
    assert (FarFrame(args, 7).queries(qp, 100) - want).abs().max() < 1e-5             # (3 queries: the general path)
    assert (FarFrame(args, 7).unrotate(kp.transpose(0, 1), torch.arange(10, 15)) - k_pre).abs().max() < 1e-5


def test_setting():
    assert default_far_distance(256, 8192) == 1024 and default_far_distance(8, 64) == 32
    assert default_far_distance(2048, 8192) == 2048 and default_far_distance(256, None) == 1024
    assert far_positions_on("auto", 8192, 4 << 20) and not far_positions_on("auto", 8192, 8192)
    assert not far_positions_on("auto", None, 4 << 20) and far_positions_on("on", 8192, 16)
    assert not far_positions_on("off", 8192, 4 << 20) and far_positions_on("grouped", 8192, 16)
    assert far_group(16640, 256, 8192) == 3 and far_group(4 << 20, 256, 8192) == 529 and far_group(100, 8, 64) == 2
    with pytest.raises(MiniRunError):
        EngineConfig(far_positions="maybe")


@pytest.mark.parametrize("chunk,mode,D", [(1, "hca", W), (7, "exact", W), (7, "hca", W), (1, "hca", 20),
                                         (7, "exact", 20)])
def test_exact_keys_tau1_equal_the_reference(tiny_model_dir, monkeypatch, chunk, mode, D):
    """Exact keys, tau 1: the cache is exact apart from the positions, so the far-position rule is
    all that separates it from the reference, through prefill (chunks of 1: every position a
    decode step) and exact / hca prefill modes, ring wrap-around and eviction included."""
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(70, seed=3)
    kw = dict(device="cpu", ctx=256, kv="hca", key_store="exact", tau=1.0, window=W, sinks=S, far_distance=D)
    eng = Engine.load(d, far_positions="on", **kw)
    out = eng.logits(ids, chunk=chunk, prefill_mode=mode)
    assert eng.last_logits_cache.far
    plain = Engine.load(d, device="cpu", ctx=256).logits(ids)
    monkeypatch.setattr(me, "make_cache", lambda args, config, device, dtype, cap, model_dir=None:
                        FarReference(args, cap, D))
    ref = Engine.load(d, **kw).logits(ids, chunk=chunk)
    assert (out - ref).abs().max().item() <= 1e-4
    print("far vs true positions:", (out - plain).abs().max().item())
    assert (out - plain).abs().max().item() > 1e-3          # (the rule changes the result)


@pytest.mark.parametrize("chunk,mode", [(1, "hca"), (7, "exact"), (7, "hca")])
def test_grouped_equals_the_reference(tiny_model_dir, monkeypatch, chunk, mode):
    """--far-positions grouped (SelfExtend's grouped distances), exact keys, tau 1: the reference
    with G = ceil(n / (N - W)) = 3 (N = 40 trained tokens, n = 70: Engine.logits' cache holds just
    the sequence), through prefill and decode steps, ring wrap-around and eviction included; and
    G = 1 (a ctx inside the trained one) is plain attention, as if far positions were off."""
    d = tiny_model_dir("gqa-untied", max_position_embeddings=40)
    ids = random_ids(70, seed=3)
    kw = dict(device="cpu", ctx=256, kv="hca", key_store="exact", tau=1.0, window=W, sinks=S)
    G = far_group(len(ids), W, 40)
    eng = Engine.load(d, far_positions="grouped", **kw)
    assert eng.cache.far.group == far_group(256, W, 40) == 8     # (the conversation cache: its ctx)
    out = eng.logits(ids, chunk=chunk, prefill_mode=mode)
    assert G == 3 and eng.last_logits_cache.far.group == G
    one = Engine.load(d, far_positions="on", **kw).logits(ids, chunk=chunk, prefill_mode=mode)
    monkeypatch.setattr(me, "make_cache", lambda args, config, device, dtype, cap, model_dir=None:
                        FarReference(args, cap, 0, group=G))
    ref = Engine.load(d, **kw).logits(ids, chunk=chunk)
    assert (out - ref).abs().max().item() <= 1e-4
    assert (out - one).abs().max().item() > 1e-3            # (not the one-distance rule)
    monkeypatch.undo()
    kw["ctx"] = 32                                          # G = 1
    short = Engine.load(d, far_positions="grouped", **kw)
    assert short.cache.far.group == 1
    plain = Engine.load(d, far_positions="off", **kw).logits(ids[:32], chunk=chunk, prefill_mode=mode)
    assert (short.logits(ids[:32], chunk=chunk, prefill_mode=mode) - plain).abs().max().item() <= 1e-5


def test_generate_and_codebooks_follow_the_reference(tiny_model_dir, monkeypatch):
    """A conversation (prefill, then decode steps) with far positions: exact keys match the
    reference's greedy tokens; fitted codebooks (of unrotated keys) stay close to it."""
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(90, seed=5)
    D = 12
    kw = dict(device="cpu", ctx=256, kv="hca", tau=1.0, window=W, sinks=S, prefill_chunk=16, far_distance=D)
    exact = Engine.load(d, key_store="exact", far_positions="on", **kw).generate(ids, max_new_tokens=12,
                                                                                 ignore_eos=True)
    coded = Engine.load(d, kv_budget=0.25, centroids=16, fit_min_tokens=32, far_positions="on", **kw)
    lg = coded.logits(ids, chunk=16)
    assert coded.last_logits_cache.codebooks is not None and coded.last_logits_cache.n_encoded > 0
    monkeypatch.setattr(me, "make_cache", lambda args, config, device, dtype, cap, model_dir=None:
                        FarReference(args, cap, D))
    ref = Engine.load(d, **kw)
    assert ref.generate(ids, max_new_tokens=12, ignore_eos=True).tokens == exact.tokens
    rl = ref.logits(ids, chunk=16)
    assert (lg - rl).abs().max().item() <= 0.05 * rl.abs().max().item()


def test_auto_by_default_turns_on_past_the_trained_context(tiny_model_dir, capsys):
    d = tiny_model_dir("gqa-untied", max_position_embeddings=64)
    kw = dict(device="cpu", kv="hca", key_store="exact", window=W, sinks=S)
    assert Engine.load(d, ctx=128, **kw).cache.far                              # auto, the default
    kw["far_positions"] = "auto"
    assert Engine.load(d, ctx=128, **kw).cache.far
    assert "far positions: tokens older than the 8-token window are attended at distance 32" in capsys.readouterr().err
    assert not Engine.load(d, ctx=64, **kw).cache.far
    assert not Engine.load(d, ctx=128, **{**kw, "far_positions": "off"}).cache.far


@pytest.mark.parametrize("chunk,mode", [(1, "hca"), (7, "exact"), (7, "hca")])
def test_length_scale_equals_the_reference(tiny_model_dir, monkeypatch, capsys, chunk, mode):
    """--length-scale on (logits x max(1, log n / log N), N = 64 here; n the step's last position
    + 1): with far positions, exact keys and tau 1 the cache equals the reference with that factor;
    the first N positions are untouched, later ones change."""
    d = tiny_model_dir("gqa-untied", max_position_embeddings=64)
    ids = random_ids(150, seed=12)
    kw = dict(device="cpu", ctx=256, kv="hca", key_store="exact", tau=1.0, window=W, sinks=S, far_distance=W,
              far_positions="on")
    eng = Engine.load(d, length_scale="on", **kw)
    assert "length scaling: attention logits x log(n) / log(64)" in capsys.readouterr().err
    out = eng.logits(ids, chunk=chunk, prefill_mode=mode)
    off = Engine.load(d, **kw).logits(ids, chunk=chunk, prefill_mode=mode)
    monkeypatch.setattr(me, "make_cache", lambda args, config, device, dtype, cap, model_dir=None:
                        FarReference(args, cap, W, length_ctx=64))
    ref = Engine.load(d, **kw).logits(ids, chunk=chunk)
    assert (out - ref).abs().max().item() <= 1e-4
    first = 64 if chunk == 1 else 63         # (chunks of 7: the chunk holding position 63 ends at 63)
    assert torch.equal(out[:first], off[:first]) and (out[100:] - off[100:]).abs().max().item() > 1e-4


def test_length_scale_setting(tiny_model_dir):
    d = tiny_model_dir("gqa-untied", max_position_embeddings=64)
    kw = dict(device="cpu", kv="hca", key_store="exact", window=W, sinks=S)
    assert Engine.load(d, ctx=128, **kw).cache.length_ctx is None                     # off by default
    assert Engine.load(d, ctx=128, length_scale="auto", **kw).cache.length_ctx == 64
    assert Engine.load(d, ctx=64, length_scale="auto", **kw).cache.length_ctx is None
    with pytest.raises(MiniRunError, match="length_scale"):
        EngineConfig(length_scale="maybe")


@pytest.mark.parametrize("centroids,dtype", [(16, "float32"), (32, "float32"), (32, "bfloat16")])
def test_one_call_steps_equal_the_general_path(tiny_model_dir, centroids, dtype):   # 16: nibble pairs
    """The one-call decode steps take a single query: with far positions it is the far one, the
    ring and the token's own key turned by R(W - p). Same logits as the general path (sinks and
    store with the far query, ring with the true one), through evictions and a ring refill."""
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(80, seed=7)
    kw = dict(device="cpu", ctx=256, kv="hca", kv_budget=0.25, centroids=centroids, tau=0.9, window=W, sinks=S,
              prefill_chunk=16, fit_min_tokens=32, far_positions="on", dtype=dtype)
    gen = Engine.load(d, **kw).generate(ids, max_new_tokens=20, ignore_eos=True).tokens
    outs = []
    for fused in (True, False):
        eng = Engine.load(d, **kw)
        c = eng.cache
        c._numpy_exact_tier = fused
        calls = []
        if fused:
            real = c._one_call
            c._one_call = lambda *a, decode: (decode and calls.append(1)) or real(*a, decode=decode)
        first = eng.prefill(ids + gen[:12])[0]
        steps = [eng.step(t) for t in gen[12:]]
        eng.prefill(ids + gen[:10])                                  # a truncate: the ring refills
        steps += [eng.step(t) for t in gen[10:]]
        outs.append(torch.cat([first.reshape(1, -1)] + [x.reshape(1, -1) for x in steps]))
        assert c.far and c.n_encoded == c.n_store > 0
        assert (len(calls) > 0) == fused
    assert (outs[0] - outs[1]).abs().max().item() <= 0.02 * outs[1].abs().max().item()


def test_turn_rows_kernel():
    """kernels_cpu.turn_rows (the CPU step's turned ring) against its NumPy reference and the cache's
    torch rotation."""
    import numpy as np
    import kernels_cpu as kc
    import references as ref
    rng = np.random.default_rng(0)
    EK = rng.standard_normal((3, 20, 64)).astype(np.float32)
    args = type("A", (), {"rope_theta": 10000.0, "head_dim": 64, "rope_scaling": None})()
    inv = rope_inv_freq(args)
    ang = -1234 * inv.double()
    c, s = ang.cos().float().numpy(), ang.sin().float().numpy()
    out = kc.turn_rows(EK, 4, c, s)
    np.testing.assert_allclose(out, ref.turn_rows_ref(EK, 4, c, s), rtol=1e-5, atol=1e-5)
    assert (out[:, :4] == EK[:, :4]).all()
    want = rotate(torch.from_numpy(EK[:, 4:]), torch.full((16,), -1234), inv).numpy()
    np.testing.assert_allclose(out[:, 4:], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        kc.turn_rows(EK.astype(np.float16), 4, c, s)
    part = np.full_like(EK, 7.0)                       # end: rows [end, n) of out left as they were
    kc.turn_rows(EK, 4, c, s, out=part, end=11)
    np.testing.assert_array_equal(part[:, :11], out[:, :11])
    assert (part[:, 11:] == 7.0).all()
    with pytest.raises(ValueError):
        kc.turn_rows(EK, 4, c, s, end=3)


def test_turn_step_kernel():
    """kernels_cpu.turn_step (a far-position step's query, key and ring in one call) against
    turn_rows_ref: q and k turned whole, the ring past the sinks turned into ek_out, sinks copied."""
    import numpy as np
    import kernels_cpu as kc
    import references as ref
    rng = np.random.default_rng(1)
    q, k = (rng.standard_normal((n, 64)).astype(np.float32) for n in (9, 3))
    EK = rng.standard_normal((3, 20, 64)).astype(np.float32)
    ang = rng.uniform(-3, 3, 32)
    c, s = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    buf = np.full_like(EK, 7.0)
    qo, ko, eo = kc.turn_step(q, k, EK, 4, c, s, ek_out=buf)
    assert eo is buf
    np.testing.assert_allclose(qo, ref.turn_rows_ref(q[None], 0, c, s)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ko, ref.turn_rows_ref(k[None], 0, c, s)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(eo, ref.turn_rows_ref(EK, 4, c, s), rtol=1e-5, atol=1e-5)
    assert (eo[:, :4] == EK[:, :4]).all()
    with pytest.raises(ValueError):
        kc.turn_step(q[:, :32], k, EK, 4, c, s)


def test_cli_length_scale(tiny_model_dir, capsys):
    """--length-scale reaches the cache from generate (and says so on stderr); a bad value is a
    one-line usage error."""
    from minirun.cli.main import main
    d = str(tiny_model_dir("gqa-untied", max_position_embeddings=64))
    args = ["generate", d, "-p", "hello there " * 20, "-n", "3", "--kv", "hca", "--kv-budget", "0.5", "--window",
            "8", "--sinks", "2", "--ctx", "256", "--hca-opt", "far_positions=on"]
    try:
        main(args + ["--hca-opt", "length_scale=on"])
    except SystemExit as e:
        assert e.code in (0, None)
    assert "length scaling: attention logits x log(n) / log(64)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(args + ["--hca-opt", "length_scale=maybe"])
    assert e.value.code == 2 and "Traceback" not in capsys.readouterr().err
