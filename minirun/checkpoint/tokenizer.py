"""Tokenizer (tokenizers or sentencepiece) plus the chat template, rendered with jinja2."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import CheckpointError, MiniRunError


def _token_str(tok) -> str | None:
    """tokenizer_config.json holds special tokens as strings or as {"content": ...} dicts."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None


class Tokenizer:
    """encode/decode text and render chat messages for one model directory."""

    def __init__(self, model_dir: str | Path, config: dict | None = None):
        model_dir = Path(model_dir)
        config = config or _read_json(model_dir / "config.json")
        tcfg = _read_json(model_dir / "tokenizer_config.json")
        gen = _read_json(model_dir / "generation_config.json")
        if (model_dir / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as HFTokenizer
            try:
                self._tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
            except Exception as e:  # the library raises a bare Exception on bad JSON
                raise CheckpointError(f"tokenizer.json in {model_dir} cannot be read ({str(e).splitlines()[0]})") from None
            self._tok.no_padding()      # (a file that sets them for training would add pad ids to every
            self._tok.no_truncation()   # prompt, or cut it short without a word)
            self._sp = None
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        elif (model_dir / "tokenizer.model").is_file():
            import sentencepiece as spm
            self._tok = None
            self._sp = spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
            self.vocab_size = self._sp.get_piece_size()
        else:
            raise CheckpointError(f"no tokenizer.json or tokenizer.model in {model_dir}")

        self.bos_token = _token_str(tcfg.get("bos_token"))
        self.eos_token = _token_str(tcfg.get("eos_token"))
        self.bos_id = self._first_id(gen.get("bos_token_id"), config.get("bos_token_id"), self.bos_token)
        eos = [e for e in (gen.get("eos_token_id"), config.get("eos_token_id")) if e is not None]
        eos_ids = set()
        for e in eos:
            eos_ids.update(e if isinstance(e, list) else [e])
        if self.eos_token is not None and self.token_to_id(self.eos_token) is not None:
            eos_ids.add(self.token_to_id(self.eos_token))
        self.eos_ids = tuple(sorted(eos_ids))
        # sentencepiece models add BOS by convention; tokenizer.json ones say so in their post-processor
        self.add_bos = bool(tcfg.get("add_bos_token", self._sp is not None))
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (model_dir / "chat_template.jinja").is_file():
            template = (model_dir / "chat_template.jinja").read_text()
        self.chat_template = template
        self._compiled = None

    def _first_id(self, *candidates) -> int | None:
        for c in candidates:
            if isinstance(c, int):
                return c
            if isinstance(c, str):
                i = self.token_to_id(c)
                if i is not None:
                    return i
        return None

    def token_to_id(self, token: str) -> int | None:
        if self._tok is not None:
            return self._tok.token_to_id(token)
        i = self._sp.piece_to_id(token)
        return None if i == self._sp.unk_id() and token != self._sp.id_to_piece(i) else i

    def longest_token_chars(self) -> int:
        """The most characters of text one token stands for, at most: its piece's length (a
        byte-level piece has a character per byte, a sentencepiece one is the text or a byte)."""
        if self._tok is not None:
            return max(map(len, self._tok.get_vocab(with_added_tokens=True)))
        return max(len(self._sp.id_to_piece(i)) for i in range(self._sp.get_piece_size()))

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """text -> ids; BOS is prepended when the model wants it (once, even if the text starts with it)."""
        add_bos = self.add_bos if add_bos is None else add_bos
        if self._tok is not None:   # (encode_batch lets go of the GIL, encode holds it: a server's
            # event loop stalled for the whole of a long text)
            ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self._sp.encode(text)
        if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        if self._tok is not None:
            return self._tok.decode(list(ids), skip_special_tokens=skip_special)
        return self._sp.decode(list(ids))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render messages [{"role", "content"}] to the prompt text the model was tuned on."""
        if self.chat_template is None:
            # no template: a plain transcript, which base models continue reasonably
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant:" if add_generation_prompt else "")
        if self._compiled is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._compiled = env.from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise CheckpointError(f"the chat template does not parse ({e})") from None
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def _raise_template_error(msg: str):
    raise MiniRunError(f"chat template: {msg}")
