"""Engine replicas on Ray Serve behind one OpenAI-compatible endpoint (`minirun serve --replicas N`).

Two deployments:
  Ingress        the app of app.py, as `minirun serve` runs it (serve.ingress), over a RemoteWorker:
                 prompts are tokenized there, and each Job goes to a replica through a handle
                 whose request router (router.DocumentRouter) picks the replica by its cache.
  EngineReplica  one Engine and its EngineWorker per Ray actor (its own process, --threads CPUs,
                 --parallel slots stepped together as in `minirun serve`), streaming a Job's
                 events back; it reports what its slots' caches hold (block hashes) for the router.
A replica that dies fails the requests it was answering (503 replica_lost, in the stream when it
had begun); Serve starts another, and the router sends the next requests to the living ones.
"""
from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from collections import deque

from ..config import EngineConfig, ModelArgs
from ..engine import Engine
from ..errors import MiniRunError
from ..checkpoint.tokenizer import Tokenizer
from . import affinity
from .schemas import ApiError
from .worker import EngineWorker, InternalError, Job, QueueFull, ShuttingDown


STREAM_INTERVAL_S = 0.1   # a stream's text goes to the ingress at most this often (after its first piece)


class EngineFront:
    """What the HTTP side reads of an Engine (create_app): its tokenizer, model args and settings,
    no weights. The text <-> ids methods are Engine's own."""
    tokenize, detokenize, chat_prompt, _ids = Engine.tokenize, Engine.detokenize, Engine.chat_prompt, Engine._ids

    def __init__(self, model, settings: dict):
        from ..engine import not_a_model_dir
        from ..checkpoint.pull import find_model
        self.path = find_model(model)
        self.config = EngineConfig(**settings)
        if not (self.path / "config.json").is_file():
            raise MiniRunError(not_a_model_dir(self.path))
        self.args = ModelArgs.from_path(self.path)
        self.tokenizer = Tokenizer(self.path)


def replica_lost(e: Exception) -> ApiError:
    return ApiError(503, f"the replica answering this request stopped ({type(e).__name__}); retry: another "
                         f"replica answers", code="replica_lost", type_="server_error")


def error_event(e: Exception) -> tuple:
    """An engine's error as plain values for Ray to carry: ("error", kind, message, retry_after)."""
    kinds = (QueueFull, ShuttingDown, InternalError, MiniRunError)
    kind = next((k.__name__ for k in kinds if isinstance(e, k)), "InternalError")
    return ("error", kind, str(e), getattr(e, "retry_after", 1))


def error_of_event(ev: tuple) -> Exception:
    _, kind, message, retry_after = ev
    if kind == "QueueFull":
        return QueueFull(retry_after)
    return {"ShuttingDown": ShuttingDown, "MiniRunError": MiniRunError}.get(kind, InternalError)(message)


class RemoteWorker:
    """EngineWorker's interface over the replicas' handle, so create_app serves them as one engine.
    Requests in flight at most: replicas x (parallel + max_queue); more: QueueFull (503)."""

    def __init__(self, front: EngineFront, handle, replicas: int, max_queue: int, block: int = affinity.BLOCK):
        self.engine, self.handle, self.block = front, handle, block
        self.slot_count = replicas * front.config.parallel
        self.capacity = replicas * (front.config.parallel + max_queue)
        self.stopping = threading.Event()
        self.in_flight = 0
        self.served = 0
        self._seconds = deque(maxlen=8)

    @property
    def busy(self) -> bool:
        return self.in_flight > 0

    @property
    def queued(self) -> int:
        return max(0, self.in_flight - self.slot_count)

    @property
    def active(self) -> int:
        return min(self.in_flight, self.slot_count)

    def retry_after(self) -> int:
        mean = sum(self._seconds) / len(self._seconds) if self._seconds else 1.0
        return max(1, min(3600, math.ceil(mean)))

    def stop(self, timeout: float | None = None) -> None:
        self.stopping.set()

    def submit(self, job: Job) -> None:
        """Send a job to a replica (from the event loop); its events arrive as EngineWorker's do."""
        if self.stopping.is_set():
            raise ShuttingDown("the server is shutting down")
        if self.in_flight >= self.capacity:
            raise QueueFull(self.retry_after())
        self.in_flight += 1
        job.loop.create_task(self._forward(job))

    async def _forward(self, job: Job) -> None:
        t0 = time.perf_counter()
        blocks = affinity.block_hashes(job.ids, self.block)
        gen = self.handle.options(stream=True).generate.remote(job.ids, job.max_new_tokens, job.params, blocks=blocks)
        watch = asyncio.create_task(self._cancel_when_asked(job, gen))
        try:
            async for ev in gen:
                if ev[0] == "text":
                    job.put("text", ev[1])
                elif ev[0] == "done":
                    job.timings.update(ev[2])
                    job.put("done", ev[1])
                else:
                    job.put("error", error_of_event(ev))
        except asyncio.CancelledError:
            raise
        except Exception as e:     # the replica died (ActorDiedError...) or Ray could not reach it
            if not job.cancel.is_set():   # (else the call was cancelled here: nobody listens)
                job.put("error", replica_lost(e))
        finally:
            watch.cancel()
            self.in_flight -= 1
            self.served += 1
            self._seconds.append(time.perf_counter() - t0)

    @staticmethod
    async def _cancel_when_asked(job: Job, gen) -> None:
        """The client left (job.cancel): cancel the replica's call, whose engine then stops within a token."""
        while not job.cancel.is_set():
            await asyncio.sleep(0.1)
        gen.cancel()


async def batched_text(job: Job, interval: float = STREAM_INTERVAL_S):
    """A job's events for the ingress: its first text at once, then the text that comes within
    `interval` of the last sent as one piece (each event costs a hop through Ray to the ingress and
    another to the HTTP proxy, on the cores the engines use; docs/BENCHMARKS.md, "Replicas"), then
    ("done", GenerationResult, timings) or an error_event."""
    text, sent = [], 0.0
    while True:
        wait = sent + interval - time.monotonic() if text else None
        try:
            kind, value = await (job.next_event() if wait is None else asyncio.wait_for(job.next_event(), max(wait, 0)))
        except asyncio.TimeoutError:
            kind, value = "flush", None
        if kind == "text":
            text.append(value)
        if text and (kind != "text" or time.monotonic() - sent >= interval):
            yield ("text", "".join(text))
            text, sent = [], time.monotonic()
        if kind == "done":
            yield ("done", value, dict(job.timings))
            return
        if kind == "error":
            yield error_event(value)
            return


class EngineReplica:
    """One Engine in a Ray actor. The engine is loaded and run in a thread of its own (torch's and
    Numba's thread pools belong to the thread that first ran parallel work: server.run says why)."""

    def __init__(self, model, options: dict, max_queue: int, block: int = affinity.BLOCK):
        self.block = block
        self.worker: EngineWorker | None = None
        self.failure: str | None = None
        self.answering: dict[int, list[int]] = {}   # the jobs being answered: their prompts' block hashes
        self.changed = 0.0                           # when a job last began or ended here
        ready = threading.Event()
        self.thread = threading.Thread(target=self._load_and_run, args=(model, options, max_queue, ready),
                                       name="minirun-engine", daemon=True)
        self.thread.start()
        ready.wait()
        if self.failure:
            raise MiniRunError(f"the model did not load on {socket.gethostname()}: {self.failure}")

    def _load_and_run(self, model, options: dict, max_queue: int, ready: threading.Event) -> None:
        from ..cli.common import load_engine
        try:
            self.worker = EngineWorker(load_engine(model, **options), max_queue)
            self.worker.warm_up()
        except Exception as e:     # (a MiniRunError is one line; anything else: its type too)
            self.failure = str(e) if isinstance(e, MiniRunError) else f"{type(e).__name__}: {e}"
            ready.set()
            return
        ready.set()
        self.worker.run()

    async def generate(self, ids: list[int], max_new_tokens: int, params: dict, blocks=None):
        """Stream one job's events: ("text", piece)*, then ("done", GenerationResult, timings) or an
        error_event. `blocks` (the prompt's block hashes) is for the router."""
        job = Job(ids, max_new_tokens, params, asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except (QueueFull, ShuttingDown) as e:
            yield error_event(e)
            return
        key = id(job)
        self.answering[key] = list(blocks) if blocks is not None else affinity.block_hashes(ids, self.block)
        self.changed = time.time()
        try:
            async for event in batched_text(job):
                yield event
        finally:
            job.cancel.set()   # (the caller went away: the engine stops within a token)
            self.answering.pop(key, None)
            self.changed = time.time()

    def record_routing_stats(self) -> dict:
        """For the router: the block hashes of what the slots' caches hold and of the prompts being
        answered (they will be held), as of `at` (the last job to begin or end), and the queue."""
        at, blocks = self.changed, set()
        for ids in self.worker.held_ids() if self.worker else ():
            blocks.update(affinity.block_hashes(ids, self.block))
        for prompt in list(self.answering.values()):
            blocks.update(prompt)
        return {"blocks": sorted(blocks), "at": at, "queued": self.worker.queued if self.worker else 0}

    def check_health(self) -> None:
        if not self.thread.is_alive():
            raise RuntimeError("the engine's thread ended")

    def __del__(self):
        if self.worker is not None:
            self.worker.stop()


class Ingress:
    """The HTTP side: create_app over a RemoteWorker (late-bound app of serve.ingress)."""

    def __init__(self, engine_handle, model, settings: dict, model_name: str, api_key: str | None, replicas: int,
                 max_queue: int, max_body: int):
        from .app import create_app
        self.worker = RemoteWorker(EngineFront(model, settings), engine_handle, replicas, max_queue)
        self.asgi = create_app(self.worker, model_name, api_key, max_body)

    def __serve_build_asgi_app__(self):
        return self.asgi

    def __del__(self):
        self.worker.stop()
