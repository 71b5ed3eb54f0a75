"""Write a Llama checkpoint of random weights for any config.json (tests, speed and memory figures)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import ModelArgs

BYTE_SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def random_state_dict(args: ModelArgs, seed: int = 0, dtype=torch.float32, std: float = 0.02) -> dict:
    """HF-named tensors with N(0, std) weights and norm weights near 1, and the architecture's
    extras where ModelArgs has them (Q/K/V biases, the heads' norms)."""
    g = torch.Generator().manual_seed(seed)
    D, F, hd = args.hidden_size, args.intermediate_size, args.head_dim
    Hq, Hkv, V = args.num_attention_heads, args.num_key_value_heads, args.vocab_size

    def rnd(*shape, s=std):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    def norm(n=D):
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(dtype)

    sd = {"model.embed_tokens.weight": rnd(V, D, s=1.0), "model.norm.weight": norm()}
    if not args.tie_word_embeddings:
        sd["lm_head.weight"] = rnd(V, D)
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm()
        sd[p + "post_attention_layernorm.weight"] = norm()
        sd[p + "self_attn.q_proj.weight"] = rnd(Hq * hd, D, s=0.1)
        sd[p + "self_attn.k_proj.weight"] = rnd(Hkv * hd, D, s=0.1)
        sd[p + "self_attn.v_proj.weight"] = rnd(Hkv * hd, D)
        sd[p + "self_attn.o_proj.weight"] = rnd(D, Hq * hd)
        sd[p + "mlp.gate_proj.weight"] = rnd(F, D)
        sd[p + "mlp.up_proj.weight"] = rnd(F, D)
        sd[p + "mlp.down_proj.weight"] = rnd(D, F)
        if args.attention_bias:
            for name, rows in (("q", Hq * hd), ("k", Hkv * hd), ("v", Hkv * hd)):
                sd[p + f"self_attn.{name}_proj.bias"] = rnd(rows, s=0.1)
        if args.qk_norm:
            sd[p + "self_attn.q_norm.weight"], sd[p + "self_attn.k_norm.weight"] = norm(hd), norm(hd)
        if args.post_norms:   # (post_attention_layernorm is then the attention's post-norm)
            sd[p + "pre_feedforward_layernorm.weight"], sd[p + "post_feedforward_layernorm.weight"] = norm(), norm()
    return sd


def random_weights(args: ModelArgs, dtype: torch.dtype, device: torch.device, seed: int = 0,
                   std: float = 0.02) -> dict:
    """The runtime's weight dict (loader.load_weights' layout: fused wqkv and w_gate_up) drawn on
    `device` directly, with random_state_dict's scales: no file, no host copy."""
    g = torch.Generator(device=device).manual_seed(seed)
    D, F, hd = args.hidden_size, args.intermediate_size, args.head_dim
    Hq, Hkv, V = args.num_attention_heads, args.num_key_value_heads, args.vocab_size

    def rnd(*shape, s=std):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).mul_(s).to(dtype)

    def norm(n=D):
        return (1.0 + 0.1 * torch.randn(n, generator=g, device=device)).to(dtype)

    embed = rnd(V, D, s=1.0)
    layers = []
    for _ in range(args.num_hidden_layers):
        lw = {"attn_norm": norm(), "ffn_norm": norm(),
              "wqkv": torch.cat([rnd((Hq + Hkv) * hd, D, s=0.1), rnd(Hkv * hd, D)]),
              "wo": rnd(D, Hq * hd), "w_gate_up": rnd(2 * F, D), "w_down": rnd(D, F)}
        if args.attention_bias:
            lw["bqkv"], lw["bo"] = rnd((Hq + 2 * Hkv) * hd, s=0.1), None
        if args.qk_norm:
            lw["q_norm"], lw["k_norm"] = norm(hd), norm(hd)
        if args.post_norms:
            lw["post_attn_norm"], lw["post_ffn_norm"] = norm(), norm()
        layers.append(lw)
    return {"embed": embed, "norm": norm(), "layers": layers,
            "lm_head": embed if args.tie_word_embeddings else rnd(V, D)}


def byte_tokenizer_json(vocab_size: int) -> dict:
    """A byte-level BPE tokenizer with no merges: ids 0..3 specials, then the 256 bytes, rest unused."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    alphabet = ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(BYTE_SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    for i in range(len(vocab), vocab_size):
        vocab[f"<unused{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(BYTE_SPECIALS)
    return json.loads(tok.to_str())


def write_random_checkpoint(config: dict, out_dir: str | Path, seed: int = 0, dtype: str = "float32",
                            tokenizer: str = "bytes", weights: bool = True) -> Path:
    """Write config.json, model.safetensors and (tokenizer="bytes") a byte tokenizer into out_dir.

    config: a Llama config.json dict (e.g. SmolLM2's or Llama-3-8B's). The byte tokenizer needs
    vocab_size >= 260; larger vocabularies are padded with unused tokens. weights=False: no
    model.safetensors (for Engine.with_random_weights).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(config, model_type=config.get("model_type", "llama"))
    config.setdefault("bos_token_id", 0)
    config.setdefault("eos_token_id", 1)
    args = ModelArgs.from_dict(config)
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if weights:
        save_file(random_state_dict(args, seed, tdtype), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer == "bytes":
        (out / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json(args.vocab_size)))
        (out / "tokenizer_config.json").write_text(json.dumps({
            "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": CHATML}))
    return out
