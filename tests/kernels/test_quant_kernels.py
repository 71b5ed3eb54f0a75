"""kernels_cpu.quant (GEMV, dequantization) against its NumPy reference, and that reference against
the `gguf` package's own dequantizers, for every block format minirun computes with."""
import numpy as np
import pytest

import kernels_cpu as kc
from kernels_cpu import quant as kq, quant_rows as kr, quant_intdot
import references as ref
from references.quant import dequantize_ref, gemv_ref
from minirun.quant.formats import FORMATS, dequantize_blocks, from_planes, kernel_planes, to_planes
from shared import random_blocks


FMTS = list(FORMATS)



def tiles(fmt, blocks, cols):
    f = FORMATS[fmt]
    return kq.tiles_from_planes(fmt, kernel_planes(f, to_planes(f, blocks, cols)))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rows,cols", [(64, 256), (100, 512), (3, 768)])
def test_planes_roundtrip_and_reference_vs_gguf(fmt, rows, cols):
    rng = np.random.default_rng(rows + cols)
    blocks = random_blocks(rng, fmt, rows, cols)
    f = FORMATS[fmt]
    assert np.array_equal(from_planes(f, to_planes(f, blocks, cols)), blocks)          # lossless split
    want = dequantize_blocks(blocks, fmt, cols)
    w = tiles(fmt, blocks, cols)
    assert w.rows == rows and kq.in_features(w) == cols
    np.testing.assert_allclose(dequantize_ref(w), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_kernels_vs_reference(fmt):
    rng = np.random.default_rng(1)
    rows, cols = 130, 512
    w = tiles(fmt, random_blocks(rng, fmt, rows, cols), cols)
    want = dequantize_ref(w)
    np.testing.assert_allclose(kr.dequantize_rows(w, 0, rows), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(kr.dequantize_rows(w, 70, 129), want[70:129], rtol=1e-6, atol=1e-7)
    ids = np.array([129, 0, 64, 5, 5])
    np.testing.assert_allclose(kr.dequantize_ids(w, ids), want[ids], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError):
        kr.dequantize_ids(w, np.array([rows]))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rows", [1, 64, 200])
def test_gemv_vs_reference(fmt, rows):
    rng = np.random.default_rng(rows)
    cols = 768
    w = tiles(fmt, random_blocks(rng, fmt, rows, cols), cols)
    x = rng.standard_normal(cols).astype(np.float32)
    got = kq.gemv(w, x)
    want = gemv_ref(w, x)
    scale = np.abs(dequantize_ref(w)).sum(1) * np.abs(x).max()          # bound of float32 rounding per row
    xq = {"avx2": quant_intdot.XQ_AVX2, "avx512vnni": quant_intdot.XQ_VNNI}.get(ISA)
    tol = 1e-5 + (0 if xq is None else 1 / (2 * xq))                  # (+ x's quantization: quant_intdot)
    assert got.shape == (rows,)
    assert np.all(np.abs(got - want) <= tol * scale + 1e-6), np.abs(got - want).max()


ISA = quant_intdot.isa()
GEMVS = {kr.gemm_portable: None}                  # kernel: its x quantization's XQ (None: float32)
if ISA in ("avx2", "avx512vnni"):
    GEMVS[quant_intdot.gemm_avx2] = quant_intdot.XQ_AVX2
if ISA == "avx512vnni":
    GEMVS[quant_intdot.gemm_vnni] = quant_intdot.XQ_VNNI


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("kernel", list(GEMVS), ids=lambda k: k.py_func.__name__)
@pytest.mark.parametrize("rows", [200, 64, 70])
def test_gemv_kernels_within_stated_bound(fmt, kernel, rows):
    """Every GEMV this CPU runs, every format, against the float64 reference: the integer ones within
    their stated bound (x quantized per block to XQ levels: sum_b max|x_b| sum_i |w_bi| / (2 XQ),
    kernels_cpu.quant_intdot), the portable one within float32 rounding. Blocks of very different
    size, a zero block and a NaN show that the scale is per block."""
    rng = np.random.default_rng(rows)
    cols = 768
    w = tiles(fmt, random_blocks(rng, fmt, rows, cols), cols)
    x = rng.standard_normal(cols).astype(np.float32) * np.repeat(10.0 ** rng.uniform(-3, 3, cols // 32), 32)
    x[64:96] = 0
    want = gemv_ref(w, x)
    W = np.abs(dequantize_ref(w)).reshape(rows, -1, 32)
    mass = (W.sum(2) * np.abs(x).reshape(-1, 32).max(1)).sum(1)
    xq = GEMVS[kernel]
    got = np.empty(rows, np.float32)
    kernel(w, x[None], got[None])
    if xq is None:                                      # float32 products: rounding only
        assert np.all(np.abs(got - want) <= 2e-6 * mass)
    else:
        err = np.abs(got - want)
        assert np.all(err <= mass / (2 * xq) + 1e-6 * mass), (err / mass).max()
        assert err.max() > 0                             # (x was quantized: not the float path)
    x[5] = np.nan
    kernel(w, x[None], got[None])
    assert np.isnan(got).all()


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("kernel", list(GEMVS), ids=lambda k: k.py_func.__name__)
def test_gemm_rows_each_equal_their_own_gemv(fmt, kernel):
    """B rows of x through one call (B sequences' decode tokens, the weights read once) give each
    row exactly what that row alone gives: x is quantized per row, the sums run in the same order."""
    rng = np.random.default_rng(11)
    rows, cols = 130, 512
    w = tiles(fmt, random_blocks(rng, fmt, rows, cols), cols)
    X = rng.standard_normal((3, cols)).astype(np.float32) * np.array([[1.0], [1e-3], [50.0]], np.float32)
    got = np.empty((3, rows), np.float32)
    kernel(w, X, got)
    for b in range(3):
        alone = np.empty((1, rows), np.float32)
        kernel(w, X[b:b + 1].copy(), alone)
        assert np.array_equal(got[b], alone[0])
    assert np.allclose(got, np.stack([gemv_ref(w, x) for x in X]), rtol=1e-2, atol=1e-2 * np.abs(got).max())


def test_gemv_is_the_best_one_this_cpu_runs():
    want = {"avx512vnni": quant_intdot.gemm_vnni, "avx2": quant_intdot.gemm_avx2}.get(ISA)
    assert kq._GEMM_INT is want


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantized_float_matrix_close_to_float(fmt):
    """gguf's quantizer then our kernel: close to the float GEMV (sanity of the whole chain)."""
    from minirun.quant.formats import quantize
    rng = np.random.default_rng(2)
    wf = rng.standard_normal((96, 256)).astype(np.float32)
    x = rng.standard_normal(256).astype(np.float32)
    w = tiles(fmt, quantize(wf, fmt), 256)
    err = np.abs(kq.gemv(w, x) - wf @ x).max() / np.abs(wf @ x).max()
    assert err < {"Q8_0": 0.01, "Q4_0": 0.15, "Q4_1": 0.15}[fmt]


def quant_layer(rng, fmts, D=256, Hq=4, Hkv=2, hd=64, F=512):
    """One layer's matrices quantized (random blocks of fmts[i]) with their dequantized float copies."""
    shapes = {"wqkv": ((Hq + 2 * Hkv) * hd, D), "wo": (D, Hq * hd), "wgu": (2 * F, D), "wdown": (D, F)}
    q, f = {}, {}
    for (name, (rows, cols)), fmt in zip(shapes.items(), fmts):
        q[name] = tiles(fmt, random_blocks(rng, fmt, rows, cols), cols)
        f[name] = dequantize_ref(q[name])
    vec = lambda n: rng.standard_normal(n).astype(np.float32)
    return q, f, dict(x=vec(D), o=vec(Hq * hd), n1=vec(D), n2=vec(D), Hq=Hq, Hkv=Hkv, hd=hd)


def close_rel(got, want, rtol):
    scale = np.abs(want).max()
    assert got.shape == want.shape and np.abs(got - want).max() <= rtol * scale, np.abs(got - want).max() / scale


@pytest.mark.parametrize("fmts", [("Q8_0",) * 4, ("Q4_0",) * 4, ("Q4_1",) * 4, ("Q4_K", "Q4_K", "Q4_K", "Q6_K"),
                                  ("Q6_K", "Q4_1", "Q8_0", "Q4_K")], ids="-".join)
def test_fused_decode_kernels_with_quantized_weights(fmts):
    """attn_in / attn_out / norm_gemv take quantized tiles where they take a float matrix: the same
    result as the float kernels' references on the dequantized weights."""
    rng = np.random.default_rng(5)
    q, f, p = quant_layer(rng, fmts)
    # the integer kernels quantize x per block to XQ levels (kernels_cpu.quant_intdot): ~3e-5 here
    # with VNNI's 16 bits, the bound 4x that with AVX2's 14 (XQ 8191 against 32639)
    rtol = 1e-5 if ISA is None else 2e-4 * quant_intdot.XQ_VNNI / (quant_intdot.XQ_AVX2 if ISA == "avx2" else
                                                                   quant_intdot.XQ_VNNI)
    inv_freq = 10000.0 ** (-np.arange(0, p["hd"], 2) / p["hd"])
    n_rot = p["Hq"] + p["Hkv"]
    got = kc.attn_in(p["x"], p["n1"], 1e-5, q["wqkv"], 1234, inv_freq, n_rot, p["hd"])
    close_rel(got, ref.attn_in_ref(p["x"], p["n1"], 1e-5, f["wqkv"], 1234, inv_freq, n_rot, p["hd"]), rtol)
    got = kc.attn_out(p["x"], p["o"], q["wo"], p["n2"], 1e-5, q["wgu"], q["wdown"])
    close_rel(got, ref.attn_out_ref(p["x"], p["o"], f["wo"], p["n2"], 1e-5, f["wgu"], f["wdown"]), rtol)
    got = kc.norm_gemv(p["x"], p["n2"], 1e-5, q["wgu"])
    close_rel(got, ref.norm_gemv_ref(p["x"], p["n2"], 1e-5, f["wgu"]), rtol)


def test_fused_decode_kernels_bfloat16_activations():
    from cpu_wrappers import float_to_bf16_bits
    from references import bf16_bits_to_float_ref
    rng = np.random.default_rng(6)
    q, f, p = quant_layer(rng, ("Q8_0",) * 4)
    x16 = float_to_bf16_bits(p["x"])
    o16 = float_to_bf16_bits(p["o"])
    n16 = float_to_bf16_bits(p["n2"])
    got = kc.attn_out(x16, o16, q["wo"], n16, 1e-5, q["wgu"], q["wdown"])
    assert got.dtype == np.uint16
    want = ref.attn_out_ref(*(bf16_bits_to_float_ref(a) for a in (x16, o16)), f["wo"], bf16_bits_to_float_ref(n16),
                           1e-5, f["wgu"], f["wdown"])
    close_rel(bf16_bits_to_float_ref(got), want, 2.0 ** -7)
    with pytest.raises(ValueError, match="all be float32 or all bfloat16"):
        kc.attn_out(x16, p["o"], q["wo"], n16, 1e-5, q["wgu"], q["wdown"])


def test_isa_takes_the_integer_kernel_every_host_can_run(monkeypatch):
    """An AVX2-only host runs the AVX2 integer GEMV (the portable rows decode 7-8x slower), a host
    with AVX-512 VNNI and BW the VNNI one, a host with neither the portable rows."""
    for features, want in (("+avx2,+fma,-avx512bw,-avx512vnni", "avx2"), ("+avx2,+avx512bw,+avx512vnni", "avx512vnni"),
                           ("+avx2,+avx512vnni,-avx512bw", "avx2"), ("+sse4.2,-avx2", None)):
        monkeypatch.setattr(quant_intdot, "_features", lambda f=features: f.split(","))
        assert quant_intdot.isa() == want, features
