"""Load test of a running `minirun serve` (or any OpenAI-compatible server), from the client's side.

1. N concurrent clients x M streamed chat requests each (fixed length: ignore_eos): time to first
   token (waiting for a free slot included), p50 and p95; each answer's decode tokens/s after its
   first token, p50 and p95 (the slow tail: 1 / p95 of the time per token); and the aggregate
   tokens/s. --mixed-doc-tokens: the same with N - 1 short clients while one more sends a long
   document (how long the short ones wait behind its prefill).
2. A long document (--doc-tokens, counted with --tokenizer) with a question, then --followups more
   questions about the same document: time to first token of the first request (the whole
   prefill) against the next ones (the document reused: usage.prompt_tokens_details.cached_tokens).
   --documents 2: two documents, their questions alternating (replicas behind one endpoint: does
   each follow-up reach the replica holding its document?).
   Each answer is --doc-answer-tokens long, so question + answer pass the HCA cache's 256-token
   ring and the next request must come back to the end of the document past it.

    minirun serve models/SmolLM2-135M-Instruct --ctx 20K --kv hca &
    python scripts/bench_serve.py --tokenizer models/SmolLM2-135M-Instruct -o serve_hca.json

Stdlib only (http.client), so it measures any server without this project installed, except the
document sizing, which uses minirun's tokenizer.
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import random
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlparse


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


class Client:
    def __init__(self, url: str, api_key: str | None, timeout: float):
        u = urlparse(url)
        self.host, self.port, self.timeout = u.hostname, u.port or 80, timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def get(self, path: str) -> dict:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        conn.request("GET", path, headers=self.headers)
        return json.loads(conn.getresponse().read())

    def chat(self, content: str, max_tokens: int) -> dict:
        """One streamed chat request -> {ttft, total, tokens, prompt_tokens, cached_tokens, decode_tps}."""
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", json.dumps(body), self.headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        first = usage = None
        timings = {}
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if first is None and any(c["delta"].get("content") or c.get("finish_reason") for c in chunk["choices"]):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings   # (minirun's server-side seconds, where given)
        end = time.perf_counter()
        conn.close()
        n = usage["completion_tokens"]
        return {"ttft": first - t0, "total": end - t0, "tokens": n, "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                "decode_tps": (n - 1) / (end - first) if n > 1 and end > first else None, "server": timings}


def concurrent_phase(client: Client, clients: int, requests: int, max_tokens: int, document: str | None = None,
                     doc_answer_tokens: int = 16) -> dict:
    """clients x requests short chats at once; document: one more client sends it with a question at
    the start (the mixed phase: how long the short ones wait behind its prefill)."""
    results, errors, doc_row = [], [], {}
    topics = ["rivers", "bridges", "owls", "glass", "tides", "maps", "bees", "clocks", "salt", "kites"]

    def run(c: int):
        for m in range(requests):
            topic = topics[(c * requests + m) % len(topics)]
            try:
                results.append(client.chat(f"Client {c}, request {m}: write a few sentences about {topic}.",
                                           max_tokens))
            except Exception as e:   # (reported, the other clients go on)
                errors.append(f"client {c} request {m}: {e}")

    def read_document():
        try:
            doc_row.update(client.chat(f"Read this document:\n\n{document}\n\nQuestion: what is it about?",
                                       doc_answer_tokens))
        except Exception as e:
            errors.append(f"document client: {e}")
    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    if document is not None:
        threads.insert(0, threading.Thread(target=read_document))
    for t in threads:
        t.start()
        if document is not None and t is threads[0]:
            time.sleep(0.05)     # (its prefill has started when the short ones arrive)
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [r["ttft"] for r in results]
    tpot = [1 / r["decode_tps"] for r in results if r["decode_tps"]]   # seconds per token after the first
    return {"clients": clients, "requests_each": requests, "max_tokens": max_tokens, "answered": len(results),
            "errors": errors, "wall_s": wall, "tokens": sum(r["tokens"] for r in results),
            "aggregate_tps": sum(r["tokens"] for r in results) / wall,
            "ttft_p50": percentile(ttft, 50) if ttft else None, "ttft_p95": percentile(ttft, 95) if ttft else None,
            # tokens/s of the median answer, and of the slow tail (1 / p95 of the time per token)
            "decode_tps_p50": 1 / percentile(tpot, 50) if tpot else None,
            "decode_tps_p95": 1 / percentile(tpot, 95) if tpot else None,
            **({"document": {k: doc_row.get(k) for k in ("prompt_tokens", "ttft", "total")}} if document else {})}


def make_document(tokenizer_dir: str, n_tokens: int, seed: int = 0) -> tuple[str, list[tuple[str, int]]]:
    """A text of n_tokens tokens (log records with numbers a question can ask about) and questions."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from minirun.checkpoint.tokenizer import Tokenizer
    tok = Tokenizer(tokenizer_dir)
    rng = random.Random(seed)
    cities = ["Lisbon", "Oslo", "Quito", "Hanoi", "Dakar", "Perth", "Tromso", "Lima", "Cork", "Nagoya"]
    lines = []
    while True:
        i = len(lines)
        lines.append(f"Record {i}: the shipment to {rng.choice(cities)} weighed {rng.randint(10, 990)} kg "
                     f"and left on day {rng.randint(1, 365)}.")
        if i % 50 == 0 and len(tok.encode("\n".join(lines), add_bos=False)) > n_tokens:
            break
    ids = tok.encode("\n".join(lines), add_bos=False)[:n_tokens]
    text = tok.decode(ids)
    records = text.count("Record ")
    questions = [f"How much did the shipment in record {rng.randrange(records - 1)} weigh?" for _ in range(16)]
    return text, questions


def document_phase(client: Client, docs: list[tuple[str, list[str]]], followups: int, max_tokens: int) -> list[dict]:
    """Each document's first question, then its follow-ups, the documents taking turns."""
    rows = []
    for i in range(followups + 1):
        for d, (doc, questions) in enumerate(docs):
            q = questions[i]
            r = client.chat(f"Read this document:\n\n{doc}\n\nQuestion: {q}", max_tokens)
            r["question"], r["document"], r["round"] = q, d, i
            rows.append(r)
            report_row(r, i, d if len(docs) > 1 else None)
    return rows


def report_row(r: dict, i: int, doc: int | None) -> None:
    """One line on stderr: request i (0: the first question) of document `doc` (None: the only one)."""
    sv = r["server"]
    inside = (f" (server: tokenize {sv['tokenize_s']:.2f} s, first text {sv['first_text_s']:.2f} s wall, "
              f"{sv['first_text_cpu_s']:.2f} s CPU)" if "first_text_cpu_s" in sv else "")
    which = ("" if doc is None else f"document {doc} ") + ("first" if i == 0 else f"follow-up {i}")
    print(f"  {which}: prompt {r['prompt_tokens']} tok, cached {r['cached_tokens']}, first token {r['ttft']:.2f} s"
          f"{inside}, {r['tokens']} tok at {r['decode_tps'] or 0:.1f} tok/s", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per answer in the concurrent phase")
    ap.add_argument("--doc-tokens", type=int, default=16384, help="0: no document phase")
    ap.add_argument("--followups", type=int, default=3)
    ap.add_argument("--documents", type=int, default=1, help="documents whose questions take turns")
    ap.add_argument("--doc-answer-tokens", type=int, default=300)
    ap.add_argument("--mixed-doc-tokens", type=int, default=0,
                    help="a mixed phase: --clients - 1 short clients while one more sends a document of this many "
                         "tokens (0: none)")
    ap.add_argument("--tokenizer", default="models/SmolLM2-135M-Instruct", help="model directory to size the document")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("-o", "--out", default=None, help="write the results as JSON")
    a = ap.parse_args()
    client = Client(a.url, a.api_key, a.timeout)
    health = client.get("/health")
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "server": health}
    print(f"server: {health}", file=sys.stderr)
    if a.clients and a.requests:
        c = concurrent_phase(client, a.clients, a.requests, a.max_tokens)
        report["concurrent"] = c
        print(f"{a.clients} clients x {a.requests} requests x {a.max_tokens} tokens: {c['answered']} answered in "
              f"{c['wall_s']:.1f} s, {c['aggregate_tps']:.1f} tok/s in all; first token p50 {c['ttft_p50']:.2f} s, "
              f"p95 {c['ttft_p95']:.2f} s; decode p50 {c['decode_tps_p50']:.1f} tok/s, p95 (slow tail) "
              f"{c['decode_tps_p95']:.1f} tok/s")
        for e in c["errors"]:
            print(f"  error: {e}")
    if a.mixed_doc_tokens:
        doc, _ = make_document(a.tokenizer, a.mixed_doc_tokens, seed=99)
        m = concurrent_phase(client, max(1, a.clients - 1), a.requests, a.max_tokens, doc)
        report["mixed"] = m
        print(f"{a.clients - 1} short clients beside a {a.mixed_doc_tokens}-token document: first token p50 "
              f"{m['ttft_p50']:.2f} s, p95 {m['ttft_p95']:.2f} s; the document's first token "
              f"{m['document']['ttft'] or float('nan'):.2f} s")
    if a.doc_tokens:
        docs = [make_document(a.tokenizer, a.doc_tokens, seed=d) for d in range(a.documents)]
        rows = document_phase(client, docs, a.followups, a.doc_answer_tokens)
        report["document"] = {"doc_tokens": a.doc_tokens, "documents": a.documents,
                              "answer_tokens": a.doc_answer_tokens, "requests": rows}
        firsts, follow = [r for r in rows if r["round"] == 0], [r for r in rows if r["round"] > 0]
        ttft = lambda rs: ", ".join(f"{r['ttft']:.2f}" for r in rs)   # noqa: E731
        print(f"{a.documents} document(s) of {a.doc_tokens} tokens: first token {ttft(firsts)} s; follow-ups "
              f"{ttft(follow)} s (cached/prompt tokens "
              f"{', '.join(str(r['cached_tokens']) + '/' + str(r['prompt_tokens']) for r in follow)})")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
