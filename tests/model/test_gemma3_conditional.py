"""Gemma3ForConditionalGeneration's language model from a Hugging Face directory (model_type gemma3:
the text model's config in text_config, its weights under a prefix beside a vision tower's), against
the conditional model's own text-only logits; and text_config's missing keys read as transformers'
Gemma3TextConfig defaults them."""
import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from arch_checkpoints import ARCHS, SHAPE
from minirun import Engine, ModelArgs
from minirun.errors import CheckpointError


def write_conditional_checkpoint(out, tokenizer_dir, seed: int = 0):
    """A tiny Gemma3ForConditionalGeneration (the tiny Gemma 3 text model of arch_checkpoints without
    its final soft-cap, which Gemma 3 has none of and transformers' conditional model does not apply;
    a one-layer SigLIP tower) saved by transformers, with the tiny Llama's tokenizer."""
    text = ARCHS["gemma3_text"][0](**{**SHAPE, **ARCHS["gemma3_text"][2], "final_logit_softcapping": None})
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       boi_token_index=297, eoi_token_index=298, image_token_index=299)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "language_model" in name:      # (1 + w) norms, random w
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out, model


@pytest.fixture(scope="module")
def conditional(tiny_model_dir, tmp_path_factory):
    return write_conditional_checkpoint(tmp_path_factory.mktemp("gemma3-mm"), tiny_model_dir("gqa-untied"))


def _ids(n=120, seed=1):
    return torch.randint(4, 290, (n,), generator=torch.Generator().manual_seed(seed)).tolist()   # (no image ids)


def test_the_language_model_gives_the_conditional_models_text_logits(conditional):
    d, model = conditional
    cfg = json.loads((d / "config.json").read_text())
    names = load_file(str(d / "model.safetensors")).keys()
    assert cfg["model_type"] == "gemma3" and any(n.startswith("vision_tower.") for n in names)
    eng = Engine.load(d, device="cpu", dtype="float32", ctx=256, prefill_chunk=23)
    a = eng.args
    assert (a.model_type, a.sliding_window, a.query_pre_attn_scalar, a.final_logit_softcapping) == \
        ("gemma3_text", 8, 24, None)
    ids = _ids()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0]
    assert (eng.logits(ids) - ref).abs().max().item() <= 1e-4


def test_transformers_5_prefix_and_its_vision_tensors(conditional, tmp_path):
    """The same checkpoint with transformers 5's module names (model.language_model.*,
    model.vision_tower.*, lm_head.*) gives the same logits."""
    d, _ = conditional
    renamed = {}
    for name, t in load_file(str(d / "model.safetensors")).items():
        for old, new in (("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
                         ("multi_modal_projector.", "model.multi_modal_projector.")):
            if name.startswith(old):
                name = new + name[len(old):]
                break
        renamed[name] = t
    out = tmp_path / "t5"
    shutil.copytree(d, out)
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    ids = _ids(60, seed=2)
    a = Engine.load(d, device="cpu", dtype="float32", ctx=128).logits(ids)
    assert torch.equal(Engine.load(out, device="cpu", dtype="float32", ctx=128).logits(ids), a)


def test_missing_text_config_keys_read_as_transformers_defaults_them():
    """A hub config of the 4B's kind (text_config with six keys) reads as transformers reads it."""
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"model_type": "siglip_vision_model"}}
    ours = ModelArgs.from_dict(cfg)
    ref = transformers.Gemma3Config(**{k: v for k, v in cfg.items() if k != "architectures"}).text_config
    assert (ours.vocab_size, ours.num_attention_heads, ours.num_key_value_heads, ours.head_dim) == \
        (ref.vocab_size, ref.num_attention_heads, ref.num_key_value_heads, ref.head_dim)
    assert (ours.rms_norm_eps, ours.query_pre_attn_scalar, ours.sliding_window, ours.max_position_embeddings) == \
        (ref.rms_norm_eps, ref.query_pre_attn_scalar, ref.sliding_window, ref.max_position_embeddings)
    assert list(ours.layer_types) == ref.layer_types and ours.tie_word_embeddings is True
    full, local = ref.rope_parameters["full_attention"], ref.rope_parameters["sliding_attention"]
    assert (ours.rope_theta, ours.rope_local_theta) == (full["rope_theta"], local["rope_theta"])
    assert ours.rope_scaling == {"factor": 8.0, "rope_type": "linear"} == {k: full[k] for k in ("factor", "rope_type")}
    assert (ours.hidden_act, ours.norm_offset, ours.eos_token_id) == ("gelu_pytorch_tanh", 1.0, [1, 106])


def test_a_gemma3_config_without_text_config_is_one_line():
    with pytest.raises(CheckpointError, match="text_config") as e:
        ModelArgs.from_dict({"model_type": "gemma3", "vision_config": {}})
    assert "\n" not in str(e.value)
