"""`minirun serve --replicas 2` on a local Ray instance (started and stopped here), against one
`minirun serve` over the same tiny random model: the same answers, documents that stay on their
replica, a replica killed mid-answer, a model that does not load.

Greedy answers are compared between requests that reach an engine in the same state (as in
test_serve.py): every prompt starts with its own first character and each engine has answered
once before, so each prompt shares exactly the chat template's header with what the cache held.
"""
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from minirun import Engine
from minirun.cli.main import main
from minirun.errors import MiniRunError
from minirun.serve.server import make_server

ray = pytest.importorskip("ray", reason="the ray extra is not installed: pip install -e '.[ray]'")
from ray import serve  # noqa: E402

from minirun.serve import launch  # noqa: E402

pytestmark = pytest.mark.ray
CTX = 2048
OPTIONS = dict(ctx=CTX, device="cpu", dtype="float32", kv="dense", kv_budget="0.25", tau=0.9, window=256, sinks=16,
               max_select=None, threads=1, hca_opts={}, weights="stored")
DOC_A = "Alpha report. " + " ".join(f"The {i}th apple weighs {i % 7} ounces." for i in range(40))
DOC_B = "Beta manual. " + " ".join(f"Step {i}: turn knob {i % 5} twice." for i in range(40))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT = free_port()   # (Serve's proxy takes the port of the first application for the whole Ray instance)


def post(url, body: dict, timeout=120):
    """(status, JSON body) of a POST."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat(url, text, stream=False, max_tokens=12):
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if not stream:
        return post(url + "/v1/chat/completions", body)
    body["stream_options"] = {"include_usage": True}
    return streamed(url, body)


def streamed(url, body: dict, on_first=None):
    """(content, finish_reason, usage, error) of a streamed answer; on_first() after the first text."""
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    parts, finish, usage, error = [], None, None, None
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                continue
            usage = event.get("usage") or usage
            for c in event["choices"]:
                text = c["delta"].get("content")
                if text and on_first and not "".join(parts):
                    on_first()
                parts.append(text or "")
                finish = c["finish_reason"] or finish
    return "".join(parts), finish, usage, error


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("gqa-untied")


@pytest.fixture(scope="module")
def single(model_dir):
    """One `minirun serve` (uvicorn in a thread), warmed up."""
    server = make_server(Engine.load(model_dir, device="cpu", ctx=CTX, threads=1), "tiny", log_level="warning")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    chat(url, "warm up")
    yield url
    server.should_exit = True
    thread.join(15)
    sock.close()


@pytest.fixture(scope="module")
def replicas(model_dir):
    """Two replicas (--threads 1 each) on a local Ray instance; each has answered once."""
    url = launch.start(model_dir, OPTIONS, 2, port=PORT, max_queue=4, model_name="tiny")
    fresh = 0
    for i in range(6):   # the router sends a prompt sharing nothing to the replica that answered least lately
        fresh += chat(url, f"{'wxyz'[i % 4]} warm up")[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        if fresh == 2:
            break
    assert fresh == 2, "the warm-up did not reach both replicas"
    yield url
    launch.stop(joined=False)


def engine_actors() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "EngineReplica" in a["name"]}


@pytest.mark.parametrize("args, words", [
    (["--replicas", "2"], "no such model directory"),                       # found before Ray starts
    (["--address", "auto"], "--address joins a Ray cluster for --replicas"),
    (["--replicas", "2", "--prompt-cache", "x.kv"], "--prompt-cache is not taken with --replicas"),
])
def test_cli_refusals_are_one_line(args, words, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", str(tmp_path / "nope"), *args])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and err.startswith("error: ") and words in err and "\n" not in err


def test_model_that_does_not_load_is_one_line(model_dir, tmp_path):
    """A replica's own load failure (here: the weights missing where the driver finds the config
    and tokenizer) ends start() with one line. (First in the file: no other replica holds the CPUs.)"""
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in model_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            (broken / f.name).write_bytes(f.read_bytes())
    with pytest.raises(MiniRunError) as e:
        launch.start(broken, OPTIONS, 1, port=PORT, max_queue=2, name="broken")
    message = str(e.value)
    assert message.startswith("the replicas did not start: the model did not load on ") and "\n" not in message
    assert "broken" not in serve.status().applications


def test_same_answers_routes_and_errors_as_one_server(single, replicas):
    for text in ("Alpha question", "Beta separator", "Gamma ray", "Delta"):
        s_status, s = chat(single, text)
        r_status, r = chat(replicas, text)
        assert (s_status, r_status) == (200, 200)
        assert r["choices"][0]["message"]["content"] == s["choices"][0]["message"]["content"]
        assert r["usage"]["prompt_tokens"] == s["usage"]["prompt_tokens"] and r["usage"]["completion_tokens"] == 12
        assert set(r["timings"]) >= {"queued_s", "prefill_s", "decode_tps"}
    s_text, s_finish, s_usage, _ = chat(single, "Epsilon stream", stream=True)
    r_text, r_finish, r_usage, r_error = chat(replicas, "Epsilon stream", stream=True)
    assert (r_text, r_finish, r_error) == (s_text, "length", None) and r_usage["completion_tokens"] == 12
    done = post(replicas + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})
    assert done[0] == 200 and done[1]["object"] == "text_completion"
    for bad in ({"messages": []}, {"messages": [{"role": "user", "content": "x" * (CTX + 10)}]},
                {"messages": [{"role": "user", "content": "hi"}], "n": 3}):
        s_status, s = post(single + "/v1/chat/completions", bad)
        r_status, r = post(replicas + "/v1/chat/completions", bad)
        assert r_status == s_status == 400 and r == s
    with urllib.request.urlopen(replicas + "/v1/models") as resp:
        assert [m["id"] for m in json.loads(resp.read())["data"]] == ["tiny"]
    with urllib.request.urlopen(replicas + "/health") as resp:   # (two replicas of one slot each, idle)
        assert json.loads(resp.read()) | {"model": "tiny"} == {"status": "ok", "model": "tiny", "ctx": CTX,
                                                              "kv": "dense", "busy": False, "queued": 0,
                                                              "slots": 2, "active": 0}


def test_documents_with_follow_ups_stay_on_their_replica(replicas):
    """Alternating follow-ups on two documents: each finds its document in its replica's cache."""
    for doc in (DOC_A, DOC_B):
        assert chat(replicas, doc + " Summarize.")[0] == 200
    for question in ("What is first?", "What is last?", "How many?"):
        for doc in (DOC_A, DOC_B):
            status, r = chat(replicas, doc + " " + question)
            u = r["usage"]
            assert status == 200 and u["prompt_tokens_details"]["cached_tokens"] >= 0.9 * u["prompt_tokens"], u


def test_killed_replica_fails_only_its_requests_and_is_replaced(replicas):
    """Two long answers on the two documents' replicas; one replica killed mid-answer: its client
    gets a clean error event, the other answer completes, new requests are answered, and Serve
    brings the deployment back to two replicas."""
    before = engine_actors()
    assert len(before) == 2
    started = threading.Barrier(3, timeout=60)

    def body(doc):   # (document + answer within the context of 2048 tokens)
        return {"messages": [{"role": "user", "content": doc + " Tell me more."}], "max_tokens": 600,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with ThreadPoolExecutor(2) as pool:
        answers = [pool.submit(streamed, replicas, body(doc), started.wait) for doc in (DOC_A, DOC_B)]
        started.wait()
        victim = sorted(before)[0]
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        results = [a.result() for a in answers]
    errors = [r[3] for r in results if r[3] is not None]
    assert len(errors) == 1 and errors[0]["code"] == "replica_lost", results
    whole = [r for r in results if r[3] is None]
    assert whole[0][1] == "length" and whole[0][2]["completion_tokens"] == 600
    for i in range(4):   # the survivor answers (or a new replica)
        status, r = chat(replicas, f"{'pqrs'[i]} after the kill")
        assert status == 200, r
    deadline = time.time() + 90
    while time.time() < deadline:
        now = engine_actors()
        st = serve.status().applications[launch.APP].deployments["EngineReplica"]
        if len(now) == 2 and now != before and st.replica_states.get("RUNNING") == 2:
            break
        time.sleep(1)
    else:
        pytest.fail(f"the killed replica was not replaced: {engine_actors()}")
    assert chat(replicas, DOC_A + " Again?")[0] == 200
