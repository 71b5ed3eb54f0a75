"""Build a `tokenizers` tokenizer (tokenizer.json) and tokenizer_config.json from GGUF metadata.

A GGUF stores its vocabulary under llama.cpp's keys (`tokenizer.ggml.*`). Two vocabulary kinds are
supported, which cover Llama-architecture models:

* "gpt2": byte-level BPE with merges; `tokenizer.ggml.pre` picks the pre-tokenizer (split regex).
* "llama": SentencePiece BPE with byte fallback; merges are rebuilt from the token scores the way
  transformers' slow->fast conversion does; spaces become "▁" and a "▁" is prepended like
  SentencePiece's dummy prefix (the Llama-2 tokenizer.json normalizer; llama.cpp does the same).

Control tokens (type 3) become special added tokens and user-defined ones (type 4) plain added tokens,
so that e.g. "<|im_start|>" always encodes to its own id. The post-processor adds no BOS: the runtime
adds it itself when tokenizer_config.json says `add_bos_token`.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from ..errors import CheckpointError

# llama.cpp token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's (and Qwen3's): Llama 3's with digits one at a time
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> (kind, ignore_merges). Kinds: "gpt2" = GPT-2 regex; "digits" = every digit
# split off first, then the GPT-2 regex (SmolLM/StarCoder; HF: Digits(individual_digits) + ByteLevel);
# "llama3"/"qwen2"/"tekken" = that split regex then byte-level mapping.
PRE_TOKENIZERS = {
    "default": ("gpt2", False),
    "gpt2": ("gpt2", False),
    "gpt-2": ("gpt2", False),
    "smollm": ("digits", False),
    "starcoder": ("digits", False),
    "refact": ("digits", False),
    "codeshell": ("digits", False),
    "llama-bpe": ("llama3", True),
    "llama3": ("llama3", True),
    "llama-v3": ("llama3", True),
    "smaug-bpe": ("llama3", False),
    "dbrx": ("llama3", False),
    "falcon3": ("llama3", False),
    "tekken": ("tekken", False),
    "qwen2": ("qwen2", False),
}


def _tokens(meta: Mapping[str, Any]) -> list[str]:
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise CheckpointError("GGUF has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    return list(tokens)


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    dupes = 0
    for i, tok in enumerate(tokens):
        if tok in vocab:
            dupes += 1
        else:
            vocab[tok] = i
    if dupes:
        warnings.warn(f"GGUF vocabulary has {dupes} duplicate token strings; the later copies are unreachable")
    return vocab


def _merges(meta: Mapping[str, Any]) -> list[tuple[str, str]]:
    out = []
    for m in meta.get("tokenizer.ggml.merges") or ():
        parts = m.split(" ")
        if len(parts) != 2:
            raise CheckpointError(f"GGUF tokenizer merge {m!r} is not two space-separated tokens")
        out.append((parts[0], parts[1]))
    return out


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    best-scoring result first (the same order as transformers' `generate_merges`)."""
    merges = []
    for merged, score in scores.items():
        local = []
        for i in range(1, len(merged)):
            left, right = merged[:i], merged[i:]
            if left in vocab and right in vocab:
                local.append((left, right, score))
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda x: (x[2], len(x[0]), len(x[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _added_tokens(tokens: list[str], types: list[int] | None, vocab: dict[str, int]):
    special, plain = [], []
    for i, (tok, ty) in enumerate(zip(tokens, types or ())):
        if vocab.get(tok) != i or not tok:
            continue
        if ty in (CONTROL, UNKNOWN):
            special.append(AddedToken(tok, special=True, normalized=False))
        elif ty == USER_DEFINED:
            plain.append(AddedToken(tok, special=False, normalized=False))
    return special, plain


def _byte_level_pre_tokenizer(pre: str | None):
    kind, ignore_merges = PRE_TOKENIZERS.get(pre or "default", (None, False))
    if kind is None:
        warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}; using the GPT-2 split, tokenization may differ")
        kind = "gpt2"
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if kind == "gpt2":
        return byte_level, ignore_merges
    if kind == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]), ignore_merges
    split = {"llama3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT, "tekken": TEKKEN_SPLIT}[kind]
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ]), ignore_merges


def _gpt2_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    tokens = _tokens(meta)
    vocab = _vocab(tokens)
    merges = _merges(meta)
    if not merges:
        raise CheckpointError("GGUF byte-level (gpt2) tokenizer has no merges (tokenizer.ggml.merges)")
    pre, ignore_merges = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    extra = {"ignore_merges": True} if ignore_merges else {}  # (tokenizers >= 0.19)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, **extra))
    tok.normalizer = None
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _llama_spm_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    tokens = _tokens(meta)
    vocab = _vocab(tokens)
    merges = _merges(meta)
    if not merges:
        scores = meta.get("tokenizer.ggml.scores")
        if not scores or len(scores) != len(tokens):
            raise CheckpointError("GGUF SentencePiece tokenizer has neither merges nor token scores")
        types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        # Byte tokens (<0x41>) and control tokens never take part in merges.
        by_score = {t: float(s) for t, s, ty in zip(tokens, scores, types)
                    if ty not in (BYTE, CONTROL, UNKNOWN) and vocab.get(t) is not None}
        merges = merges_from_scores(vocab, by_score)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # SentencePiece's dummy prefix: "▁" before the text even when it already starts with a space, and
    # (as llama.cpp does) again after each added token. This is the normalizer of the Llama-2 HF
    # tokenizer.json; a Metaspace pre-tokenizer would skip the "▁" for text starting with a space.
    steps_n = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence(steps_n + [normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    tok.post_processor = None
    return tok


def build_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the GGUF's vocabulary (no BOS/EOS added on encode)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok = _gpt2_tokenizer(meta)
    elif kind == "llama":
        tok = _llama_spm_tokenizer(meta)
    else:
        raise CheckpointError(f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2', 'llama')")
    tokens = _tokens(meta)
    special, plain = _added_tokens(tokens, meta.get("tokenizer.ggml.token_type"), _vocab_of(tok))
    if special:
        tok.add_special_tokens(special)
    if plain:
        tok.add_tokens(plain)
    return tok


def _vocab_of(tok: Tokenizer) -> dict[str, int]:
    return tok.get_vocab(with_added_tokens=False)


def _token_str(tokens: list[str], meta: Mapping[str, Any], key: str) -> str | None:
    i = meta.get(f"tokenizer.ggml.{key}_token_id")
    if i is None or not 0 <= int(i) < len(tokens):
        return None
    return tokens[int(i)]


def build_tokenizer_config(meta: Mapping[str, Any], model_max_length: int) -> dict:
    """tokenizer_config.json contents: special token strings, add_bos_token, chat_template."""
    tokens = _tokens(meta)
    is_spm = meta.get("tokenizer.ggml.model") == "llama"
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token_str(tokens, meta, "bos"),
        "eos_token": _token_str(tokens, meta, "eos"),
        "unk_token": _token_str(tokens, meta, "unknown"),
        "pad_token": _token_str(tokens, meta, "padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", is_spm)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": int(model_max_length),
        "clean_up_tokenization_spaces": False,
    }
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return config
