"""kernels_cuda/layer.cu (the small ops of a layer for one GPU decode token) against the torch ops
they replace (minirun.model.ops), on the CPU emulator and, with a GPU, on the device; and a model's
decode steps through them against the torch path.

Tolerances: float32 1e-5 relative (+1e-6); bfloat16: the kernels round where torch rounds, so
results agree up to float32 summation order (rms statistics): at most one bfloat16 ulp (2^-7
relative) on 1% of the elements, none further.
"""
from __future__ import annotations

import shutil

import pytest
import torch

import kernels_cuda
from cuda_checks import Env
from kernels_cuda import layer as kl
from minirun.model import ops
from shared import decode_launches

HAVE_GPU = kernels_cuda.available()
emu_only = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (CPU kernel emulator)")
gpu_only = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device / cupy")
DTYPES = [torch.float32, torch.bfloat16]


def check_layer_ops(env, dtype, rows=3, D=96, hd=16, n_heads=5, n_rot=4, F=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D, generator=g).to(dtype)
    r = torch.randn(rows, D, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    qkv = torch.randn(rows, n_heads * hd, generator=g).to(dtype)
    ang = torch.rand(1, hd // 2, generator=g, dtype=torch.float64) * 40
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    gu = torch.randn(rows, 2 * F, generator=g).to(dtype)
    dev = env.device
    with env.ctx():
        y = kl.rms_norm(x.to(dev), w.to(dev), 1e-5)
        s, y2 = kl.add_rms_norm(x.to(dev), r.to(dev), w.to(dev), 1e-5)
        rot = kl.rope_(qkv.clone().to(dev), n_rot, hd, ops.rope_table(cos, sin)[0].to(dev))
        sm = kl.silu_mul(gu.to(dev))
    q = qkv.view(rows, n_heads, hd)
    want = {
        "rms_norm": (y, ops.rms_norm(x, w, 1e-5)),
        "add": (s, x + r),
        "add_rms_norm": (y2, ops.rms_norm(x + r, w, 1e-5)),
        "rope": (rot.view(rows, n_heads, hd), torch.cat([ops.apply_rope(q[:, :n_rot], cos, sin), q[:, n_rot:]], 1)),
        "silu_mul": (sm, torch.nn.functional.silu(gu[:, :F]) * gu[:, F:]),
    }
    for name, (got, ref) in want.items():
        got, ref = got.cpu().float(), ref.float()
        assert got.shape == ref.shape, name
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=name)
        else:
            off = (got - ref).abs() > 0
            assert ((got - ref).abs() <= 2.0**-7 * ref.abs() + 1e-6).all(), name
            assert off.float().mean().item() <= 0.01, (name, off.float().mean().item())


@emu_only
@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_emu_layer_ops(order, dtype):
    check_layer_ops(Env("emu", order=order), dtype)


@gpu_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_layer_ops(dtype):
    check_layer_ops(Env("gpu"), dtype, rows=4, D=576, hd=64, n_heads=15, n_rot=12, F=1536)


def check_rope_store(env, dtype, Hq=6, Hkv=2, d=16, cap=20, pos=7, n_live=12, seed=1):
    """layer.rope_store against rope_ + the scale + the cache writes it replaces: q turned and
    scaled in float32, k turned and v copied into row pos of K, V (no other row touched), the
    live mask written only when asked."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(1, (Hq + 2 * Hkv) * d, generator=g).to(dtype)
    ang = torch.rand(1, d // 2, generator=g, dtype=torch.float64) * 40
    cs = ops.rope_table(ang.cos().to(dtype), ang.sin().to(dtype))[0]
    K0, V0 = (torch.randn(Hkv, cap, d, generator=g).to(dtype) for _ in range(2))
    scale = 1 / d ** 0.5
    dev = env.device
    with env.ctx():
        K, V, row = K0.clone().to(dev), V0.clone().to(dev), qkv.clone().to(dev).view(Hq + 2 * Hkv, d)
        qs = torch.full((Hq, d), float("nan"), device=dev)
        live = torch.full((cap,), 7, dtype=torch.uint8, device=dev)
        kl.rope_store(row[:Hq], row[Hq:Hq + Hkv], row[Hq + Hkv:], cs.to(dev), torch.tensor([pos], device=dev), scale,
                      qs, K, V, live, n_live)
        kl.rope_store(row[:Hq], row[Hq:Hq + Hkv], row[Hq + Hkv:], cs.to(dev), torch.tensor([pos + 1], device=dev),
                      scale, qs, K, V, live, 0)              # (no mask: live stays as the first call left it)
        turned = kl.rope_(qkv.clone().to(dev), Hq + Hkv, d, cs.to(dev)).view(Hq + 2 * Hkv, d).cpu()
    K, V, qs, live = K.cpu(), V.cpu(), qs.cpu(), live.cpu()
    torch.testing.assert_close(qs, turned[:Hq].float() * scale, rtol=1e-6, atol=0)
    for p in (pos, pos + 1):
        assert torch.equal(K[:, p], turned[Hq:Hq + Hkv]) and torch.equal(V[:, p], qkv.view(-1, d)[Hq + Hkv:])
    others = [i for i in range(cap) if i not in (pos, pos + 1)]
    assert torch.equal(K[:, others], K0[:, others]) and torch.equal(V[:, others], V0[:, others])
    assert live[:n_live].tolist() == [int(i <= pos) for i in range(n_live)] and (live[n_live:] == 7).all()


@emu_only
@pytest.mark.parametrize("order", ["forward", "random"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_emu_rope_store(order, dtype):
    check_rope_store(Env("emu", order=order), dtype)


@gpu_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_rope_store(dtype):
    check_rope_store(Env("gpu"), dtype, Hq=9, Hkv=3, d=64, cap=9000, pos=8190, n_live=8192)


def test_wrong_dtype_is_refused():
    with pytest.raises(TypeError):
        kl.rms_norm(torch.zeros(2, 4, dtype=torch.float16), torch.zeros(4, dtype=torch.float16), 1e-5)


@emu_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_emu_model_decode_through_layer_kernels(tiny_model_dir, dtype):
    """Decode steps of a model whose layers take the GPU one-token path (forced onto the CPU,
    kernels on the emulator) against the same model's torch path: same greedy tokens, logits close."""
    import cuda_emu
    from minirun import Engine
    d = tiny_model_dir("gqa-untied")
    ids = list(range(5, 40))
    ref = Engine.load(d, device="cpu", dtype=dtype, ctx=128)
    eng = Engine.load(d, device="cpu", dtype=dtype, ctx=128)
    assert eng.model.use_cuda_layer_kernels(force=True)
    # the reference without the CPU's fused kernels either: the plain torch ops
    ref.model.use_torch_ops()
    a = ref.generate(ids, max_new_tokens=6, ignore_eos=True)
    with cuda_emu.emulated() as be:
        b = eng.generate(ids, max_new_tokens=6, ignore_eos=True)
        lb = torch.stack([eng.step(t).reshape(-1) for t in b.tokens[:3]])
    names = {x[0] for x in be.launches}
    assert {f"{k}_{'f32' if dtype == 'float32' else 'bf16'}" for k in ("rms_norm", "add_rms_norm", "rope", "silu_mul")} <= names
    la = torch.stack([ref.step(t).reshape(-1) for t in a.tokens[:3]])
    assert a.tokens == b.tokens
    tol = 1e-4 if dtype == "float32" else 0.05
    assert (la - lb).abs().max().item() <= tol


@gpu_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_model_decode_layer_kernels_vs_torch_ops(tiny_model_dir, dtype, monkeypatch):
    """On the GPU: decode with the layer kernels (the default) against torch's ops (ops.CUDA_LAYER_KERNELS off)."""
    from minirun import Engine
    from minirun.model import ops
    d = tiny_model_dir("gqa-untied")
    ids = list(range(5, 40))
    eng = Engine.load(d, device="cuda", dtype=dtype, ctx=128)
    assert eng.model.cuda_decode
    monkeypatch.setattr(ops, "CUDA_LAYER_KERNELS", False)
    ref = Engine.load(d, device="cuda", dtype=dtype, ctx=128)
    assert not ref.model.cuda_decode
    a, b = ref.generate(ids, max_new_tokens=6, ignore_eos=True), eng.generate(ids, max_new_tokens=6, ignore_eos=True)
    la = torch.stack([ref.step(t).reshape(-1).cpu() for t in a.tokens[:3]])
    lb = torch.stack([eng.step(t).reshape(-1).cpu() for t in b.tokens[:3]])
    assert a.tokens == b.tokens
    assert (la - lb).abs().max().item() <= (1e-4 if dtype == "float32" else 0.05)


@emu_only
def test_count_launches_script(capsys):
    """scripts/count_launches.py: the layer kernels cut a layer's launches (dense 41 -> 13 with the
    GPU's attention, HCA 50 -> 18), and they stay bounded (a new op in the decode path shows up
    here); with CUDA graphs a token is a few launches, the dense graph's layer 10 (RoPE, the scale,
    the cache writes and the mask in one launch; the residual added by the next norm), HCA's 17
    (RoPE in decode_prep)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "scripts" / "count_launches.py"
    spec = importlib.util.spec_from_file_location("count_launches", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.main(["--depth", "200"])

    def per_layer(name):
        return r[name]["torch_per_layer"] + r[name]["kernels_cuda_per_layer"]
    assert per_layer("dense, layer kernels on") <= 13 < per_layer("dense, layer kernels off")
    assert per_layer("dense, cuda graphs") <= 10 and per_layer("hca, cuda graphs") <= 17
    assert per_layer("hca, layer kernels on") <= 18 < per_layer("hca, layer kernels off")
    assert r["hca, layer kernels on"]["kernels_cuda_per_layer"] == 4 + decode_launches(0.9)["kernels_cuda"]
    assert "| hca, layer kernels on |" in capsys.readouterr().out
    # CUDA graphs: a token is one replay, the copies of its inputs and the logits' clone
    assert r["dense, cuda graphs"]["per_token"] == 3 and r["hca, cuda graphs"]["per_token"] == 4
    # (the graph's step leaves RoPE to decode_prep: one launch less than the eager step)
    assert r["hca, cuda graphs"]["kernels_cuda_per_layer"] == r["hca, layer kernels on"]["kernels_cuda_per_layer"] - 1
