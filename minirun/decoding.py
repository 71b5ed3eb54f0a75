"""One answer being decoded, apart from the forward passes that feed it.

A Decoding turns each step's logits into the next token (the sampler), watches the stop tokens,
stop strings, the token budget and the context's room, holds back text that may start a stop
string or ends inside a multi-byte character, and records each token's log-probabilities when
asked. Engine._run feeds it one sequence's logits step by step; the server's scheduler
(minirun/serve/scheduler.py) feeds several answers from one batched step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling import Sampler, SamplingParams


@dataclass
class GenerationResult:
    tokens: list[int]               # new ids (stop token excluded)
    text: str
    prompt_tokens: int
    prefill_tps: float              # over the prompt tokens actually computed (a reused prefix is free)
    decode_tps: float
    prefill_s: float = 0.0
    decode_s: float = 0.0
    reused_tokens: int = 0          # prompt prefix served from the cache of the previous call
    finish_reason: str = "length"   # "stop" | "length" | "ctx" | "cancelled" (should_stop said so)
    timings: dict = field(default_factory=dict)
    # with logprobs asked for: per new token (id, log-probability, [(id, log-probability)] of the
    # `top` most likely), from the model's distribution before any sampling setting reshapes it
    logprobs: list | None = None
    prompt_logprobs: list | None = None   # the same of each prompt token given those before it (the first: None)


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[int, float, list]:
    """logits [V] -> (token, its log-probability, the top most likely [(id, log-probability)])."""
    return sequence_logprobs(logits[None], [token], top)[0]


def sequence_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[tuple[int, float, list]]:
    """logits [T, V], tokens [T] (row t's next token) -> token_logprobs of each row."""
    lp = torch.log_softmax(logits.float(), -1)
    picked = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
    best = [[] for _ in tokens]
    if top:
        vals, ids = lp.topk(min(top, lp.shape[1]), dim=1)
        best = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return list(zip(tokens, picked, best))


class Decoding:
    """The state of one answer: feed it logits with `take` until `done`.

    prompt_tokens: the prompt's length; room: how many tokens the context holds after the prompt
    (the last token sampled is never fed, so an answer may be room + 1 tokens long); eos: the ids
    that end the answer; logprobs: None, or how many most likely tokens to report beside each one.
    """

    def __init__(self, tokenizer, prompt_tokens: int, max_new_tokens: int, sampling: SamplingParams, stop=(),
                 eos=frozenset(), room: int = 1 << 62, logprobs: int | None = None, history: list | None = None):
        self.tokenizer, self.max_new, self.room, self.eos = tokenizer, max_new_tokens, room, eos
        self.sampling, self.sampler = sampling, Sampler(sampling)
        self.stops = tuple(s for s in (stop or ()) if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1   # chars held back: they may start a stop string
        self.history = torch.tensor(history or [], dtype=torch.long)     # (the repetition penalty's)
        self.top = logprobs
        self.res = GenerationResult([], "", prompt_tokens, 0.0, 0.0, logprobs=[] if logprobs is not None else None)
        self.emitted = 0
        self.done = False
        self.next: int | None = None      # the token to feed next (None once done)

    def take(self, logits: torch.Tensor) -> str:
        """The next token from logits [V] (of the last token fed) -> the text now safe to show.
        Afterwards `next` is the token to feed, or `done` is True and res.finish_reason says why."""
        res = self.res
        self.next = None
        if len(res.tokens) >= self.max_new:
            return self.finish("length")
        penalty = self.sampling.repetition_penalty != 1.0
        tok = self.sampler(logits, self.history if penalty else None)
        if tok in self.eos:
            return self.finish("stop")
        res.tokens.append(tok)
        if res.logprobs is not None:
            res.logprobs.append(token_logprobs(logits, tok, self.top))
        if penalty:
            self.history = torch.cat([self.history, torch.tensor([tok])])
        text = self.tokenizer.decode(res.tokens)
        cut = min((text.find(s) for s in self.stops if s in text), default=-1)
        if cut >= 0:
            res.text = text[:cut]
            return self.finish("stop")
        piece = ""
        if not text.endswith("\ufffd"):        # wait for the rest of a multi-byte character
            res.text = text
            safe = len(text) - self.hold
            if safe > self.emitted:
                piece, self.emitted = text[self.emitted:safe], safe
        if len(res.tokens) > self.room:       # no room to feed it: the context is full
            return piece + self.finish("ctx")
        self.next = tok
        return piece

    def finish(self, reason: str) -> str:
        """End the answer (reason: "stop" | "length" | "ctx" | "cancelled") -> the text held back."""
        self.done, self.next = True, None
        self.res.finish_reason = reason
        rest = self.res.text[self.emitted:]
        self.emitted = len(self.res.text)
        return rest
