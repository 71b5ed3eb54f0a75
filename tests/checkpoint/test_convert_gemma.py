"""Gemma 3 GGUFs written as llama.cpp's convert_hf_to_gguf writes them (the gemma3 keys, the norms
with the 1 of Gemma's (1 + w) added, Q and K rows as HF's, no output tensor: tied) from tiny
transformers checkpoints, converted and run against transformers; Gemma's SentencePiece vocabulary
(no dummy prefix, whitespace kept) against sentencepiece itself."""
import io

import gguf
import numpy as np
import pytest
import sentencepiece as spm
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from arch_checkpoints import ARCHS, write_arch_checkpoint
from minirun import Engine
from minirun.checkpoint.convert import convert_gguf
from minirun.checkpoint.gguf_config import build_config
from minirun.checkpoint.tokenizer import Tokenizer as ChatTokenizer
from minirun.quant import matrix

TRAIN_TEXT = [
    "def tokenize(text: str) -> list[int]:\n    return [ord(c) for c in text if c.isalnum()]  # ids\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * 2;\n}\n",
    "日本語のテキストを少し書きます。東京は大きな都市です。中文测试：今天天气很好。",
    "Emoji: 😀 😂 👍🏽 🎉 ❤️ and flags 🇫🇷 🇯🇵!",
    "naïve café déjà vu — Größe, façade, señor, Ærø, œuvre.",
    "Numbers 12345 and 3.14159, dates 2024-01-01, 1,000,000 items.",
    "   leading spaces\tand\ttabs\n\n  new  lines    and     runs      of spaces",
    "The quick brown fox jumps over the lazy dog. It's 12 o'clock, isn't it?",
] * 30
# held out: code, CJK and emoji the training text lacks (byte fallback), whitespace runs, digits
HELD_OUT = [
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y  # 座標\n",
    "東京タワーと富士山 🗻, 北京烤鸭 🦆 — très délicieux!",
    "  if (x  >=  10)   {  return\t-1; }\n\n\n",
    "Ünïcödé 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ½ ∑ ЖЩ مرحبا 9876543210",
    "😀😀 😀", " x", "\n", "a", "",
]
TURNS = ["<start_of_turn>", "<end_of_turn>"]
CHAT = "<start_of_turn>user\nhi  there<end_of_turn>\n<start_of_turn>model\n"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' "
            "else m['role']) + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
WINDOW = 8
# what llama.cpp fixes for gemma3: six layers, the sixth global; head_dim's scale; local RoPE base 1e4
GGUF_GEMMA = dict(num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16, final_logit_softcapping=None,
                  sliding_window=WINDOW, layer_types=["sliding_attention"] * 5 + ["full_attention"])


def train_spm(add_dummy_prefix: bool):
    """A SentencePiece BPE model with byte fallback, Gemma's special ids (pad 0, eos 1, bos 2, unk 3)
    and its turn markers (user-defined pieces, as in Gemma's tokenizer.model)."""
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAIN_TEXT), model_writer=buf, model_type="bpe", vocab_size=600, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=add_dummy_prefix,
        split_digits=True, allow_whitespace_only_pieces=True, character_coverage=1.0, minloglevel=2,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        user_defined_symbols=TURNS, hard_vocab_limit=False)
    return spm.SentencePieceProcessor(model_proto=buf.getvalue())


def spm_vocab(sp, add_dummy_prefix: bool) -> dict:
    """GGUFWriter calls for the vocabulary as convert_hf_to_gguf's _create_vocab_sentencepiece writes
    it: the piece kinds as token types, the turn markers (special in Gemma's tokenizer_config) as
    control tokens scored -1000."""
    n = sp.get_piece_size()
    pieces = [sp.id_to_piece(i) for i in range(n)]
    types = [3 if p in TURNS or sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i) else
             5 if sp.is_unused(i) else 1 for i, p in enumerate(pieces)]
    scores = [-1000.0 if p in TURNS else sp.get_score(i) for i, p in enumerate(pieces)]
    return {"add_tokenizer_model": "llama", "add_token_list": pieces, "add_token_scores": scores,
            "add_token_types": types, "add_bos_token_id": 2, "add_eos_token_id": 1, "add_unk_token_id": 3,
            "add_pad_token_id": 0, "add_add_bos_token": True, "add_add_space_prefix": add_dummy_prefix,
            "add_chat_template": TEMPLATE}


@pytest.fixture(scope="module")
def gemma_spm():
    sp = train_spm(add_dummy_prefix=False)
    return sp, spm_vocab(sp, False)


def write_gemma_gguf(path, model_dir, vocab: dict, qtype=Q.F32, norm_values=None):
    """The checkpoint in model_dir as llama.cpp writes a gemma3 GGUF: its names (gguf's tensor map),
    1 added to every norm's weights (float32), matrices `qtype` (1-D tensors F32); norm_values
    {GGUF name: values} replaces those norms' stored values."""
    cfg = ARCHS["gemma3_text"][0].from_pretrained(str(model_dir))
    full = cfg.rope_parameters["full_attention"]
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(cfg.num_hidden_layers), w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size), w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads), w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim), w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps), w.add_rope_freq_base(full["rope_theta"])
    w.add_sliding_window(cfg.sliding_window)
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR), w.add_rope_scaling_factor(full["factor"])
    for key, value in vocab.items():
        getattr(w, key)(value)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, cfg.num_hidden_layers)
    for hf, arr in load_file(str(model_dir / "model.safetensors")).items():
        name = names.get_name(hf, try_suffixes=(".weight",))
        arr = arr.astype(np.float32)
        if hf.endswith("norm.weight"):
            arr = (norm_values or {}).get(name, arr + np.float32(1))
        qt = Q.F32 if arr.ndim == 1 else qtype
        w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt if qt not in (Q.F32, Q.F16) else None)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def hf_logits(model_dir, ids, qtype=Q.F32, generate: int = 0):
    """transformers' logits [T, V] (and greedy continuation) on model_dir's weights, its matrices
    through `qtype` and back (the values a GGUF of that type holds)."""
    model = ARCHS["gemma3_text"][1].from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2 and qtype != Q.F32:
                q = gguf.quants.quantize(p.numpy(), qtype)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, qtype).reshape(p.shape)))
        logits = model(torch.tensor([ids])).logits[0]
        tokens = model.generate(torch.tensor([ids]), max_new_tokens=generate, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(ids):].tolist() if generate else []
    return logits, tokens


def engine_norms(eng) -> dict:
    """The loaded model's norm weights as it multiplies by them, by GGUF name."""
    w = eng.model.w
    out = {"output_norm.weight": w["norm"]}
    for i, layer in enumerate(w["layers"]):
        for ours, name in (("attn_norm", "attn_norm"), ("ffn_norm", "ffn_norm"),
                           ("post_attn_norm", "post_attention_norm"), ("post_ffn_norm", "post_ffw_norm"),
                           ("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
            out[f"blk.{i}.{name}.weight"] = layer[ours]
    return out


def gguf_norms(path) -> dict:
    return {t.name: np.array(t.data) for t in gguf.GGUFReader(str(path)).tensors if t.name.endswith("norm.weight")}


@pytest.mark.parametrize("qtype,linear_rope", [(Q.F32, None), (Q.Q8_0, 4.0)], ids=["F32", "Q8_0-linear-rope"])
def test_gemma3_gguf_converts_to_the_same_logits(tmp_path, gemma_spm, qtype, linear_rope, monkeypatch):
    """A prompt of several windows in odd chunks and greedy decoding past them; norms bit-exact as
    llama.cpp multiplies by them; the Q8_0 GGUF (every matrix, the embeddings too) held to
    transformers on the same values and, kept as blocks, to its dequantized self."""
    sp, vocab = gemma_spm
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    if linear_rope:
        rope["full_attention"] = {"rope_type": "linear", "factor": linear_rope, "rope_theta": 1e6}
    d = write_arch_checkpoint(tmp_path / "hf", "gemma3_text", vocab_size=sp.get_piece_size(), rope_parameters=rope,
                              **GGUF_GEMMA)
    src = write_gemma_gguf(tmp_path / "m.gguf", d, vocab, qtype)
    out = convert_gguf(src, tmp_path / "converted", dtype="float32", progress=False)
    eng = Engine.load(out, device="cpu", dtype="float32", ctx=256, prefill_chunk=11)
    a = eng.args
    assert (a.model_type, a.sliding_window, a.rope_local_theta, a.query_pre_attn_scalar) == \
        ("gemma3_text", WINDOW, 1e4, 16)
    assert [a.layer_window(i) for i in range(6)] == [WINDOW] * 5 + [None] and a.final_logit_softcapping is None
    assert a.rope_scaling == ({"rope_type": "linear", "factor": linear_rope} if linear_rope else None)
    for name, g in gguf_norms(src).items():
        assert torch.equal(engine_norms(eng)[name], torch.from_numpy(g)), name
    ids = eng.tokenize(" ".join(TRAIN_TEXT[:8]))[:90]
    assert len(ids) == 90 and ids[0] == 2
    ref, greedy = hf_logits(d, ids, qtype, generate=12)
    assert (eng.logits(ids) - ref).abs().max().item() <= 1e-4
    assert eng.generate(ids, max_new_tokens=12, ignore_eos=True).tokens == greedy
    if qtype != Q.F32:   # (its prefill's GEMMs in float32 as the dequantized engine's, also where the CPU's
        monkeypatch.setattr(matrix, "PREFILL_BF16", False)   # bfloat16 GEMM is native: 1e-2 apart there)
        kept = Engine.load(convert_gguf(src, tmp_path / "kept", progress=False), device="cpu", ctx=256)
        assert kept.args.quantization_config["format"] == "Q8_0"
        assert (kept.logits(ids) - eng.logits(ids)).abs().max().item() <= 1e-3


def test_converted_gemma3_reads_the_same_in_transformers(tmp_path, gemma_spm):
    """The norms written back zero-centred and config.json in Gemma3TextConfig's terms: transformers'
    own Gemma 3 on the converted directory gives minirun's logits."""
    sp, vocab = gemma_spm
    d = write_arch_checkpoint(tmp_path / "hf", "gemma3_text", vocab_size=sp.get_piece_size(), **GGUF_GEMMA)
    out = convert_gguf(write_gemma_gguf(tmp_path / "m.gguf", d, vocab), tmp_path / "converted", progress=False)
    ids = list(range(4, 70))
    ours = Engine.load(out, device="cpu", dtype="float32", ctx=128).logits(ids)
    assert (ours - hf_logits(out, ids)[0]).abs().max().item() <= 1e-4


def test_norms_kept_as_stored_where_subtracting_the_one_is_not_exact(tmp_path, gemma_spm):
    """A norm value g with bits below float32's step at 1 (here 0.1 + 2^-27) does not come back as
    (g - 1) + 1: the norms are written as stored, config.json says norm_offset 0, and the model
    multiplies by exactly what the GGUF holds."""
    sp, vocab = gemma_spm
    d = write_arch_checkpoint(tmp_path / "hf", "gemma3_text", vocab_size=sp.get_piece_size(), **GGUF_GEMMA)
    odd = np.full(16, np.float32(0.1) + np.float32(2.0 ** -27), dtype=np.float32)
    assert ((odd - np.float32(1)) + np.float32(1) != odd).all()
    src = write_gemma_gguf(tmp_path / "m.gguf", d, vocab, norm_values={"blk.2.attn_q_norm.weight": odd})
    out = convert_gguf(src, tmp_path / "converted", progress=False)
    eng = Engine.load(out, device="cpu", dtype="float32", ctx=64)
    assert eng.args.norm_offset == 0.0
    stored = load_file(str(out / "model.safetensors"))
    for name, g in gguf_norms(src).items():
        assert torch.equal(engine_norms(eng)[name], torch.from_numpy(g)), name
    np.testing.assert_array_equal(stored["model.layers.2.self_attn.q_norm.weight"], odd)


def test_gemma3_header_rules():
    """What llama.cpp derives rather than reads: the 27B's (62 layers) attention scale from
    hidden_size / heads; no sliding_window key: every layer global; a final soft-cap where given."""
    meta = {"llama.embedding_length": 5376, "llama.attention.head_count": 32, "llama.attention.head_count_kv": 16,
            "llama.attention.key_length": 128, "llama.feed_forward_length": 21504, "llama.block_count": 62,
            "llama.rope.freq_base": 1e6, "llama.attention.sliding_window": 1024,
            "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 8.0}
    has_bias = {"attn": False, "mlp": False}
    cfg = build_config(meta, 262_144, True, "bfloat16", None, has_bias, "x.gguf", "gemma3")
    assert (cfg["model_type"], cfg["query_pre_attn_scalar"], cfg["head_dim"]) == ("gemma3_text", 168, 128)
    assert cfg["layer_types"].count("full_attention") == 10 and cfg["layer_types"][5] == "full_attention"
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 8.0} and cfg["rope_local_base_freq"] == 1e4
    small = {**meta, "llama.block_count": 26, "llama.final_logit_softcapping": 30.0}
    del small["llama.attention.sliding_window"]
    cfg = build_config(small, 262_144, True, "bfloat16", None, has_bias, "x.gguf", "gemma3")
    assert cfg["query_pre_attn_scalar"] == 128 and cfg["sliding_window"] is None
    assert set(cfg["layer_types"]) == {"full_attention"} and cfg["final_logit_softcapping"] == 30.0


# ---------------------------------------------------------------- Gemma's SentencePiece vocabulary


@pytest.mark.parametrize("add_dummy_prefix", [False, True], ids=["gemma", "llama-prefix"])
def test_sentencepiece_ids_match_sentencepiece(tmp_path, add_dummy_prefix):
    """Gemma's vocabulary kind (no dummy prefix, whitespace runs kept) and Llama's (a dummy prefix):
    our tokenizer.json gives sentencepiece's own ids on held-out mixed text, and its text back."""
    sp = train_spm(add_dummy_prefix)
    d = write_arch_checkpoint(tmp_path / "hf", "gemma3_text", vocab_size=sp.get_piece_size(), **GGUF_GEMMA)
    out = convert_gguf(write_gemma_gguf(tmp_path / "m.gguf", d, spm_vocab(sp, add_dummy_prefix)),
                       tmp_path / "converted", progress=False)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    # (with a dummy prefix llama.cpp puts a "▁" after each special token too, which sentencepiece does not)
    texts = HELD_OUT + TRAIN_TEXT[:8] + ([] if add_dummy_prefix else [CHAT, "a<end_of_turn>b"])
    for s in texts:
        ids = sp.encode(s)
        assert ours.encode(s).ids == ids, s
        assert ours.decode(ids, skip_special_tokens=False) == sp.decode(ids), s
    assert any(sp.is_byte(i) for i in ours.encode(HELD_OUT[1]).ids)       # (byte fallback exercised)


def test_gemma_chat_turns_and_template(tmp_path, gemma_spm):
    """The turn markers are single special tokens, <end_of_turn> ends generation, BOS is added once
    though the template writes it, and the chat template comes from tokenizer.chat_template."""
    sp, vocab = gemma_spm
    d = write_arch_checkpoint(tmp_path / "hf", "gemma3_text", vocab_size=sp.get_piece_size(), **GGUF_GEMMA)
    out = convert_gguf(write_gemma_gguf(tmp_path / "m.gguf", d, vocab), tmp_path / "converted", progress=False)
    tok = ChatTokenizer(out)
    end_of_turn = sp.piece_to_id("<end_of_turn>")
    assert tok.add_bos and tok.bos_token == "<bos>" and end_of_turn in tok.eos_ids and 1 in tok.eos_ids
    text = tok.apply_chat_template([{"role": "user", "content": "hi  there"}])
    assert text == "<bos>" + CHAT
    assert tok.encode(text) == [2] + sp.encode(CHAT)
    assert tok.encode(CHAT) == [2] + sp.encode(CHAT)
