"""`minirun serve` against bad requests: each gets its 4xx with OpenAI's JSON error object, on a
connection that stays usable, and the server answers /health and a normal request afterwards.

One engine worker behind two servers: one with an API key (the table's rows send it), one without.
Requests go through http.client on one keep-alive connection (so a row that broke the connection
would fail the next row), or through a raw socket where the body is sent in pieces or not at all.
"""
import http.client
import json
import socket
import time

import pytest
import uvicorn

from minirun import Engine
from minirun.serve import EngineWorker, create_app
from minirun.serve.schemas import ChatRequest, CompletionRequest

from shared import run_cli
from test_serve import ThreadServer

CTX = 2048
KEY = "sesame"
LIMIT = 256 << 10         # the servers' --max-body
AUTH = [("Authorization", f"Bearer {KEY}")]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def chat_body(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, **fields}


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    eng = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=CTX)
    worker = EngineWorker(eng, max_queue=4).start()

    def serve(key):
        app = create_app(worker, "tiny", api_key=key, max_body=LIMIT)
        return ThreadServer(uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off")))
    keyed, open_ = serve(KEY), serve(None)
    keyed.engine = open_.engine = eng
    keyed.worker = open_.worker = worker
    yield keyed, open_
    worker.stop(10)
    keyed.close()
    open_.close()


def send(conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None,
         headers=(("Content-Type", "application/json"), *AUTH)) -> tuple[int, dict]:
    """(status, JSON body) of one request on `conn`; headers: (name, value) pairs, repeats allowed."""
    conn.putrequest(method, path, skip_accept_encoding=True)
    for name, value in headers:
        conn.putheader(name, value)
    if body is not None:
        conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body)
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def encoded(obj) -> bytes:
    return json.dumps(obj).encode()


JSON = ("Content-Type", "application/json")
FIELDS = set(ChatRequest.model_fields) | set(CompletionRequest.model_fields)
# (id, path, body bytes, headers, status, fragment of the error message)
ROWS = [
    ("text/plain", CHAT, encoded(chat_body()), [("Content-Type", "text/plain"), *AUTH], 415, "application/json"),
    ("form", CHAT, b"a=1", [("Content-Type", "application/x-www-form-urlencoded"), *AUTH], 415, "Content-Type"),
    ("nested 30000 deep", CHAT, b"[" * 30_000 + b"]" * 30_000, [JSON, *AUTH], 400, "recursion limit"),
    ("nested object 10000 deep", CHAT, b'{"a":' * 10_000 + b"1" + b"}" * 10_000, [JSON, *AUTH], 400,
     "not valid JSON"),
    ("lone surrogate escaped", CHAT, b'{"messages":[{"role":"user","content":"a\\ud800b"}]}', [JSON, *AUTH], 400,
     "surrogate"),
    ("lone surrogate at the end", CHAT, b'{"messages":[{"role":"user","content":"\\ud800"}]}', [JSON, *AUTH], 400,
     "lone surrogate such as"),
    ("surrogate as UTF-8 bytes", CHAT, b'{"messages":[{"role":"user","content":"\xed\xa0\x80"}]}', [JSON, *AUTH],
     400, "not valid Unicode"),
    ("invalid UTF-8", CHAT, b'{"messages":[{"role":"user","content":"\xff"}]}', [JSON, *AUTH], 400, "not valid JSON"),
    ("NaN", CHAT, b'{"messages":[{"role":"user","content":"a"}],"temperature":NaN}', [JSON, *AUTH], 400,
     "not valid JSON"),
    ("max_tokens string", CHAT, encoded(chat_body(max_tokens="5")), [JSON, *AUTH], 400,
     "max_tokens: Input should be a valid integer"),
    ("max_tokens float", CHAT, encoded(chat_body(max_tokens=5.0)), [JSON, *AUTH], 400, "max_tokens"),
    ("max_tokens 0", CHAT, encoded(chat_body(max_tokens=0)), [JSON, *AUTH], 400, "max_tokens"),
    ("max_tokens 2**80", CHAT, encoded(chat_body(max_tokens=2**80)), [JSON, *AUTH], 400, "max_tokens"),
    ("max_completion_tokens -1", CHAT, encoded(chat_body(max_completion_tokens=-1)), [JSON, *AUTH], 400,
     "max_completion_tokens"),
    ("stream yes", CHAT, encoded(chat_body(stream="yes")), [JSON, *AUTH], 400,
     "stream: Input should be a valid boolean"),
    ("stream 1", CHAT, encoded(chat_body(stream=1)), [JSON, *AUTH], 400, "stream"),
    ("include_usage string", CHAT, encoded(chat_body(stream=True, stream_options={"include_usage": "true"})),
     [JSON, *AUTH], 400, "stream_options.include_usage"),
    ("seed 2**80", CHAT, encoded(chat_body(seed=2**80)), [JSON, *AUTH], 400,
     "seed: Input should be less than or equal to 9223372036854775807"),
    ("seed 2**63", CHAT, encoded(chat_body(seed=2**63)), [JSON, *AUTH], 400, "seed"),
    ("seed -1", CHAT, encoded(chat_body(seed=-1)), [JSON, *AUTH], 400,
     "seed: Input should be greater than or equal to 0"),
    ("seed string", CHAT, encoded(chat_body(seed="7")), [JSON, *AUTH], 400, "seed"),
    ("temperature -1", CHAT, encoded(chat_body(temperature=-1)), [JSON, *AUTH], 400, "temperature"),
    ("temperature 1e30", CHAT, encoded(chat_body(temperature=1e30)), [JSON, *AUTH], 400, "temperature"),
    ("temperature 1e400", CHAT, b'{"messages":[{"role":"user","content":"a"}],"temperature":1e400}', [JSON, *AUTH],
     400, "temperature"),
    ("top_p 1e-320", CHAT, encoded(chat_body(top_p=1e-320)), [JSON, *AUTH], 400, "top_p"),
    ("top_p 0", CHAT, encoded(chat_body(top_p=0)), [JSON, *AUTH], 400, "top_p"),
    ("top_p 1.5", CHAT, encoded(chat_body(top_p=1.5)), [JSON, *AUTH], 400, "top_p"),
    ("repetition_penalty 1e-320", CHAT, encoded(chat_body(repetition_penalty=1e-320)), [JSON, *AUTH], 400,
     "repetition_penalty"),
    ("repetition_penalty 1e30", CHAT, encoded(chat_body(repetition_penalty=1e30)), [JSON, *AUTH], 400,
     "repetition_penalty"),
    ("top_k -1", CHAT, encoded(chat_body(top_k=-1)), [JSON, *AUTH], 400, "top_k"),
    ("top_k 2**40", CHAT, encoded(chat_body(top_k=2**40)), [JSON, *AUTH], 400, "top_k"),
    ("min_p 1", CHAT, encoded(chat_body(min_p=1)), [JSON, *AUTH], 400, "min_p"),
    ("presence_penalty 3", CHAT, encoded(chat_body(presence_penalty=3)), [JSON, *AUTH], 400, "presence_penalty"),
    ("frequency_penalty -2.5", CHAT, encoded(chat_body(frequency_penalty=-2.5)), [JSON, *AUTH], 400,
     "frequency_penalty"),
    ("n 0", CHAT, encoded(chat_body(n=0)), [JSON, *AUTH], 400, "n: Input should be greater than or equal to 1"),
    ("ignore_eos string", CHAT, encoded(chat_body(ignore_eos="true")), [JSON, *AUTH], 400, "ignore_eos"),
    ("token ids as floats", COMPLETIONS, encoded({"prompt": [1.0, 2.0]}), [JSON, *AUTH], 400, "prompt"),
    ("token ids as booleans", COMPLETIONS, encoded({"prompt": [True]}), [JSON, *AUTH], 400, "prompt"),
    ("best_of 0", COMPLETIONS, encoded({"prompt": "a", "best_of": 0}), [JSON, *AUTH], 400, "best_of"),
    ("messages 10001", CHAT, encoded({"messages": [{"role": "user"}] * 10_001}), [JSON, *AUTH], 400,
     "messages: List should have at most 10000 items"),
    ("content parts 10001", CHAT, json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]
                                                            * 10_001}]}, separators=(",", ":")).encode(),
     [JSON, *AUTH], 400, "messages[0].content: Value error, at most 10000 content parts, got 10001"),
    ("text part without its text", CHAT, encoded({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
     [JSON, *AUTH], 400, "messages[0].content[0].text: a text part holds its text as a string (got NoneType)"),
    ("image part", CHAT, encoded({"messages": [{"role": "user", "content": [{"type": "image_url", "text": "a"}]}]}),
     [JSON, *AUTH], 400, "only text parts are supported (got type 'image_url')"),
    ("a prompt no context holds", COMPLETIONS, encoded({"prompt": "a" * 200_000}), [JSON, *AUTH], 400,
     "the prompt is 200000 characters, more than the context of 2048 tokens"),
    ("a conversation no context holds", CHAT, encoded({"messages": [{"role": "user", "content": "b" * 100_000}] * 2}),
     [JSON, *AUTH], 400, "the prompt is 200000 characters"),
    ("2049 token ids", COMPLETIONS, encoded({"prompt": [1] * (CTX + 1)}), [JSON, *AUTH], 400,
     "the prompt is 2049 tokens, longer than the context of 2048"),
    ("token id outside the vocabulary", COMPLETIONS, encoded({"prompt": [1, 10**9]}), [JSON, *AUTH], 400,
     "token id 1000000000 is outside the vocabulary"),
    ("no key", CHAT, encoded(chat_body()), [JSON], 401, "API key"),
    ("two keys, wrong then right", CHAT, encoded(chat_body()), [JSON, ("Authorization", "Bearer nope"), *AUTH],
     401, "API key"),
    ("two keys, right then wrong", CHAT, encoded(chat_body()), [JSON, *AUTH, ("Authorization", "Bearer nope")],
     401, "API key"),
    ("two right keys", CHAT, encoded(chat_body()), [JSON, *AUTH, *AUTH], 401, "API key"),
    ("over --max-body", CHAT, encoded(chat_body(user="x" * LIMIT)), [JSON, *AUTH], 413, "--max-body"),
]


def check_error(status: int, body: dict, want_status: int, fragment: str) -> None:
    assert status == want_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert fragment in body["error"]["message"], body


def test_table_of_bad_requests_then_health_and_an_answer(servers):
    keyed, _ = servers
    conn = http.client.HTTPConnection("127.0.0.1", keyed.port, timeout=60)
    for name, path, body, headers, want, fragment in ROWS:
        status, answer = send(conn, "POST", path, body, headers)
        check_error(status, answer, want, fragment)
        if name.split()[0] in FIELDS:       # a row named after the field it breaks
            assert answer["error"]["param"] == name.split()[0], (name, answer)
    status, health = send(conn, "GET", "/health")       # the same connection, still open
    assert status == 200 and health["status"] == "ok" and not health["busy"]
    status, answer = send(conn, "POST", CHAT, encoded(chat_body(temperature=0, ignore_eos=True)))
    assert status == 200 and answer["usage"]["completion_tokens"] == 2
    conn.close()


def test_extreme_sampling_values_in_range_answer(servers):
    """The edges of every range: the sampler gives a token for each (never a 500)."""
    keyed, _ = servers
    conn = http.client.HTTPConnection("127.0.0.1", keyed.port, timeout=60)
    edges = [dict(top_p=1e-6), dict(temperature=1e-300), dict(temperature=100.0), dict(repetition_penalty=0.01),
             dict(repetition_penalty=100.0), dict(min_p=0.999999, top_k=1), dict(seed=2**63 - 1, top_k=2**31 - 1),
             dict(temperature=5e-5, repetition_penalty=0.01, top_p=1e-6, min_p=0.5)]
    for fields in edges:
        status, answer = send(conn, "POST", CHAT, encoded(chat_body(ignore_eos=True, **fields)))
        assert status == 200 and answer["usage"]["completion_tokens"] == 2, (fields, answer)
    conn.close()


def test_no_key_server_ignores_authorization_headers(servers):
    """Without --api-key nothing is checked: any number of Authorization headers is answered. A body
    without a Content-Type is read as JSON (one that names another type is a 415)."""
    _, open_ = servers
    conn = http.client.HTTPConnection("127.0.0.1", open_.port, timeout=60)
    status, answer = send(conn, "POST", CHAT, encoded(chat_body(ignore_eos=True)),
                          [JSON, ("Authorization", "Bearer a"), ("Authorization", "Bearer b")])
    assert status == 200 and answer["usage"]["completion_tokens"] == 2
    status, answer = send(conn, "POST", CHAT, encoded(chat_body(ignore_eos=True)), [])   # no Content-Type: JSON
    assert status == 200 and answer["usage"]["completion_tokens"] == 2
    conn.close()


def test_a_bug_is_a_json_500_and_the_connection_stays_open(servers, monkeypatch):
    """An unexpected exception in a handler is answered as a JSON 500 inside the app; left to
    Starlette's outermost middleware it reached uvicorn, which reset the connection."""
    keyed, _ = servers

    def broken(text):
        raise TypeError("simulated bug")
    monkeypatch.setattr(keyed.engine, "tokenize", broken)
    conn = http.client.HTTPConnection("127.0.0.1", keyed.port, timeout=60)
    status, answer = send(conn, "POST", COMPLETIONS, encoded({"prompt": "text", "max_tokens": 2}))
    check_error(status, answer, 500, "TypeError: simulated bug")
    status, answer = send(conn, "POST", COMPLETIONS, encoded({"prompt": [5, 6], "max_tokens": 2}))
    assert status == 200 and answer["usage"]["completion_tokens"] <= 2
    conn.close()


def raw_request(port: int, path: str, head: str) -> socket.socket:
    """A socket that has sent a request's head (no body yet)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Authorization: Bearer {KEY}\r\n{head}\r\n".encode())
    return s


def read_response(s: socket.socket) -> tuple[int, dict]:
    r = http.client.HTTPResponse(s)
    r.begin()
    return r.status, json.loads(r.read())


def test_content_length_over_the_limit_is_refused_before_the_body(servers):
    keyed, _ = servers
    s = raw_request(keyed.port, CHAT, f"Content-Length: {100 * LIMIT}\r\n")   # and no body at all
    status, body = read_response(s)
    s.close()
    check_error(status, body, 413, f"limit of {LIMIT} bytes")


def test_chunked_body_is_counted_as_it_arrives_while_health_answers(servers):
    """A body without a length is refused once it passes the limit; meanwhile /health answers."""
    keyed, _ = servers
    s = raw_request(keyed.port, CHAT, "Transfer-Encoding: chunked\r\n")
    piece = b'{"messages": [' + b" " * 4000
    s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
    conn = http.client.HTTPConnection("127.0.0.1", keyed.port, timeout=10)
    status, health = send(conn, "GET", "/health")       # while the body is half sent
    assert status == 200 and health["status"] == "ok"
    conn.close()
    filler = b" " * 8192
    for _ in range(LIMIT // len(filler) + 1):
        s.sendall(b"%x\r\n%s\r\n" % (len(filler), filler))
    status, body = read_response(s)
    s.close()
    check_error(status, body, 413, "--max-body")


def test_abandoned_non_streamed_request_stops_generating(servers, monkeypatch):
    """A /v1/completions whose client closes the connection is cancelled when it closes: the engine
    takes at most the step in flight after the cancel, stops far short of max_tokens, and the next request is
    answered without waiting for it."""
    _, open_ = servers
    eng, worker = open_.engine, open_.worker
    jobs, steps, step, submit = [], [], eng.step, worker.submit   # steps: was the job cancelled, per decode step
    monkeypatch.setattr(worker, "submit", lambda job: (jobs.append(job), submit(job))[1])
    monkeypatch.setattr(eng, "step", lambda tok: (steps.append(jobs[-1].cancel.is_set()), step(tok))[1])
    body = encoded({"prompt": "Abandoned", "max_tokens": CTX - 100, "temperature": 0, "ignore_eos": True})
    s = raw_request(open_.port, COMPLETIONS, f"Content-Length: {len(body)}\r\n")
    s.sendall(body)
    deadline = time.time() + 30
    while len(steps) < 20:      # generating
        assert time.time() < deadline, "the generation did not start"
        time.sleep(0.005)
    at_close = len(steps)
    s.close()
    while worker.busy:
        assert time.time() < deadline + 30, "the generation did not stop"
        time.sleep(0.005)
    res = eng.last_result
    assert jobs[-1].cancel.is_set() and res.finish_reason == "cancelled"
    # the flag is read before each step: a cancel that lands between that read and the step lets
    # that one step run (within a token), never more
    assert sum(steps) <= 1, "the engine went on stepping after the cancel"
    # (the first token comes from the prompt's logits, each step feeds one; the last one sampled is not fed)
    assert len(res.tokens) == len(steps) + 1 < CTX // 2, (len(res.tokens), len(steps))
    # the close is seen as it happens, not at the next poll: a few tokens at most while the event
    # loop's thread waits for the GIL (~170 tokens/s here: a 0.5 s poll would let ~40 through)
    assert len(steps) - at_close <= 16, (at_close, len(steps))
    conn = http.client.HTTPConnection("127.0.0.1", open_.port, timeout=60)
    status, answer = send(conn, "POST", COMPLETIONS, encoded({"prompt": "Next", "max_tokens": 3, "ignore_eos": True}))
    assert status == 200 and answer["usage"]["completion_tokens"] == 3
    assert answer["timings"]["queued_s"] < 5       # it did not wait behind the abandoned one
    conn.close()


@pytest.mark.parametrize("value,fragment", [("2G", "2147483648 bytes is not in the range 1K to 1G"),
                                            ("100", "100 bytes is not in the range"),
                                            ("lots", "bad memory size 'lots'")])
def test_max_body_option_bounds(value, fragment, capsys):
    code, _, err = run_cli(["serve", "/nonexistent/minirun-model", "--port", "0", "--max-body", value], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and fragment in lines[0] and "Traceback" not in err, err


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_a_token_stands_for_at_most_longest_token_chars(which, tiny_model_dir, request):
    """The bound the server refuses long texts by, before tokenizing them: never below the truth."""
    from minirun.checkpoint.tokenizer import Tokenizer
    path = tiny_model_dir("gqa-untied") if which == "tiny" else request.getfixturevalue("smollm2_dir")
    tok = Tokenizer(path)
    longest = tok.longest_token_chars()
    texts = ["#" * 500, " " * 300 + "\n" * 40, "naïve café – 東京 🎉 " * 30,
             "<|im_start|>user\nhi<|im_end|>" * 20, "".join(chr(c) for c in range(32, 2000)), "def f(x):\n" + "    return x\n" * 50]
    for text in texts:
        assert len(text) <= len(tok.encode(text, add_bos=False)) * longest, text[:40]
