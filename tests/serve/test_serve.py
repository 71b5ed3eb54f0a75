"""`minirun serve` against real servers on free localhost ports, through the official `openai` client.

Most tests share one server (uvicorn in a thread) over a tiny random model. Greedy answers are
compared between requests that reach the engine in the same state: every prompt starts with its
own first character, so each one shares exactly the chat template's header with whatever the
cache held before (the prompt is then computed the same way, whatever came before it).
"""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import uvicorn

from minirun import Engine
from minirun.serve import EngineWorker, create_app
from minirun.serve.server import make_server

REPO = Path(__file__).resolve().parents[2]
CTX = 4096
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


class ThreadServer:
    """A uvicorn server in a thread on a free port (the socket bound here: no race for the port)."""

    def __init__(self, server: uvicorn.Server):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = server
        self.thread = threading.Thread(target=server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key="none"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def close(self):
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


def post(url, body: bytes, headers=None):
    """(status, JSON body, headers) of a raw POST."""
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("gqa-untied")


@pytest.fixture(scope="module")
def served(model_dir):
    eng = Engine.load(model_dir, device="cpu", ctx=CTX)
    srv = ThreadServer(make_server(eng, "tiny", max_queue=8, log_level="warning"))
    srv.engine = eng
    srv.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "warm up"}], **GREEDY)
    yield srv
    srv.close()


def chat(client, text, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], **{**GREEDY, **kw})


def streamed(client, text, **kw):
    """(joined content, finish_reason, usage or None) of a streamed chat answer."""
    parts, finish, usage = [], None, None
    for chunk in chat(client, text, stream=True, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(parts), finish, usage


def test_models_and_health(served):
    assert [m.id for m in served.client().models.list().data] == ["tiny"]
    with urllib.request.urlopen(served.url + "/health") as r:
        assert json.loads(r.read())["status"] == "ok"


def test_chat_plain_and_streamed_with_usage(served):
    c = served.client()
    ids = served.engine.chat_prompt([{"role": "user", "content": "Alpha question"}])
    plain = chat(c, "Alpha question")
    assert plain.object == "chat.completion" and plain.choices[0].finish_reason == "length"
    assert plain.choices[0].message.role == "assistant" and plain.choices[0].message.content
    u = plain.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(ids), 12, len(ids) + 12)
    assert 0 < u.prompt_tokens_details.cached_tokens < len(ids)   # the template's header, from the warm-up
    chat(c, "Beta separator")
    text, finish, usage = streamed(c, "Alpha question", stream_options={"include_usage": True})
    assert text == plain.choices[0].message.content and finish == "length"
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 12)
    # a stop string ends the answer before it (and finish_reason says so)
    chat(c, "Beta separator")
    cut = plain.choices[0].message.content
    stop = cut[len(cut) // 2:len(cut) // 2 + 2]
    stopped = chat(c, "Alpha question", stop=[stop, "never there"])
    assert stopped.choices[0].message.content == cut[:cut.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_completions(served):
    c = served.client()
    r = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(served.engine.tokenize("Once upon a time")) and r.usage.completion_tokens == 5
    chat(c, "Beta separator")
    parts = [ch.choices[0].text for ch in c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5,
                                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
             if ch.choices]
    assert "".join(parts) == r.choices[0].text
    ids = served.engine.tokenize("Zebra")
    by_ids = c.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert by_ids.usage.prompt_tokens == len(ids)


def test_four_concurrent_clients_get_their_own_answers(served):
    """Each client its own prompt and seed (sampled answers: the tiny model's greedy ones look alike)."""
    c = served.client()
    prompts = ["Red apples", "Green pears and figs", "Blue plums", "Yellow lemons, limes"]
    lengths = [len(served.engine.chat_prompt([{"role": "user", "content": p}])) for p in prompts]
    kw = lambda i: dict(temperature=1.0, seed=100 + i)   # noqa: E731
    expected = [chat(c, p, **kw(i)).choices[0].message.content for i, p in enumerate(prompts)]
    assert len(set(expected)) == 4
    chat(c, "Beta separator")

    def ask(i):
        if i % 2:
            text, _, usage = streamed(served.client(), prompts[i], stream_options={"include_usage": True}, **kw(i))
            return text, usage.prompt_tokens
        r = chat(served.client(), prompts[i], **kw(i))
        return r.choices[0].message.content, r.usage.prompt_tokens
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(ask, range(4))) == list(zip(expected, lengths))


def test_dropped_stream_stops_generation_then_next_request(served):
    c = served.client()
    eng = served.engine
    stream = chat(c, "Drop me", stream=True, max_tokens=CTX - 100)
    got = 0
    for chunk in stream:
        got += sum(1 for ch in chunk.choices if ch.delta.content)
        if got >= 3:
            break
    stream.close()
    deadline = time.time() + 10
    while eng.last_result.finish_reason != "cancelled" or served.server.worker.busy:
        assert time.time() < deadline, "the generation did not stop"
        time.sleep(0.02)
    assert len(eng.last_result.tokens) < CTX // 2
    r = chat(c, "Zulu after the drop")
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12


def test_bad_requests_get_openai_errors(served):
    status, body, _ = post(served.url + "/v1/chat/completions", b'{"messages": [')
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    assert "not valid JSON" in body["error"]["message"]
    status, body, _ = post(served.url + "/v1/chat/completions", json.dumps({"model": "tiny"}).encode())
    assert status == 400 and body["error"]["param"] == "messages"
    c = served.client()
    with pytest.raises(openai.BadRequestError) as e:
        chat(c, "x", n=2)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        chat(c, "x", extra_body={"tools": [], "functions": [], "ignore_eos": True})
    assert "functions" in e.value.body["message"] and "tools" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(c, "x" * (CTX + 10))
    msg = e.value.body["message"]
    n = len(served.engine.chat_prompt([{"role": "user", "content": "x" * (CTX + 10)}]))
    assert str(n) in msg and str(CTX) in msg and e.value.body["code"] == "context_length_exceeded"
    assert chat(c, "Yankee still fine").choices[0].message.content


def test_internal_error_is_500_and_the_server_goes_on(served):
    c = served.client()
    model = served.engine.model

    def broken(*a, **kw):
        raise RuntimeError("simulated failure")
    model.forward = broken
    try:
        with pytest.raises(openai.InternalServerError) as e:
            chat(c, "Xray breaks")
        assert "simulated failure" in e.value.body["message"]
    finally:
        del model.forward
    assert chat(c, "Xray works").usage.completion_tokens == 12


def test_long_prefix_is_cached_and_first_token_comes_sooner(served):
    c = served.client()
    doc = "".join(f"Line {i}: the value of item {i} is {i * 7 % 13}.\n" for i in range(95))   # ~3400 tokens
    prefix = len(served.engine.chat_prompt([{"role": "system", "content": doc}, {"role": "user", "content": ""}]))

    def first_token(question):
        t0 = time.perf_counter()
        stream = c.chat.completions.create(model="tiny", messages=[{"role": "system", "content": doc},
                                                                   {"role": "user", "content": question}],
                                           stream=True, max_tokens=4, temperature=0,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        ttft, usage = None, None
        for chunk in stream:
            if ttft is None and any(ch.delta.content or ch.finish_reason for ch in chunk.choices):
                ttft = time.perf_counter() - t0
            usage = chunk.usage or usage
        return ttft, usage
    t1, u1 = first_token("What is item 3?")
    (t2, u2), (t3, u3) = first_token("What is item 9?"), first_token("Which item is 5?")
    assert u1.prompt_tokens > 3000 and u1.prompt_tokens_details.cached_tokens < 50
    for u in (u2, u3):      # the document, and the template around it
        assert u.prompt_tokens_details.cached_tokens >= prefix - 20
    assert min(t2, t3) < t1 / 3, (t1, t2, t3)


def test_full_queue_answers_503_with_retry_after(model_dir):
    worker = EngineWorker(Engine.load(model_dir, device="cpu", ctx=512), max_queue=1)   # not started yet
    srv = ThreadServer(uvicorn.Server(uvicorn.Config(create_app(worker, "tiny"), log_level="warning", lifespan="off")))
    try:
        waiting = ThreadPoolExecutor(1).submit(chat, srv.client(), "First in")
        deadline = time.time() + 10
        while worker.queued < 1:
            assert time.time() < deadline
            time.sleep(0.02)
        with pytest.raises(openai.APIStatusError) as e:
            chat(srv.client(), "Second in")
        assert e.value.status_code == 503 and int(e.value.response.headers["retry-after"]) >= 1
        worker.start()
        assert waiting.result(30).usage.completion_tokens == 12
    finally:
        worker.stop(5)
        srv.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_server_api_key_prompt_cache_and_sigterm(model_dir, tmp_path):
    """`minirun serve` as a process: the key is required, --prompt-cache is loaded at start (a
    prompt that starts with its tokens prefills only the rest), SIGTERM mid-answer stops it cleanly."""
    story = "Once upon a time, in a land far away, "
    eng = Engine.load(model_dir, device="cpu", ctx=1024, far_positions="auto")   # (the CLI's setting)
    eng.prefill(eng.tokenize(story))
    eng.save_prompt_cache(tmp_path / "story.kv")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "minirun", "serve", str(model_dir), "--port", str(port),
                             "--ctx", "1024", "--api-key", "sesame", "--prompt-cache", str(tmp_path / "story.kv")],
                            env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            assert proc.poll() is None and time.time() < deadline, "the server did not start"
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        mk = lambda key: openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)   # noqa: E731
        with pytest.raises(openai.AuthenticationError):
            mk("wrong").models.list()
        status, body, _ = post(url + "/v1/chat/completions", b"{}")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        r = mk("sesame").completions.create(model="tiny", prompt=story + "there lived", max_tokens=3)
        assert r.usage.prompt_tokens_details.cached_tokens == len(eng.tokenize(story))
        assert chat(mk("sesame"), "Key works").usage.completion_tokens == 12
        stream = chat(mk("sesame"), "Long answer", stream=True, max_tokens=1000)
        next(iter(stream))                      # the answer has begun
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in stream:                    # ends with the shutdown's error event, not at 1000 tokens
                pass
        assert proc.wait(30) == 0 and time.time() - t0 < 20
    finally:
        if proc.poll() is None:
            proc.kill()
        err = proc.stderr.read()
    assert "stopped" in err and "Traceback" not in err
