"""Request bodies of the OpenAI-compatible endpoints (pydantic), and the checks pydantic cannot express.

Unknown fields are kept (extra="allow") so that `unsupported()` can name them in a 400 instead of
ignoring them: a client asking for tools or log-probabilities must learn that it did not get them.
A few OpenAI fields are accepted at their neutral value only (n = 1, suffix, best_of 1, penalties 0).
Types are strict (a JSON string is not an integer, 1 is not a boolean; an integer is a float) and
every number has a range: the sampler's own ones, OpenAI's for penalties, n and seed (a signed
64-bit integer that is not negative), and for temperature, top_p and repetition_penalty a bound that
keeps the sampler's float32 arithmetic finite (temperature: wider than OpenAI's 0 to 2).
"""
from __future__ import annotations

from typing import ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ApiError(Exception):
    """An error answered as OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


MAX_INT = 2**31 - 1       # token counts and top_k: more than any context or vocabulary
MAX_SEED = 2**63 - 1      # OpenAI's seed is a signed 64-bit integer; torch's generator takes it as is
MAX_MESSAGES = 10_000     # (and content parts of one message) validating one takes ~20 us, holding the GIL: 200,000 of them stalled the server 5 s
TOP_P_MIN = 1e-6          # below it nucleus sampling keeps the most likely token alone: temperature 0 says so


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class Request(BaseModel):
    """The fields /v1/chat/completions and /v1/completions share."""
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None                  # one model is served: any name is answered by it
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, ge=TOP_P_MIN, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=128)
    user: str | None = None                   # a label for the caller's own records: accepted, unused
    # the CLI's sampling extensions
    top_k: int = Field(0, ge=0, le=MAX_INT)
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    repetition_penalty: float = Field(1.0, ge=0.01, le=100.0)
    ignore_eos: bool = False
    # OpenAI fields accepted at their neutral value only
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict | None = None

    NEUTRAL: ClassVar[dict] = {"presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                               "logit_bias": (None, {})}

    def unsupported(self) -> list[str]:
        """Fields this server does not honour: unknown ones and known ones at a non-neutral value."""
        bad = list(self.model_extra or {})
        bad += [f for f, ok in self.NEUTRAL.items() if getattr(self, f) not in ok]
        return bad

    def check(self) -> None:
        """ApiError 400 for n != 1 and unsupported fields (naming them)."""
        if self.n not in (None, 1):
            raise ApiError(400, f"n = {self.n}: this server answers with one choice per request (n = 1)", "n",
                           "unsupported_value")
        bad = self.unsupported()
        if bad:
            raise ApiError(400, f"unsupported field{'s' if len(bad) > 1 else ''}: {', '.join(bad)}", bad[0],
                           "unsupported_parameter")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ApiError(400, f"stop: at most 4 sequences, got {len(self.stop)}", "stop")

    def sampling(self) -> dict:
        """Keyword arguments of Engine.decoding: the sampler, the stop strings, log-probabilities."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                    repetition_penalty=self.repetition_penalty, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos,
                    logprobs=self.logprob_count)

    @property
    def logprob_count(self) -> int | None:
        """None: no log-probabilities; else how many most likely tokens beside each one (each
        endpoint's own fields say)."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[dict], None] = None     # a string, or content parts: text ones only
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _few_parts(cls, v):
        if isinstance(v, list) and len(v) > MAX_MESSAGES:   # (before each part is validated)
            raise ValueError(f"at most {MAX_MESSAGES} content parts, got {len(v)}")
        return v

    def check(self, where: str) -> None:
        for j, part in enumerate(self.content if isinstance(self.content, list) else ()):
            if part.get("type") != "text":
                raise ApiError(400, f"{where}.content[{j}]: only text parts are supported (got type "
                               f"{part.get('type')!r})", f"{where}.content[{j}]", "unsupported_value")
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}.content[{j}].text: a text part holds its text as a string (got "
                               f"{type(part.get('text')).__name__})", f"{where}.content[{j}].text")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p["text"] for p in self.content)
        return self.content or ""


class ChatRequest(Request):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        for i, m in enumerate(self.messages):
            bad += [f"messages[{i}].{f}" for f in (m.model_extra or {})]
        return bad

    def check(self) -> None:
        super().check()
        for i, m in enumerate(self.messages):
            m.check(f"messages[{i}]")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs: logprobs must be true to use it", "top_logprobs")

    @property
    def logprob_count(self) -> int | None:
        """None: no log-probabilities; else how many most likely tokens beside each one."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self) -> list[dict]:
        """The messages as the chat template takes them (developer is the newer name of system)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(Request):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(16, ge=1, le=MAX_INT)   # (OpenAI's default for completions)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=20)
    logprobs: int | None = Field(None, ge=0, le=20)
    NEUTRAL: ClassVar[dict] = {**Request.NEUTRAL, "suffix": (None,), "best_of": (None, 1)}

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompt_input(self) -> str | list[int]:
        """The one prompt: text or token ids (a list of several prompts is a batch: refused)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(400, f"prompt: one prompt per request, got {len(p)}", "prompt", "unsupported_value")
            p = p[0]
        return p

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens
