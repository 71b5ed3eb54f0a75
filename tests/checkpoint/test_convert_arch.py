"""Qwen2 and Qwen3 GGUFs (written by the gguf package from tiny checkpoints that transformers made)
converted and run: the same logits as transformers on the original weights, the Q and K rows left
as they are (these GGUFs keep HF's half-split RoPE rows), and Qwen's pre-tokenizer."""
import random

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file
from tokenizers import Regex, Tokenizer, pre_tokenizers

from arch_checkpoints import ARCHS, write_arch_checkpoint
from minirun import Engine
from minirun.checkpoint.convert import convert_gguf
from test_convert import CORPUS, SAMPLES, bpe_vocab, train_bpe
from test_convert_gemma import HELD_OUT

# Qwen2's tokenizer.json split, written out here as the reference (digits one at a time)
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    if hf in TOP:
        return TOP[hf]
    parts = hf.split(".")
    return f"blk.{parts[2]}.{LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"


@pytest.fixture(scope="module")
def qwen_bpe():
    split = pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated")
    return train_bpe(pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=False)]))


def write_qwen_gguf(path, arch: str, model_dir, vocab: dict, qtype=Q.F32):
    """The checkpoint in model_dir as a GGUF of `arch` (matrices qtype, the rest F32), rows as stored."""
    cfg = ARCHS[arch][0].from_pretrained(str(model_dir))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers), w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size), w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads), w.add_head_count_kv(cfg.num_key_value_heads)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(hd), w.add_value_length(hd)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps), w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    for key, value in vocab.items():
        getattr(w, key)(value)
    for hf, arr in load_file(str(model_dir / "model.safetensors")).items():
        qt = Q.F32 if arr.ndim == 1 else qtype
        data = gguf.quants.quantize(arr.astype(np.float32), qt)
        w.add_tensor(gguf_name(hf), data, raw_dtype=qt if qt not in (Q.F32, Q.F16) else None)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_gguf_converts_to_the_same_logits(tmp_path, qwen_bpe, arch):
    d = write_arch_checkpoint(tmp_path / "hf", arch, vocab_size=qwen_bpe.get_vocab_size())
    out = convert_gguf(write_qwen_gguf(tmp_path / "m.gguf", arch, d, bpe_vocab(qwen_bpe, "qwen2")),
                       tmp_path / "converted", progress=False)
    eng = Engine.load(out, device="cpu", dtype="float32", ctx=256, prefill_chunk=29)
    assert eng.args.model_type == arch and eng.args.qk_norm == (arch == "qwen3")
    ids = eng.tokenize(" ".join(CORPUS[:3]))[:120]
    with torch.no_grad():
        ref = ARCHS[arch][1].from_pretrained(str(d), dtype=torch.float32)(torch.tensor([ids])).logits[0]
    assert (eng.logits(ids) - ref).abs().max().item() <= 1e-4


def test_qwen_gguf_keeps_q8_blocks(tmp_path, qwen_bpe, float32_quant_prefill):
    """Blocks kept as shipped in a Qwen GGUF (no row permutation to undo): the dequantized weights'
    logits (as a Llama's blocks are held, tests/model/test_quant_model.py)."""
    d = write_arch_checkpoint(tmp_path / "hf", "qwen2", vocab_size=qwen_bpe.get_vocab_size())
    src = write_qwen_gguf(tmp_path / "q8.gguf", "qwen2", d, bpe_vocab(qwen_bpe, "qwen2"), Q.Q8_0)
    kept = Engine.load(convert_gguf(src, tmp_path / "kept", progress=False), device="cpu", ctx=256)
    flat = Engine.load(convert_gguf(src, tmp_path / "flat", dtype="float32", progress=False), device="cpu", ctx=256)
    ids = list(range(5, 105))
    assert (kept.logits(ids) - flat.logits(ids)).abs().max().item() <= 1e-3


def test_qwen2_pre_tokenizer(tmp_path, qwen_bpe):
    d = write_arch_checkpoint(tmp_path / "hf", "qwen2", vocab_size=qwen_bpe.get_vocab_size())
    out = convert_gguf(write_qwen_gguf(tmp_path / "m.gguf", "qwen2", d, bpe_vocab(qwen_bpe, "qwen2")),
                       tmp_path / "converted", progress=False)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    rng = random.Random(0)
    alphabet = list("ab 0123456789\n\t.,'!?()") + ["é", "日", "😀", "  ", "'s", "<|im_start|>"]
    fuzz = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(200)]
    for s in SAMPLES + CORPUS[:4] + HELD_OUT + fuzz:        # (HELD_OUT: code, CJK and emoji)
        assert ours.encode(s).ids == qwen_bpe.encode(s).ids, s
    assert len(ours.encode("12345").ids) == 5      # (Llama 3's split keeps three digits together)
