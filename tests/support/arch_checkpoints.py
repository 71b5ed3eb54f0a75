"""Tiny random checkpoints of the other architectures, written by transformers itself (random
biases and norm weights, so that each architecture's traits change the logits)."""
import shutil

import torch
import transformers

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=2048, rms_norm_eps=1e-5,
             tie_word_embeddings=False)
ARCHS = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(rope_theta=1e6)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None)),
    # three layers, the last global: windows of 8 tokens, two RoPE bases, logits scaled by 24^-1/2
    # (not head_dim's), soft-capped at 30
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                    dict(num_hidden_layers=3, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                         final_logit_softcapping=30.0, tie_word_embeddings=True,
                         layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}


def write_arch_checkpoint(out, arch: str, tokenizer_dir=None, seed: int = 0, **over):
    """A tiny random checkpoint of `arch` saved by transformers (every bias and norm weight random)
    with the tiny Llama's tokenizer (the same 300-token vocabulary)."""
    config_cls, model_cls, extra = ARCHS[arch]
    kw = {**SHAPE, **extra, **over}
    theta = kw.pop("rope_theta", 10000.0)
    kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": theta})
    config = config_cls(**kw)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:      # (Gemma's norms multiply by 1 + w)
                p.uniform_(-0.5, 0.5) if arch.startswith("gemma") else p.uniform_(0.5, 1.5)
    model.save_pretrained(out, safe_serialization=True)
    for f in (tokenizer_dir.iterdir() if tokenizer_dir else ()):
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out
