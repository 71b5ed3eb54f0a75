"""The OpenAI-compatible HTTP API over one EngineWorker (FastAPI).

Answers carry OpenAI's fields plus `timings` (as llama.cpp's server does): seconds spent
tokenizing, queued, to the first text (wall and the process's CPU time), in the prefill, and the
decode tokens/s; streams put it in the chunk with the finish_reason.

GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions. Prompts are
tokenized here, off the event loop (the tokenizer is thread-safe; the engine is not and stays in
the worker), so an over-long prompt is refused before it waits in the queue. Bodies are parsed by
hand from JSON into the pydantic models of schemas.py, so that every failure is answered with
OpenAI's error object: a body that is not JSON (415 by its Content-Type), one over --max-body (413,
by its Content-Length before any of it is read, else as it arrives), JSON that is invalid, nested
deeper than the parser's limit or holds a lone surrogate (400), fields out of range (400).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
import traceback
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from pydantic_core import from_json
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import MiniRunError
from .page import add_page
from .schemas import ApiError, ChatRequest, CompletionRequest
from .worker import EngineWorker, InternalError, Job, QueueFull, ShuttingDown

FINISH = {"stop": "stop", "length": "length", "ctx": "length", "cancelled": "length"}
MAX_BODY = 8 << 20     # bytes of a request body (--max-body): a 16K-token prompt is ~100 KB


def error_of(e: Exception) -> ApiError:
    """The HTTP error for an exception the worker reported or a request raised."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, QueueFull):
        return ApiError(503, str(e), code="queue_full", type_="server_error", headers={"Retry-After": str(e.retry_after)})
    if isinstance(e, ShuttingDown):
        return ApiError(503, str(e), code="shutting_down", type_="server_error")
    if isinstance(e, InternalError):
        return ApiError(500, f"internal error: {e}", code="internal_error", type_="server_error")
    if isinstance(e, MiniRunError):
        return ApiError(400, str(e))
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error", type_="server_error")


def describe(e: ValidationError) -> tuple[str, str | None]:
    """(message, param) of a pydantic error: the first problem, where it is, how many more."""
    errs = e.errors()
    first = errs[0]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".") or None
    more = f" (and {len(errs) - 1} more problem{'s' if len(errs) > 2 else ''})" if len(errs) > 1 else ""
    return f"{param + ': ' if param else ''}{first['msg']}{more}", param


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) by its Content-Length before reading or once more than `limit` bytes
    arrived (a chunked body has no length); 415 unless it says it is JSON (or says nothing).
    (Starlette's RequestBodyLimitMiddleware answers some of its 413s in plain text.)"""
    kind = request.headers.get("content-type")
    if kind is not None and kind.split(";")[0].strip().lower() != "application/json":
        raise ApiError(415, f"the request body must be JSON: send 'Content-Type: application/json' (got {kind!r})",
                       code="unsupported_media_type")
    too_big = ApiError(413, f"the request body is larger than the server's limit of {limit} bytes (--max-body)",
                       code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_big
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
    except ClientDisconnect:    # (no traceback for it: nobody reads the answer)
        raise ApiError(499, "client closed the request while sending its body") from None
    return b"".join(chunks)


def parse_json(raw: bytes, model):
    """The body as `model` (run in a thread: a large body does not hold up the event loop). The
    parser refuses nesting deeper than 200 levels, lone surrogates and NaN/Infinity, so no string
    the tokenizer cannot encode gets past it."""
    try:
        data = from_json(raw, allow_inf_nan=False)
    except ValueError as e:
        why = (": a string is not valid Unicode (a lone surrogate such as \\ud800, or a broken \\u escape)"
               if any(w in str(e) for w in ("surrogate", "hex escape", "unicode")) else "")
        raise ApiError(400, f"the request body is not valid JSON ({e}){why}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        message, param = describe(e)
        raise ApiError(400, message, param, "invalid_value") from None
    body.check()
    return body


async def parse_body(request: Request, model, limit: int):
    return await run_in_threadpool(parse_json, await read_body(request, limit), model)


def check_text(chars: int, ctx: int, per_token: int, param: str) -> None:
    """Refuse a text that cannot fit in ctx tokens before tokenizing it (megabytes take the
    tokenizer seconds and gigabytes of memory): a token stands for at most `per_token` characters."""
    if chars > ctx * per_token:
        raise ApiError(400, f"the prompt is {chars} characters, more than the context of {ctx} tokens (--ctx) can "
                       f"hold (a token is at most {per_token} characters)", param, "context_length_exceeded")


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage_of(res) -> dict:
    n = len(res.tokens)
    return {"prompt_tokens": res.prompt_tokens, "completion_tokens": n, "total_tokens": res.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": res.reused_tokens}}


def token_text(tokenizer, tok: int) -> str:
    return tokenizer.decode([tok], skip_special=False)


class Answer:
    """The response objects of one request: chat.completion(.chunk) or text_completion.
    tokenizer: names the tokens of log-probabilities; echo: the prompt [ids] to show before the
    answer (completions), with its log-probabilities when asked (GenerationResult.prompt_logprobs)."""

    def __init__(self, chat: bool, model: str, include_usage: bool = False, tokenizer=None, echo=None):
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.tokenizer, self.echo = tokenizer, echo
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.offset = 0          # (completions: the text offset of the next token)

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def logprobs(self, entries) -> dict | None:
        """OpenAI's logprobs object of entries [(id, logprob | None, [(id, logprob)])]: chat's
        content list, or completions' parallel lists (with text offsets)."""
        if entries is None:
            return None
        name = lambda t: token_text(self.tokenizer, t)   # noqa: E731
        if self.chat:
            def entry(t, lp):
                text = name(t)
                return {"token": text, "logprob": lp, "bytes": list(text.encode())}
            return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                                for t, lp, top in entries]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, top in entries:
            out["tokens"].append(name(t))
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(None if lp is None else {name(i): v for i, v in top})
            out["text_offset"].append(self.offset)
            self.offset += len(out["tokens"][-1])
        return out

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False, timings=None,
              logprobs=None) -> dict:
        lp = self.logprobs(logprobs) if logprobs else None
        if self.chat:
            delta = ({"role": "assistant", "content": ""} if role else {} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}
        return {**self._head(True), "choices": [choice], **({"usage": None} if self.include_usage else {}),
                **({"timings": timings} if timings else {})}

    def usage_chunk(self, res) -> dict:
        return {**self._head(True), "choices": [], "usage": usage_of(res)}

    def full(self, res, timings: dict) -> dict:
        finish = FINISH[res.finish_reason]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": res.text},
                      "logprobs": self.logprobs(res.logprobs), "finish_reason": finish}
        else:
            text, entries = res.text, res.logprobs
            if self.echo is not None:
                text = self.tokenizer.decode(self.echo) + text
                if entries is not None:
                    entries = (res.prompt_logprobs or []) + entries
            choice = {"index": 0, "text": text, "logprobs": self.logprobs(entries), "finish_reason": finish}
        return {**self._head(False), "choices": [choice], "usage": usage_of(res), "timings": timings}


async def stream(job: Job, ans: Answer):
    """Server-sent events of one answer; `[DONE]` last. Leaving early (the client closed the
    connection: Starlette cancels this generator) cancels the job: the engine stops within a token.
    Log-probabilities go with the text they were read before (job.result's, as the worker
    appends them), the rest with the last chunk."""
    sent = 0

    def new_logprobs(res) -> list:
        nonlocal sent
        entries = (res.logprobs or []) if res is not None else []
        got, sent = entries[sent:], len(entries)
        return got
    try:
        if ans.chat:
            yield sse(ans.chunk(None, role=True))
        elif ans.echo is not None:
            yield sse(ans.chunk(ans.tokenizer.decode(ans.echo)))
        while True:
            kind, value = await job.next_event()
            if kind == "text":
                yield sse(ans.chunk(value, logprobs=new_logprobs(job.result)))
            elif kind == "done":
                yield sse(ans.chunk(None, FINISH[value.finish_reason], timings=job.timings,
                                    logprobs=new_logprobs(value)))
                if ans.include_usage:
                    yield sse(ans.usage_chunk(value))
                break
            else:
                yield sse(error_of(value).body())
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel.set()


async def collect(job: Job, request: Request):
    """The final result of a job (non-streamed answers), or None when the client left first: then the
    job is cancelled at once, so the engine stops within a token, as a dropped stream's does."""
    gone = asyncio.create_task(disconnected(request))
    try:
        while True:
            event = asyncio.create_task(job.next_event())
            await asyncio.wait((event, gone), return_when=asyncio.FIRST_COMPLETED)
            if not event.done():
                event.cancel()
                job.cancel.set()
                return None
            kind, value = event.result()
            if kind == "done":
                return value
            if kind == "error":
                raise error_of(value)
    finally:
        gone.cancel()


async def disconnected(request: Request) -> None:
    """Returns when the client has closed the connection (its body is read: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class JsonErrorRoute(APIRoute):
    """A route whose unexpected exceptions (bugs) become a JSON 500 inside the app: one left to
    Starlette's ServerErrorMiddleware is answered too, but then re-raised to uvicorn, which resets
    the connection (a keep-alive client's next request failed)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def guarded(request):
            try:
                return await handler(request)
            except (ApiError, StarletteHTTPException, RequestValidationError):
                raise
            except Exception as e:
                traceback.print_exc(file=sys.stderr)
                raise error_of(e) from None
        return guarded


class ApiKeyCheck:
    """ASGI middleware: /v1 requests need one header 'Authorization: Bearer KEY' (checked before the
    body is read; a second Authorization header fails the check, whatever either says)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            auths = [v for k, v in scope["headers"] if k == b"authorization"]   # (ASGI names are lower case)
            scheme, _, token = (auths[0] if len(auths) == 1 else b"").partition(b" ")   # two keys: neither counts
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                err = ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                               code="invalid_api_key")
                await JSONResponse(err.body(), 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error object: ours, Starlette's (404, 405) and any other exception."""
    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        err = error_of(e)
        return JSONResponse(err.body(), err.status)


def check_prompt(ids: list[int], ctx: int, param: str) -> None:
    """A 400 for an empty prompt or one longer than the context."""
    if not ids:
        raise ApiError(400, "the prompt is empty", param)
    if len(ids) > ctx:
        raise ApiError(400, f"the prompt is {len(ids)} tokens, longer than the context of {ctx} tokens (--ctx)",
                       param, "context_length_exceeded")


def add_info_routes(app: FastAPI, worker: EngineWorker, model_name: str, started: int) -> None:
    """GET /health (503 while stopping) and /v1/models."""
    eng = worker.engine
    ctx = eng.config.ctx

    @app.get("/health")
    async def health():
        stopping = worker.stopping.is_set()
        return JSONResponse({"status": "stopping" if stopping else "ok", "model": model_name, "ctx": ctx,
                             "kv": eng.config.kv, "busy": worker.busy, "queued": worker.queued,
                             "slots": worker.slot_count, "active": worker.active},
                            503 if stopping else 200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                            "owned_by": "minirun", "context_length": ctx}]}


def create_app(worker: EngineWorker, model_name: str, api_key: str | None = None, max_body: int = MAX_BODY) -> FastAPI:
    """The API over `worker` (started by the caller); model_name: the id /v1/models reports; max_body:
    the largest request body in bytes."""
    eng = worker.engine
    ctx = eng.config.ctx
    started = int(time.time())
    app = FastAPI(title="minirun", docs_url=None, redoc_url=None, openapi_url=None)
    app.router.route_class = JsonErrorRoute
    if api_key:
        app.add_middleware(ApiKeyCheck, key=api_key)
    eng.tokenizer.apply_chat_template([{"role": "user", "content": "."}])   # compile the template once, here

    add_error_handlers(app)
    per_token = eng.tokenizer.longest_token_chars()

    async def answer(request: Request, body, ids: list[int], chat: bool, tokenize_s: float):
        max_new = body.max_new_tokens or max(1, ctx - len(ids))
        echo = ids if not chat and body.echo else None
        job = Job(ids, max_new, body.sampling(), asyncio.get_running_loop(),
                  prompt_logprobs=body.logprob_count if echo is not None else None)
        job.timings["tokenize_s"] = tokenize_s
        try:
            worker.submit(job)
        except (QueueFull, ShuttingDown) as e:
            raise error_of(e) from None
        ans = Answer(chat, model_name, body.include_usage, eng.tokenizer, echo)
        if body.stream:
            return StreamingResponse(stream(job, ans), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        res = await collect(job, request)
        if res is None:   # the client left: nobody reads this
            return JSONResponse(ApiError(499, "client closed the request").body(), 499)
        return JSONResponse(ans.full(res, job.timings))

    add_page(app, eng, model_name, bool(api_key))   # GET / (the chat page), /static/*, /props

    add_info_routes(app, worker, model_name, started)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse_body(request, ChatRequest, max_body)
        messages = body.chat_messages()
        check_text(sum(len(m["content"]) for m in messages), ctx, per_token, "messages")
        t0 = time.perf_counter()
        try:
            ids = await run_in_threadpool(eng.chat_prompt, messages)
        except MiniRunError as e:   # the template refused the conversation (its raise_exception)
            raise ApiError(400, str(e), "messages") from None
        check_prompt(ids, ctx, "messages")
        return await answer(request, body, ids, True, time.perf_counter() - t0)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest, max_body)
        prompt = body.prompt_input()
        t0 = time.perf_counter()
        if isinstance(prompt, str):
            check_text(len(prompt), ctx, per_token, "prompt")
            ids = await run_in_threadpool(eng.tokenize, prompt) if prompt else []
        else:
            ids = list(prompt)     # (ints: the model is strict)
            check_prompt(ids, ctx, "prompt")     # (its length before a pass over a million ids)
            bad = [i for i in ids if not 0 <= i < eng.args.vocab_size]
            if bad:
                raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary (0..{eng.args.vocab_size - 1})",
                               "prompt")
        check_prompt(ids, ctx, "prompt")
        return await answer(request, body, ids, False, time.perf_counter() - t0)

    return app
