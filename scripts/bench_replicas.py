"""One engine against replicas on Ray Serve, from the client's side (scripts/bench_serve.py), in
paired rounds: each round starts every server in turn, alone on the machine, and runs the same
load against it.

    python scripts/bench_replicas.py --model ~/.cache/minirun/models/SmolLM2-135M-Instruct \
        --rounds 2 --doc-tokens 4096 -o docs/results/serve-replicas.json

Servers: `minirun serve --threads 2` (one engine), `--replicas 2 --threads 1` with the document
router, and the same with Ray Serve's own router (--router ray-default), each with serve's default
--parallel slots. The load: --clients x --requests streamed answers of --max-tokens tokens, then
two documents whose questions take turns (bench_serve.py --documents 2). With --kill-after S the
replicas then answer the same short load once more while one replica is killed S seconds into it:
which requests failed, and how long Serve took to have two replicas running again. Writes a
results file of kind "serve" (scripts/results_tables.py).
"""
from __future__ import annotations

import argparse
import json
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVERS = {   # --servers name: (label, minirun serve's flags)
    "engine": ("1 engine x 2 threads", ["--threads", "2"]),
    "document": ("2 replicas x 1 thread, document router", ["--threads", "1", "--replicas", "2"]),
    "ray-default": ("2 replicas x 1 thread, Ray Serve's router",
                    ["--threads", "1", "--replicas", "2", "--router", "ray-default"]),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, started: threading.Event, timeout: float) -> None:
    """Until the server has said it serves (its "Ctrl-C stops" line: with replicas, Serve's HTTP
    proxy answers /health while the engines are still loading) and /health answers."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200 and started.is_set():
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError("the server did not answer /health in time")


def echo_until_started(proc: subprocess.Popen, started: threading.Event) -> None:
    """Copy the server's stderr to ours; set `started` at its line saying it serves."""
    for line in proc.stderr:
        sys.stderr.write(line)
        if "Ctrl-C stops" in line:
            started.set()


# Run in a process of its own (a Ray driver joining the server's local instance): kill one engine
# replica, then wait until Serve runs two again -> JSON {victim, recovered_s}.
KILL_REPLICA = """
import json, sys, time
import ray
from ray import serve
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
def engines():
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "EngineReplica" in a["name"])
victim = engines()[0]
ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
t0, recovered = time.time(), None
while time.time() - t0 < float(sys.argv[1]):
    st = serve.status().applications["minirun"].deployments["EngineReplica"]
    now = engines()
    if len(now) == 2 and victim not in now and st.replica_states.get("RUNNING") == 2:
        recovered = time.time() - t0
        break
    time.sleep(0.5)
print(json.dumps({"victim": victim, "recovered_s": recovered}))
"""


def kill_phase(a, url: str, out: Path) -> dict:
    """The short load again, one replica killed a.kill_after seconds into it -> its report: what was
    answered, the errors, and when Serve had two replicas running again."""
    load = subprocess.Popen([sys.executable, str(REPO / "scripts" / "bench_serve.py"), "--url", url,
                             "--clients", str(a.clients), "--requests", str(a.requests), "--max-tokens",
                             str(a.max_tokens), "--doc-tokens", "0", "-o", str(out)], cwd=REPO)
    time.sleep(a.kill_after)
    killed = subprocess.run([sys.executable, "-c", KILL_REPLICA, "300"], capture_output=True, text=True, cwd=REPO)
    if load.wait() != 0 or killed.returncode != 0:
        raise RuntimeError(f"the kill phase failed: {killed.stderr[-500:]}")
    c = json.loads(out.read_text())["concurrent"]
    return {"kill_after_s": a.kill_after, **json.loads(killed.stdout.strip().splitlines()[-1]),
            **{k: c[k] for k in ("answered", "errors", "wall_s", "tokens", "aggregate_tps", "ttft_p95")}}


def one_run(a, label: str, flags: list[str], out: Path) -> dict:
    """Start one server, run bench_serve.py against it (and with replicas, the kill phase), stop it
    -> bench_serve.py's report."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "minirun", "serve", a.model, "--ctx", a.ctx, "--port", str(port),
                               *flags], cwd=REPO, stderr=subprocess.PIPE, text=True, errors="replace")
    started = threading.Event()
    threading.Thread(target=echo_until_started, args=(server, started), daemon=True).start()
    try:
        wait_ready(url, server, started, a.start_timeout)
        subprocess.run([sys.executable, str(REPO / "scripts" / "bench_serve.py"), "--url", url,
                        "--clients", str(a.clients), "--requests", str(a.requests), "--max-tokens", str(a.max_tokens),
                        "--doc-tokens", str(a.doc_tokens), "--documents", "2", "--followups", str(a.followups),
                        "--doc-answer-tokens", str(a.doc_answer_tokens), "--tokenizer", a.model, "-o", str(out)],
                       check=True, cwd=REPO)
        report = json.loads(out.read_text())
        if a.kill_after and "--replicas" in flags:
            report["kill"] = kill_phase(a, url, out)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()
    report["label"] = label
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--ctx", default="8K")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--doc-tokens", type=int, default=4096)
    ap.add_argument("--followups", type=int, default=2)
    ap.add_argument("--doc-answer-tokens", type=int, default=64)
    ap.add_argument("--servers", type=lambda v: v.split(","), default=list(SERVERS),
                    help=f"which servers, in each round's order (comma-separated: {', '.join(SERVERS)})")
    ap.add_argument("--kill-after", type=float, default=0,
                    help="seconds into a last short load at which one replica is killed (0: no kill phase)")
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--machine", default=f"{platform.machine()}, shared with other work")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    if not a.servers or set(a.servers) - set(SERVERS):
        ap.error(f"--servers: comma-separated names from {', '.join(SERVERS)}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            for label, flags in (SERVERS[name] for name in a.servers):
                print(f"round {rnd + 1}: {label}", file=sys.stderr)
                r = one_run(a, label, flags, Path(tmp) / "run.json")
                r["label"], r["commit"] = f"{label} (round {rnd + 1})", commit
                runs.append(r)
                write(a, commit, runs)   # (after each run: an interrupted series keeps what it measured)


def write(a, commit: str, runs: list[dict]) -> None:
    short = f"{a.clients} clients x {a.requests} streamed requests" if a.clients and a.requests else ""
    docs = f"2 documents of {a.doc_tokens} tokens whose questions take turns" if a.doc_tokens else ""
    rounds = f"{-(-len(runs) // len(a.servers))} round(s) of the {len(a.servers)} servers one after the other"
    who = "One engine against 2 replicas" if "engine" in a.servers else "2 replicas, with either router,"
    result = {"title": f"{who} on Ray Serve: {Path(a.model).name}, --ctx {a.ctx}, "
                       + ", then ".join(x for x in (short, docs) if x) + f"; {rounds}",
              "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
              "machine": a.machine, "date": datetime.now(timezone.utc).date().isoformat(), "commit": commit,
              "kind": "serve", "runs": runs}
    tmp = Path(a.out).with_suffix(".part")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(a.out)


if __name__ == "__main__":
    main()
