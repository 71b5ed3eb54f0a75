"""kernels_cuda.dense_decode (the dense cache's one-query attention on a GPU) against a float64
softmax reference, emulated on the CPU (several thread orders) and on a GPU; and DenseCache's decode
steps (eager and the graph's attend_at) through it against dense_attention.

Tolerances: float32 K, V 1e-5 + 1e-5 |ref| (float32 sums of <= 5000 terms vs float64); bfloat16
K, V against the reference on the same rounded inputs, the output within one bfloat16 rounding.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import kernels_cuda
from cuda_checks import Env, np_
from kernels_cuda import layer as kl
from kernels_cuda.dense_decode import DenseDecodeAttention
from minirun.model import ops
from minirun.kv.dense import DenseCache, dense_attention

HAVE_GPU = kernels_cuda.available()
emu_only = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (CPU kernel emulator)")
gpu_only = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device / cupy")


def reference(q, K, V, live):
    """q [Hq, d], K, V [Hkv, n, d] float64, live bool [n] -> o [Hq, d]."""
    Hq, d = q.shape
    g = Hq // K.shape[0]
    o = np.zeros((Hq, d))
    for h in range(Hq):
        s = K[h // g, live] @ q[h] / np.sqrt(d)
        p = np.exp(s - s.max())
        o[h] = p @ V[h // g, live] / p.sum()
    return o


def check_attention(env, n, cap, dtype, masked, seed=0, Hq=9, Hkv=3, d=64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(Hq, d, generator=g) * 2
    K = (torch.randn(Hkv, cap, d, generator=g)).to(dtype)
    V = torch.randn(Hkv, cap, d, generator=g).to(dtype)
    pos = int(torch.randint(0, n, (1,), generator=g)) if masked else n - 1
    live = np.arange(n) <= pos
    with env.ctx():
        attn = DenseDecodeAttention(env.device, Hq, Hkv, d, cap, dtype)
        attn.os.fill_(float("nan"))                  # partials not written would poison the output
        o = attn(q.to(dtype).to(env.device), K.to(env.device), V.to(env.device), n,
                 torch.tensor([pos], device=env.device) if masked else None)
    want = reference(q.to(dtype).double().numpy(), K[:, :n].double().numpy(), V[:, :n].double().numpy(), live)
    assert o.dtype == dtype and o.shape == (Hq, d)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    np.testing.assert_allclose(np_(o), want, rtol=tol, atol=tol)


@emu_only
@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
@pytest.mark.parametrize("n,cap", [(1, 8), (300, 300), (1500, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emu_dense_decode_attention(order, n, cap, dtype):
    check_attention(Env("emu", order=order), n, cap, dtype, masked=False)


@emu_only
def test_emu_dense_decode_attention_many_splits():
    """A GPU's SM count (132): fewer keys than the capacity can take more splits than the capacity
    does (partial buffers sized by the capacity overflowed at 5000 of 8192 keys)."""
    check_attention(Env("emu", order="random", num_sms=132), 5000, 8192, torch.float32, masked=False)
    from kernels_cuda.launch import _attend_split, _attend_split_max
    for cap in (1, 300, 8192, 131072, 1 << 20):
        worst = max(_attend_split(n, 9, 132)[1] for n in range(1, cap + 1, max(1, cap // 5000)))
        assert worst <= _attend_split_max(cap, 9, 132)


@emu_only
@pytest.mark.parametrize("seed", [0, 1])
def test_emu_dense_decode_attention_masked(seed):
    check_attention(Env("emu", order="random"), 1200, 1500, torch.bfloat16, masked=True, seed=seed)


@gpu_only
@pytest.mark.parametrize("n,cap", [(1, 8), (300, 300), (5000, 8192), (70000, 70000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_gpu_dense_decode_attention(n, cap, dtype, masked):
    check_attention(Env("gpu"), n, cap, dtype, masked)


def check_cache_steps(env, dtype):
    """DenseCache's one-token attend (eager) and attend_at (a graph's step; also with RoPE left to
    its first launch) through the kernels agree with dense_attention, and write k, v at the position."""
    L, Hkv, Hq, d, cap = 2, 3, 9, 64, 700
    g = torch.Generator().manual_seed(3)
    with env.ctx():
        cache = DenseCache(L, Hkv, d, cap, dtype, env.device)
        cache._k_np = None                                   # (the CPU's own step otherwise)
        if env.kind == "emu":
            cache._gpu_attn = DenseDecodeAttention(env.device, Hq, Hkv, d, cap, dtype)
        T = 500
        kk = torch.randn(T, Hkv, d, generator=g).to(dtype).to(env.device)
        cache.attend(0, torch.randn(T, Hq, d, generator=g).to(dtype).to(env.device), kk, kk)
        cache.advance(T)
        q, k, v = (torch.randn(1, h, d, generator=g).to(dtype).to(env.device) for h in (Hq, Hkv, Hkv))
        o = cache.attend(0, q, k, v).clone()          # (a view of the kernel's persistent output)
        want = dense_attention(q.float(), cache.k[0, :, :T + 1].float(), cache.v[0, :, :T + 1].float(), T)
        o_at = cache.attend_at(1, q, k, v, torch.tensor([T], device=env.device), 512 + 64).clone()
        want_at = dense_attention(q.float(), cache.k[1, :, :T + 1].float(), cache.v[1, :, :T + 1].float(), T)
        # the next token with RoPE left to the cache (rotates_at): q, k unturned, cs their angles;
        # layer 0 (its launch writes the live mask the later layers of the token read)
        assert cache.rotates_at(Hq, dtype)
        ang = torch.rand(1, d // 2, generator=g, dtype=torch.float64) * 40
        cs = ops.rope_table(ang.cos().to(dtype), ang.sin().to(dtype))[0].to(env.device)
        qu, ku, vu = (torch.randn(1, h, d, generator=g).to(dtype).to(env.device) for h in (Hq, Hkv, Hkv))
        o_rot = cache.attend_at(0, qu, ku, vu, torch.tensor([T + 1], device=env.device), 512 + 64, rope=cs)
        turned = kl.rope_(torch.cat([qu[0], ku[0]]).reshape(1, -1).clone(), Hq + Hkv, d, cs).view(Hq + Hkv, d)
        want_rot = dense_attention(turned[None, :Hq].float(), cache.k[0, :, :T + 2].float(), cache.v[0, :, :T + 2].float(),
                                   T + 1)
    assert cache._gpu_decode(Hq, dtype) is not None
    assert torch.equal(cache.k[1, :, T].cpu(), k[0].cpu()) and torch.equal(cache.v[1, :, T].cpu(), v[0].cpu())
    assert torch.equal(cache.k[0, :, T + 1].cpu(), turned[Hq:].cpu()) and torch.equal(cache.v[0, :, T + 1].cpu(), vu[0].cpu())
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    np.testing.assert_allclose(np_(o), np_(want), rtol=tol, atol=tol)
    np.testing.assert_allclose(np_(o_at), np_(want_at), rtol=tol, atol=tol)
    np.testing.assert_allclose(np_(o_rot), np_(want_rot), rtol=tol, atol=tol)


@emu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emu_dense_cache_decode(dtype):
    check_cache_steps(Env("emu", order="random"), dtype)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_dense_cache_decode(dtype):
    check_cache_steps(Env("gpu"), dtype)
