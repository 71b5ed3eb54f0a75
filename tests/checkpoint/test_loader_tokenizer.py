"""Loader paths (sharded safetensors, dtypes) and tokenizer paths (sentencepiece, chat_template.jinja)."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from minirun import Engine
from minirun.checkpoint.tokenizer import Tokenizer


def ids_of(n):
    return torch.randint(4, 300, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def test_sharded_checkpoint_loads_identically(tiny_model_dir, tmp_path):
    src = tiny_model_dir("gqa-untied")
    d = tmp_path / "sharded"
    shutil.copytree(src, d)
    sd = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(d / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = ids_of(50)
    a = Engine.load(src, device="cpu", ctx=64).logits(ids)
    b = Engine.load(d, device="cpu", ctx=64).logits(ids)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 0.25), ("float16", 0.05)])
def test_half_precision_close_to_float32(tiny_model_dir, dtype, tol):
    d = tiny_model_dir("gqa-untied")
    ids = ids_of(60)
    ref = Engine.load(d, device="cpu", ctx=64).logits(ids)
    out = Engine.load(d, device="cpu", ctx=64, dtype=dtype).logits(ids)
    assert out.dtype == torch.float32 and (out - ref).abs().max().item() < tol * ref.abs().max().item()
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_bfloat16_decode_gemv_matches_prefill(tiny_model_dir):
    """One-token decode steps (the Numba bfloat16 GEMV, ops.linear) against a prefill of the same
    tokens (torch's bfloat16 GEMM): the same model to bfloat16 precision."""
    d = tiny_model_dir("gqa-untied")
    ids = ids_of(24)
    eng = Engine.load(d, device="cpu", ctx=64, dtype="bfloat16")
    full = eng.logits(ids)                                   # [24, V], many rows per GEMM
    eng.prefill(ids[:1])
    steps = torch.cat([eng.step(t) for t in ids[1:]])        # [23, V], one row per GEMV
    ref = Engine.load(d, device="cpu", ctx=64).logits(ids)[1:]   # float32
    scale = ref.abs().max().item()
    assert (steps - full[1:]).abs().max().item() < 0.1 * scale
    # neither path is further from float32 than the other by more than bfloat16 noise
    assert (steps - ref).abs().max().item() < 0.25 * scale
    assert (steps.argmax(-1) == full[1:].argmax(-1)).float().mean() > 0.9


def test_sentencepiece_tokenizer_and_jinja_template_file(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog number {i}" for i in range(300)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "tokenizer"), vocab_size=64,
                                   bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    tok = Tokenizer(tmp_path, config={"bos_token_id": 1, "eos_token_id": 2})
    ids = tok.encode("the quick brown fox")
    assert ids[0] == 1 and tok.add_bos                       # sentencepiece models add BOS by default
    assert tok.decode(ids) == "the quick brown fox"
    assert tok.eos_ids == (2,)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "[user] hi\n[assistant] "


def test_a_tokenizer_json_that_pads_or_truncates_leaves_prompts_whole(tiny_model_dir, tmp_path):
    """tokenizer.json may carry padding and truncation settings (for training batches): a prompt is
    encoded whole and without pad ids all the same."""
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir("gqa-untied"), d)
    text = "a document of some words " * 5
    want = Tokenizer(d).encode(text, add_bos=False)
    spec = json.loads((d / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    spec["padding"] = {"strategy": {"Fixed": len(want) + 50}, "direction": "Right", "pad_to_multiple_of": None,
                       "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"}
    (d / "tokenizer.json").write_text(json.dumps(spec))
    assert len(want) > 4 and Tokenizer(d).encode(text, add_bos=False) == want
