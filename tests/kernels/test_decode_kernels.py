"""The fused one-token layer kernels (kernels_cpu.decode) against their NumPy references, in
float32 and bfloat16, and the bfloat16 rounding against torch's."""
import numpy as np
import pytest
import torch

import kernels_cpu as kc
from cpu_wrappers import float_to_bf16_bits
import references as ref
from references import bf16_bits_to_float_ref


def bf16_bits(a) -> np.ndarray:
    return torch.as_tensor(a).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def as_float(a) -> np.ndarray:
    return bf16_bits_to_float_ref(a) if a.dtype == np.uint16 else a.astype(np.float32)


def special_floats(rng) -> np.ndarray:
    """Random bit patterns of every magnitude, exact halfway cases, +-0, inf, NaN, subnormals."""
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2**16, 2000, dtype=np.uint64).astype(np.uint32) << 16) | 0x8000
    fixed = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 3.4e38, -3.4e38, 1.0, 1.00390625],
                     np.float32).view(np.uint32)
    return np.concatenate([bits, ties, fixed]).view(np.float32)


def test_float_to_bf16_matches_reference_and_torch():
    f = special_floats(np.random.default_rng(0))
    got = float_to_bf16_bits(f)
    nan = np.isnan(f)
    assert np.array_equal(got[~nan], ref.float_to_bf16_bits_ref(f)[~nan])
    assert np.array_equal(got[~nan], bf16_bits(f)[~nan])          # torch rounds to nearest even too
    assert np.isnan(bf16_bits_to_float_ref(got[nan])).all()


def layer(rng, dtype, D=64, Hq=4, Hkv=2, hd=16, F=96):
    """Random weights of one small GQA layer in `dtype` ("float32" or "bfloat16" bits)."""
    def w(*shape, scale=1.0):
        a = (rng.standard_normal(shape) * scale).astype(np.float32)
        return bf16_bits(a) if dtype == "bfloat16" else a
    return dict(x=w(D), o=w(Hq * hd), n1=w(D), n2=w(D), wqkv=w((Hq + 2 * Hkv) * hd, D, scale=D ** -0.5), wo=w(D, Hq * hd, scale=0.2),
                wgu=w(2 * F, D, scale=D ** -0.5), wdown=w(D, F, scale=0.2), Hq=Hq, Hkv=Hkv, hd=hd)


def close(got, want, dtype):
    """float32: summation order only; bfloat16: one rounding step of the stored result."""
    g, w = as_float(got), as_float(want)
    scale = np.abs(w).max()
    rtol = 2.0 ** -7 if dtype == "bfloat16" else 1e-5
    assert g.dtype == w.dtype and g.shape == w.shape
    assert np.all(np.abs(g - w) <= rtol * np.abs(w) + rtol * 1e-2 * scale), np.abs(g - w).max()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("pos", [0, 7, 100000, 4194303])
def test_attn_in_vs_ref(dtype, pos):
    p = layer(np.random.default_rng(pos), dtype)
    inv_freq = 10000.0 ** (-np.arange(0, p["hd"], 2) / p["hd"])
    args = (p["x"], p["n1"], 1e-5, p["wqkv"], pos, inv_freq, p["Hq"] + p["Hkv"], p["hd"])
    got = kc.attn_in(*args)
    close(got, ref.attn_in_ref(*args), dtype)
    assert got.dtype == p["wqkv"].dtype


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bias,norms", [(True, False), (False, True), (True, True)])
def test_attn_in_with_a_bias_and_heads_norms_vs_ref(dtype, bias, norms):
    """Qwen2's QKV bias and Qwen3's heads' norms (q heads with the first, k heads with the second),
    for one token and for a batch of three at their own positions."""
    rng = np.random.default_rng(11)
    p = layer(rng, dtype)
    R, hd = (p["Hq"] + 2 * p["Hkv"]) * p["hd"], p["hd"]
    inv_freq = 10000.0 ** (-np.arange(0, hd, 2) / hd)
    extra = dict(bias=rng.standard_normal(R).astype(np.float32) if bias else None,
                 head_norms=rng.uniform(0.5, 1.5, (2, hd)).astype(np.float32) if norms else None, n_q=p["Hq"])
    args = (p["x"], p["n1"], 1e-5, p["wqkv"], 123, inv_freq, p["Hq"] + p["Hkv"], hd)
    got = kc.attn_in(*args, **extra)
    want = ref.attn_in_ref(*args, **extra)
    close(got, want, dtype)
    assert np.abs(as_float(got) - as_float(kc.attn_in(*args))).max() > 1e-2     # (the extras change the result)
    X, pos = np.stack([p["x"], p["n1"], p["x"][::-1].copy()]), np.array([0, 5, 9000])
    rows = kc.attn_in(X, p["n1"], 1e-5, p["wqkv"], pos, inv_freq, p["Hq"] + p["Hkv"], hd, **extra)
    for b in range(3):
        close(rows[b], ref.attn_in_ref(X[b], *args[1:4], pos[b], *args[5:], **extra), dtype)


def test_attn_in_refuses_extras_of_the_wrong_size():
    p = layer(np.random.default_rng(0), "float32")
    args = (p["x"], p["n1"], 1e-5, p["wqkv"], 3, np.ones(p["hd"] // 2), p["Hq"] + p["Hkv"], p["hd"])
    with pytest.raises(ValueError, match="bias of 5 rows"):
        kc.attn_in(*args, bias=np.ones(5, np.float32))
    with pytest.raises(ValueError, match="heads' norms"):
        kc.attn_in(*args, head_norms=np.ones((2, p["hd"]), np.float32))          # (n_q missing)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attn_out_vs_ref(dtype):
    p = layer(np.random.default_rng(1), dtype)
    args = (p["x"], p["o"], p["wo"], p["n2"], 1e-5, p["wgu"], p["wdown"])
    out = np.empty_like(p["x"])
    assert kc.attn_out(*args, out=out) is out
    close(out, ref.attn_out_ref(*args), dtype)


def gemma_extras(rng, D, post=True, act="gelu_pytorch_tanh"):
    """attn_out's Gemma 3 arguments: norms after the attention and the MLP (around 1, as Gemma's
    (1 + w) weights are) and the MLP's gate."""
    return dict(post_norms=rng.uniform(0.5, 1.5, (2, D)).astype(np.float32) if post else None, act=act)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("post,act", [(True, "gelu_pytorch_tanh"), (True, "silu"), (False, "gelu_pytorch_tanh")])
def test_attn_out_with_post_norms_and_geglu_vs_ref(dtype, post, act):
    """Gemma 3's half of the layer (the norms after attention and MLP, GeGLU), each trait alone and
    together, for one token and a batch of three (each row its own token)."""
    rng = np.random.default_rng(12)
    p = layer(rng, dtype)
    extra = gemma_extras(rng, p["x"].shape[0], post, act)
    args = (p["x"], p["o"], p["wo"], p["n2"], 1e-5, p["wgu"], p["wdown"])
    got = kc.attn_out(*args, **extra)
    close(got, ref.attn_out_ref(*args, **extra), dtype)
    assert np.abs(as_float(got) - as_float(kc.attn_out(*args))).max() > 1e-2     # (the extras change the result)
    X = np.stack([p["x"], p["n1"], p["x"][::-1].copy()])
    O = np.stack([p["o"], p["o"][::-1].copy(), layer(rng, dtype)["o"]])
    rows = kc.attn_out(X, O, *args[2:], **extra)
    assert rows.shape == X.shape and rows.dtype == X.dtype
    for b in range(3):
        close(rows[b], ref.attn_out_ref(X[b], O[b], *args[2:], **extra), dtype)
        assert np.array_equal(rows[b], kc.attn_out(X[b], O[b], *args[2:], **extra))


def test_attn_out_ref_with_post_norms_and_geglu_is_torchs_layer():
    """The reference's Gemma 3 half-layer against the same written in torch (float64): F.gelu's tanh
    form, each norm after its projection, before its residual add."""
    rng = np.random.default_rng(13)
    p = layer(rng, "float32")
    extra = gemma_extras(rng, p["x"].shape[0])
    t = {k: torch.from_numpy(np.asarray(v)).double() for k, v in p.items() if isinstance(v, np.ndarray)}
    pn = torch.from_numpy(extra["post_norms"]).double()

    def norm(v, w):
        return v / torch.sqrt((v * v).mean() + 1e-5) * w
    x1 = t["x"] + norm(t["wo"] @ t["o"], pn[0])
    g, u = (t["wgu"] @ norm(x1, t["n2"])).chunk(2)
    want = x1 + norm(t["wdown"] @ (torch.nn.functional.gelu(g, approximate="tanh") * u), pn[1])
    got = ref.attn_out_ref(p["x"], p["o"], p["wo"], p["n2"], 1e-5, p["wgu"], p["wdown"], **extra)
    assert np.allclose(got, want.float().numpy(), rtol=1e-6, atol=1e-6)


def test_attn_out_refuses_bad_post_norms_and_activations():
    p = layer(np.random.default_rng(0), "float32")
    args = (p["x"], p["o"], p["wo"], p["n2"], 1e-5, p["wgu"], p["wdown"])
    D = p["x"].shape[0]
    with pytest.raises(ValueError, match="post_norms must be float32"):
        kc.attn_out(*args, post_norms=np.ones((1, D), np.float32))
    with pytest.raises(ValueError, match="post_norms must be float32"):
        kc.attn_out(*args, post_norms=np.ones((2, D + 1), np.float32))
    with pytest.raises(ValueError, match="act must be one of silu, gelu_pytorch_tanh"):
        kc.attn_out(*args, act="relu")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_norm_gemv_vs_ref(dtype):
    p = layer(np.random.default_rng(2), dtype)
    got = kc.norm_gemv(p["x"], p["n2"], 1e-5, p["wgu"])
    want = ref.norm_gemv_ref(p["x"], p["n2"], 1e-5, p["wgu"])
    assert got.dtype == np.float32
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_rows_not_a_multiple_of_the_task_size_and_nan():
    rng = np.random.default_rng(3)
    x, n = rng.standard_normal(24).astype(np.float32), np.ones(24, np.float32)
    w = rng.standard_normal((37, 24)).astype(np.float32)
    assert np.allclose(kc.norm_gemv(x, n, 1e-6, w), ref.norm_gemv_ref(x, n, 1e-6, w), rtol=1e-5, atol=1e-5)
    x[5] = np.nan
    assert np.isnan(kc.norm_gemv(x, n, 1e-6, w)).all()


def test_mixed_dtypes_rejected():
    p = layer(np.random.default_rng(4), "float32")
    with pytest.raises(ValueError, match="all be float32 or all bfloat16"):
        kc.attn_out(bf16_bits(p["x"]), p["o"], p["wo"], p["n2"], 1e-5, p["wgu"], p["wdown"])



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (9, 3), (8, 1), (16, 8)])
@pytest.mark.parametrize("n", [1, 63, 191, 512, 1537, 5000])   # under 192: the serial kernel
def test_dense_attend_vs_ref(dtype, Hq, Hkv, n):
    rng = np.random.default_rng(n + Hq)
    d, cap, scale = 64, n + 37, 0.125
    q = (rng.standard_normal((Hq, d)) * 4).astype(np.float32)
    K, V = (rng.standard_normal((2, Hkv, cap, d)) * 1.5).astype(np.float32)
    K[:, n:], V[:, n:] = np.nan, np.nan             # slots past n must never be read
    if dtype == "bfloat16":                         # the engine's bfloat16 step: q, K, V and out as bits
        q, K, V = bf16_bits(q), bf16_bits(K), bf16_bits(V)
    got = kc.dense_attend(q, K, V, n, scale)
    want = ref.dense_attend_ref(q, K, V, n, scale)
    assert got.dtype == np.float32 and got.shape == (Hq, d)
    if dtype == "bfloat16":                         # out in bfloat16: the float32 result, rounded
        out = np.empty((Hq, d), np.uint16)
        assert kc.dense_attend(q, K, V, n, scale, out=out) is out
        assert np.array_equal(out, float_to_bf16_bits(got).reshape(Hq, d))
    # float32 scores and sums of n terms against a float64 reference, relative to the values' size
    atol = 2e-6 * np.nanmax(np.abs(as_float(V))) * max(1.0, (n / 64) ** 0.5)
    assert np.allclose(got, want, rtol=1e-5, atol=atol), np.abs(got - want).max()


def test_dense_attend_rejects_bad_arguments():
    q = np.zeros((6, 8), np.float32)
    K = np.zeros((4, 10, 8), np.float32)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        kc.dense_attend(q, K, K, 5)                  # 6 query heads over 4 kv-heads
    with pytest.raises(ValueError, match="n <= 10"):
        kc.dense_attend(q[:4], K, K, 11)


def test_bfloat16_weights_need_even_columns():
    p = layer(np.random.default_rng(5), "bfloat16")
    with pytest.raises(ValueError, match="even number of columns"):
        kc.norm_gemv(p["x"][:63], p["n2"][:63], 1e-5, np.ascontiguousarray(p["wgu"][:, :63]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_on_rows_give_each_row_its_own_result(dtype):
    """B tokens of B sequences in one call (the weights read once): row b equals that token alone,
    each at its own position."""
    rng = np.random.default_rng(5)
    p = layer(rng, dtype)
    B = 3
    X = np.stack([layer(rng, dtype)["x"] for _ in range(B)])
    O = np.stack([layer(rng, dtype)["o"] for _ in range(B)])
    pos = np.array([0, 9, 70000])
    inv_freq = 10000.0 ** (-np.arange(0, p["hd"], 2) / p["hd"])
    rot = p["Hq"] + p["Hkv"]
    got_in = kc.attn_in(X, p["n1"], 1e-5, p["wqkv"], pos, inv_freq, rot, p["hd"])
    got_out = kc.attn_out(X, O, p["wo"], p["n2"], 1e-5, p["wgu"], p["wdown"])
    got_head = kc.norm_gemv(X, p["n2"], 1e-5, p["wgu"])
    assert got_in.shape == (B, p["wqkv"].shape[0]) and got_out.shape == X.shape and got_head.shape == (B, 192)
    for b in range(B):
        assert np.array_equal(got_in[b], kc.attn_in(X[b], p["n1"], 1e-5, p["wqkv"], pos[b], inv_freq, rot, p["hd"]))
        assert np.array_equal(got_out[b], kc.attn_out(X[b], O[b], p["wo"], p["n2"], 1e-5, p["wgu"], p["wdown"]))
        assert np.array_equal(got_head[b], kc.norm_gemv(X[b], p["n2"], 1e-5, p["wgu"]))
        close(got_in[b], ref.attn_in_ref(X[b], p["n1"], 1e-5, p["wqkv"], pos[b], inv_freq, rot, p["hd"]), dtype)
