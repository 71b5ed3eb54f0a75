"""The model with block-quantized weights (minirun.quant): its logits against the same weights
dequantized, prefill and decode, every format and a mix of them; --weights at load; the bytes
plan and bench report and what stays resident; the CLI's errors."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from minirun import Engine
from minirun.planner import param_count, weight_bytes
from minirun.quant import QuantMatrix, RowStack, quantization_config
from minirun.quant.formats import FORMATS, dequantize_blocks, quantize, to_planes
from minirun.quant.sizes import matrix_shapes
from minirun.config import ModelArgs
from shared import random_blocks

IDS = [5, 9, 11, 3, 7, 1, 2, 8, 40, 41, 17]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def logits_and_steps(eng, ids=IDS, n_steps=5):
    """Every position's logits of one prefill, then the logits of n one-token steps (decode path)."""
    full = eng.logits(ids)
    eng.reset()
    eng.prefill(ids[:-n_steps])
    steps = torch.cat([eng.step(t) for t in ids[-n_steps:]])
    return full, steps



def write_quantized(src, out, formats: dict, blocks: dict | None = None):
    """A copy of checkpoint dir `src` with the tensors in `formats` {name: format} stored as blocks:
    blocks[name] when given, else the float tensor quantized by gguf. -> out."""
    shutil.copytree(src, out)
    sd = load_file(str(out / "model.safetensors"))
    for name, fmt in formats.items():
        b = (blocks or {}).get(name)
        if b is None:
            b = quantize(sd[name], fmt)
        cols = sd[name].shape[1]
        del sd[name]
        sd |= {f"{name}.{k}": v for k, v in to_planes(FORMATS[fmt], b, cols).items()}
    save_file(sd, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(formats)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def write_dequantized(src, out, formats: dict):
    """A float copy of `src` whose matrices in `formats` hold gguf's quantize-then-dequantize."""
    shutil.copytree(src, out)
    sd = load_file(str(out / "model.safetensors"))
    for name, fmt in formats.items():
        sd[name] = dequantize_blocks(quantize(sd[name], fmt), fmt, sd[name].shape[1])
    save_file(sd, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("weights", ["q8_0", "q4_0"])
@pytest.mark.parametrize("variant", ["gqa-untied", "tied-mha"])
def test_weights_at_load_vs_dequantized(tiny_model_dir, tmp_path, weights, variant, float32_quant_prefill):
    """--weights q8_0|q4_0 on a float checkpoint: the same logits as a float checkpoint holding those
    weights dequantized (gguf's quantizer and dequantizer), through prefill and the fused decode."""
    src = tiny_model_dir(variant)
    args = ModelArgs.from_path(src)
    fmts = {n: ("Q8_0" if n.startswith(("model.embed", "lm_head")) else weights.upper()) for n in matrix_shapes(args)}
    ref = Engine.load(write_dequantized(src, tmp_path / "deq", fmts), device="cpu", ctx=64)
    eng = Engine.load(src, device="cpu", ctx=64, weights=weights)
    lw = eng.model.w["layers"][0]
    assert isinstance(lw["wqkv"], QuantMatrix) and lw["wqkv"].fmt.name == weights.upper() and "np" in lw
    assert isinstance(eng.model.w["embed"], QuantMatrix) and eng.model.w["embed"].fmt.name == "Q8_0"
    for got, want in zip(logits_and_steps(eng), logits_and_steps(ref)):
        assert rel_err(got, want) <= 1e-3


def test_k_formats_mixed_in_a_layer(tiny_model_dir, tmp_path, float32_quant_prefill):
    """A Q4_K_M-like file: Q4_K with Q6_K V and down projections (QKV of two formats: a RowStack, that
    layer's one-token steps through linear), a Q8_0 embedding, two float matrices (formats convert
    dequantizes); stored blocks against --weights float."""
    src = tiny_model_dir("gqa-untied", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64)
    args = ModelArgs.from_path(src)
    rng = np.random.default_rng(0)
    fmts, blocks = {}, {}
    for name, (rows, cols) in matrix_shapes(args).items():
        fmt = ("Q8_0" if "embed" in name else "Q6_K" if ("v_proj" in name or "down_proj" in name or "lm_head" in name)
               else "Q4_K")
        fmts[name], blocks[name] = fmt, random_blocks(rng, fmt, rows, cols, scale=0.01)
    for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        del fmts[name], blocks[name]              # a format minirun dequantizes at convert: float beside blocks
    out = write_quantized(src, tmp_path / "q4km", fmts, blocks)
    eng = Engine.load(out, device="cpu", ctx=64)
    ref = Engine.load(out, device="cpu", ctx=64, weights="float")
    lw = eng.model.w["layers"][0]
    assert isinstance(lw["wqkv"], RowStack) and "np" not in lw                  # Q4_K Q, K + Q6_K V
    assert isinstance(lw["w_gate_up"], QuantMatrix) and lw["w_gate_up"].fmt.name == "Q4_K"
    assert isinstance(ref.model.w["layers"][0]["wqkv"], torch.Tensor)
    assert any(isinstance(p, torch.Tensor) for p in eng.model.w["layers"][1]["w_gate_up"].parts)
    for got, want in zip(logits_and_steps(eng), logits_and_steps(ref)):
        assert rel_err(got, want) <= 1e-3
    # resident bytes: the stored (GGUF) bytes, Q4_K's 6-bit scales widened to bytes (+2.8%)
    shapes = matrix_shapes(args)
    stored = sum(FORMATS[f].bytes_for(shapes[n][0] * shapes[n][1]) for n, f in fmts.items())
    n_float = sum(r * c for n, (r, c) in shapes.items() if n not in fmts) + param_count(args) - sum(
        r * c for r, c in shapes.values())
    assert weight_bytes(ModelArgs.from_path(out), "float32") == stored + 4 * n_float        # what plan reports
    held = sum(m.nbytes for lw in eng.model.w["layers"] for m in (lw["wqkv"], lw["wo"], lw["w_gate_up"], lw["w_down"]))
    held -= 4 * sum(r * c for n, (r, c) in shapes.items() if n not in fmts)    # the float ones
    held += eng.model.w["embed"].nbytes + eng.model.w["lm_head"].nbytes
    assert stored <= held <= 1.05 * stored


def test_bfloat16_activations(tiny_model_dir):
    src = tiny_model_dir("gqa-untied")
    f32 = logits_and_steps(Engine.load(src, device="cpu", ctx=64, weights="q8_0"))
    bf16 = logits_and_steps(Engine.load(src, device="cpu", ctx=64, weights="q8_0", dtype="bfloat16"))
    for a, b in zip(bf16, f32):
        assert a.dtype == torch.float32 and rel_err(a, b) <= 5e-2


def test_quantized_prefill_gemm_in_bfloat16_where_native(tiny_model_dir, monkeypatch):
    """PREFILL_BF16: where the CPU's bfloat16 GEMM is native a quantized prefill's GEMMs take
    bfloat16 (weights and activations rounded: 2^-9 each) and land within 2e-2 of the float32 GEMMs;
    where it is not, they stay float32: the same logits."""
    from minirun.model import ops
    from minirun.quant import matrix
    eng = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=64, weights="q8_0")
    monkeypatch.setattr(matrix, "ROWS_MAX", 4)         # (IDS: a chunk for the dequantized GEMM)
    monkeypatch.setattr(matrix, "PREFILL_BF16", False)
    exact = eng.logits(IDS)
    monkeypatch.setattr(matrix, "PREFILL_BF16", True)
    seen = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b, **kw: seen.append(a.dtype) or mm(a, b, **kw))
    monkeypatch.setattr(ops, "cpu_bf16_gemm", lambda: True)
    native = eng.logits(IDS)
    assert seen and set(seen) == {torch.bfloat16}
    assert 0 < rel_err(native, exact) <= 2e-2
    seen.clear()
    monkeypatch.setattr(ops, "cpu_bf16_gemm", lambda: False)
    assert torch.equal(eng.logits(IDS), exact) and set(seen) == {torch.float32}


def test_a_short_chunk_takes_the_integer_gemv_on_its_rows(tiny_model_dir, monkeypatch):
    """A prompt of at most matrix.ROWS_MAX tokens runs the integer GEMV on its rows (no weight is
    dequantized), within the x quantization's bound of the dequantized GEMM's logits."""
    from minirun.quant import matrix
    eng = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=64, weights="q8_0")
    mm = torch.mm
    seen = []
    monkeypatch.setattr(torch, "mm", lambda a, b, **kw: seen.append(1) or mm(a, b, **kw))
    short = eng.logits(IDS)
    assert not seen and len(IDS) <= matrix.ROWS_MAX
    monkeypatch.setattr(matrix, "ROWS_MAX", 0)
    monkeypatch.setattr(matrix, "PREFILL_BF16", False)
    dequantized = eng.logits(IDS)
    assert seen and 0 < rel_err(short, dequantized) <= 1e-3


def test_bfloat16_prefill_widened_without_native_bf16(tiny_model_dir, monkeypatch):
    """Where the CPU has no bfloat16 GEMM the prefill's GEMMs run in float32: same logits to bf16 rounding."""
    from minirun.model import ops
    src = tiny_model_dir("gqa-untied")
    eng = Engine.load(src, device="cpu", ctx=64, dtype="bfloat16")
    monkeypatch.setattr(ops, "cpu_bf16_gemm", lambda: True)
    native = eng.logits(IDS)
    asked = []
    monkeypatch.setattr(ops, "cpu_bf16_gemm", lambda: asked.append(1) or False)
    widened = eng.logits(IDS)
    assert asked and widened.dtype == torch.float32 and rel_err(widened, native) <= 2e-2


def test_plan_bytes_as_stored(tiny_model_dir, tmp_path):
    src = tiny_model_dir("gqa-untied")
    args = ModelArgs.from_path(src)
    n_mat = sum(r * c for r, c in matrix_shapes(args).values())
    norms = param_count(args) - n_mat
    assert weight_bytes(args, "float32", "q8_0") == n_mat // 32 * 34 + norms * 4
    emb = sum(r * c for n, (r, c) in matrix_shapes(args).items() if n.startswith(("model.embed", "lm_head")))
    assert weight_bytes(args, "bfloat16", "q4_0") == emb // 32 * 34 + (n_mat - emb) // 32 * 18 + norms * 2
    fmts = {n: "Q4_1" for n in matrix_shapes(args)}
    q = ModelArgs.from_path(write_quantized(src, tmp_path / "q", fmts))
    assert weight_bytes(q, "float32") == n_mat // 32 * 20 + norms * 4
    assert weight_bytes(q, "float32", "float") == param_count(args) * 4


def test_cli_weights(tiny_model_dir, tmp_path, capsys):
    from minirun.cli.main import main
    src = tiny_model_dir("gqa-untied")
    main(["generate", str(src), "-p", "a b c", "-n", "3", "--weights", "q8_0", "--device", "cpu", "--no-stats"])
    assert capsys.readouterr().out.strip() != ""
    q = write_quantized(src, tmp_path / "q", {n: "Q8_0" for n in matrix_shapes(ModelArgs.from_path(src))})
    with pytest.raises(SystemExit) as e:
        main(["generate", str(q), "-p", "a", "-n", "2", "--weights", "q4_0", "--device", "cpu"])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "quantizes a float checkpoint" in err[0]
    main(["plan", str(q), "--kv", "dense", "--ctx", "1K", "--device", "cpu", "-o", "json"])   # (plan: float32 activations by default)
    report = json.loads(capsys.readouterr().out)
    assert report["weights"] == "Q8_0" and report["tiers"][0]["bytes"] == weight_bytes(ModelArgs.from_path(q), "float32")


# ---- the real SmolLM2 -----------------------------------------------------------------------------

def test_smollm2_as_shipped_vs_dequantized(smollm2_quant_dir, float32_quant_prefill):
    """The shipped Q4_1 / Q8_0 blocks against the same weights dequantized to float32: 2e-3 (the
    prompt's rows and each step through the integer GEMV: x quantized per block to 2^-14 of its
    largest value, kernels_cpu.quant_intdot; 1.3e-3 seen over this prompt's 57 positions)."""
    eng = Engine.load(smollm2_quant_dir, device="cpu", ctx=512)
    ref = Engine.load(smollm2_quant_dir, device="cpu", ctx=512, weights="float")
    assert eng.model.w["layers"][0]["wqkv"].fmt.name == "Q4_1" and eng.model.w["embed"].fmt.name == "Q8_0"
    ids = eng.tokenize("The history of the city begins with a small settlement on the river. " * 4)
    for got, want in zip(logits_and_steps(eng, ids, 8), logits_and_steps(ref, ids, 8)):
        assert rel_err(got, want) <= 2e-3


def test_smollm2_q8_0_perplexity_within_half_a_percent(smollm2_float_dir, monkeypatch):
    """--weights q8_0 costs < 0.5% perplexity on the pydoc evaluation text (1024 tokens) with the
    prefill GEMMs in float32, < 1% with them in bfloat16 where the CPU has a native one (activations
    rounded to 2^-9: +0.29% on a Xeon with AMX, less on Zen 4)."""
    from minirun.tools.calibrate import read_text
    from minirun.tools.evaluate import perplexity
    from minirun.quant import matrix
    text, _ = read_text(None, "evaluation")
    f32 = Engine.load(smollm2_float_dir, device="cpu", ctx=1024)
    ids = f32.tokenize(text)[:1024]
    base = perplexity(f32, ids)
    del f32
    for bf16, bound in ((False, 0.005), (True, 0.01)):
        monkeypatch.setattr(matrix, "PREFILL_BF16", bf16)
        q8 = perplexity(Engine.load(smollm2_float_dir, device="cpu", ctx=1024, weights="q8_0"), ids)
        assert abs(q8 / base - 1) < bound, (bf16, q8, base)


def test_bf16_gemm_not_native_when_onednn_is_limited_to_avx2():
    """ONEDNN_MAX_CPU_ISA=AVX2 (and ATen limited alike) stands for an AVX2-only CPU: widen."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
    code = "from minirun.model.ops import cpu_bf16_gemm; print(cpu_bf16_gemm())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
