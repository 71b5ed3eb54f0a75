"""The architectures the one layer loop runs, as data: what each one's config.json means in the
fields ModelArgs reads (llama.cpp keeps such a table per architecture in llama-arch.cpp and
llama-model.cpp's hparams; mlx-lm a ModelArgs per model file).

What differs from Llama, per model_type:
- qwen2: biases on the Q, K and V projections (none on O); a sliding window only where the config
  turns it on (use_sliding_window).
- qwen3: an RMSNorm over each head of q and of k (q_norm, k_norm [head_dim]) before RoPE; a
  sliding window as qwen2's.
- mistral: Llama's layer; a sliding window where the config gives one (sliding_window: null in the
  v0.2+ models, 4096 in v0.1).
- gemma3_text (Gemma 3's language model): the embeddings scaled by sqrt(hidden_size); every norm
  (1 + w) (the weights are stored zero-centred: norm_offset, folded in at load); heads' norms as
  qwen3's; norms after the attention and after the MLP too (post_norms); GELU (tanh) in the MLP;
  attention logits scaled by query_pre_attn_scalar^-1/2; five of every six layers attend over a
  sliding window with their own RoPE base (rope_local_theta); a final logit soft-cap where given.
- gemma3 (Gemma3ForConditionalGeneration): its language model, whose config is `text_config`
  (read as gemma3_text; the vision tower's weights are left unread, minirun/model/loader.py).
A layer with a sliding window of W tokens attends, at position p, to the positions after p - W
(transformers' sliding_window_overlay); layer_types says which layers have one.
Older config files give rope_theta (and rope_scaling); newer ones (transformers 5) one
rope_parameters object holding both.
A key a config leaves out means what the architecture's transformers config class defaults it to
(DEFAULTS): Gemma 3's hub configs give only a few of text_config's keys.
"""
from __future__ import annotations

from ..errors import CheckpointError

ARCHITECTURES = {
    "llama": {},
    "mistral": {},
    "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True},
    "gemma3_text": {"qk_norm": True, "norm_offset": 1.0, "post_norms": True, "embed_scale": True},
    "gemma3": {},
}
# transformers' Gemma3TextConfig defaults for the keys the runtime reads (the layer kinds' pattern:
# _windows, every sixth layer global)
DEFAULTS = {
    "gemma3_text": {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
                    "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "rope_local_theta": 10_000.0,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096, "bos_token_id": 2, "eos_token_id": 1},
}
# Gemma3ForConditionalGeneration's keys that hold for its language model too
_OUTER_KEYS = ("eos_token_id", "bos_token_id", "tie_word_embeddings", "quantization_config")


def config_fields(d: dict) -> dict:
    """config.json of a supported architecture -> the keys ModelArgs reads: the architecture's
    fixed traits filled in, rope_parameters unfolded into rope_theta / rope_scaling, the sliding
    window that applies (None: every layer attends to the whole context)."""
    model_type = d.get("model_type")
    if model_type not in ARCHITECTURES:
        raise CheckpointError(f"unknown architecture model_type={model_type!r}: minirun supports "
                              f"{', '.join(ARCHITECTURES)}")
    if model_type == "gemma3":
        d = _language_model_config(d)
        model_type = "gemma3_text"
    out = dict(d)
    for key, value in ARCHITECTURES[model_type].items():
        out.setdefault(key, value)
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("full_attention"), dict):   # per layer kind (gemma3)
        if isinstance(rp.get("sliding_attention"), dict):
            out.setdefault("rope_local_theta", rp["sliding_attention"].get("rope_theta"))
        rp = rp["full_attention"]
    if isinstance(rp, dict) and "rope_theta" in rp:
        out.setdefault("rope_theta", rp["rope_theta"])
        if rp.get("rope_type", "default") != "default":
            out.setdefault("rope_scaling", {k: v for k, v in rp.items() if k != "rope_theta"})
    if "rope_local_base_freq" in d:
        out.setdefault("rope_local_theta", d["rope_local_base_freq"])
    if "hidden_activation" in d:
        out["hidden_act"] = d["hidden_activation"]
    for key, value in DEFAULTS.get(model_type, {}).items():     # (after rope_parameters: theirs come first)
        out.setdefault(key, value)
    if d.get("attn_logit_softcapping") is not None:
        raise CheckpointError("config.json: attention logit soft-capping (attn_logit_softcapping) is not supported")
    out["sliding_window"], out["layer_types"] = _windows(model_type, out)
    return out


def _language_model_config(d: dict) -> dict:
    """A gemma3 (Gemma3ForConditionalGeneration) config -> its text_config as a gemma3_text config,
    with the outer keys that concern the language model (eos ids, tied embeddings, quantization)."""
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError("config.json: a gemma3 (Gemma3ForConditionalGeneration) config needs its language "
                              "model's settings in text_config, an object")
    out = {**text, "model_type": "gemma3_text"}
    for key in _OUTER_KEYS:
        if d.get(key) is not None:
            out[key] = d[key]
    return out


def _windows(model_type: str, d: dict) -> tuple:
    """(the window, each layer's kind or None: every layer alike). A window applies where the config
    turns it on; its layers are those layer_types names "sliding_attention", else all of them
    (Mistral) or those from max_window_layers on (Qwen's rule, as transformers derives it)."""
    window = d.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        window = None
    types = d.get("layer_types")
    if window is None:
        return None, None
    n = d.get("num_hidden_layers", 0)
    if types is None and model_type in ("qwen2", "qwen3"):
        start = d.get("max_window_layers", 0)
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(n)]
    default_pattern = 6 if model_type == "gemma3_text" else None      # (transformers' Gemma3TextConfig's)
    pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", default_pattern))
    if types is None and model_type == "gemma3_text" and isinstance(pattern, int) and pattern > 0:
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    if isinstance(types, list) and all(t == "full_attention" for t in types):
        return None, None        # (Qwen's max_window_layers can leave every layer full)
    return window, types
