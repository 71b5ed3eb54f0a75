"""One engine, one thread, a bounded FIFO queue of requests.

The Engine is not thread-safe and owns one sequence's KV cache, so requests are answered one at a
time, in order, by one thread (`minirun serve`: the main thread, where the engine was loaded;
`start` runs it in a thread of its own); each one reuses the cache for its longest common prefix
with what the cache holds (Engine.prefill). The HTTP side (asyncio) hands a Job to `submit` and
reads its events from an asyncio queue the worker feeds through the event loop:
  ("text", piece)* then ("done", GenerationResult) | ("error", Exception).
Stopping: a Job's `cancel` (its client went away) or the worker's `stopping` (the server shuts
down) makes Engine's should_stop say True, checked after each prefill chunk and before each
decode step, so a generation ends within one token and the cache stays consistent.
"""
from __future__ import annotations

import asyncio
import math
import queue
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

from ..errors import MiniRunError


class QueueFull(MiniRunError):
    """Every place in the queue is taken; retry_after: seconds until one is likely free."""

    def __init__(self, retry_after: int):
        super().__init__(f"the server is busy: {retry_after} s until a place in its queue is likely free")
        self.retry_after = retry_after


class ShuttingDown(MiniRunError):
    """The server stops: no new work."""


class InternalError(Exception):
    """An unexpected failure inside the engine (a bug): the request fails, the server goes on."""


@dataclass
class Job:
    """One request for the engine. ids: the prompt's token ids; params: Engine.stream's keywords."""
    ids: list[int]
    max_new_tokens: int
    params: dict
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    # seconds, filled by the worker: queued, to the first text (wall and the process's CPU time,
    # which does not depend on what else the machine runs), prefill, and the decode tokens/s
    timings: dict = field(default_factory=dict)

    def put(self, kind: str, value=None) -> None:
        """From the worker thread: one event into the request's queue, through its event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:   # the loop is closed (the server stopped): nobody listens any more
            pass

    async def next_event(self) -> tuple[str, object]:
        return await self.events.get()


class EngineWorker:
    """Runs Jobs on `engine` one at a time, in order: in the calling thread (`run`) or its own (`start`)."""

    def __init__(self, engine, max_queue: int = 16):
        if max_queue < 1:
            raise MiniRunError(f"--max-queue must be at least 1, got {max_queue}")
        self.engine = engine
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.stopping = threading.Event()
        self.busy = False
        self.served = 0
        self._seconds = deque(maxlen=8)     # the last jobs' durations: the Retry-After estimate
        self._thread = threading.Thread(target=self.run, name="minirun-engine", daemon=True)

    def start(self) -> "EngineWorker":
        self._thread.start()
        return self

    def submit(self, job: Job) -> None:
        """Queue a job; QueueFull when the queue is full, ShuttingDown once the server stops."""
        if self.stopping.is_set():
            raise ShuttingDown("the server is shutting down")
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull(self.retry_after()) from None

    def retry_after(self) -> int:
        """Seconds until the queue has room, by the mean duration of recent jobs (at least 1)."""
        mean = sum(self._seconds) / len(self._seconds) if self._seconds else 1.0
        return max(1, min(3600, math.ceil(mean)))

    @property
    def queued(self) -> int:
        return self.jobs.qsize()

    def stop(self, timeout: float | None = None) -> None:
        """Stop now: the job being answered ends at its next check, the queued ones fail."""
        self.stopping.set()
        if timeout is not None and self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the worker's loop ---------------------------------------------------------------------------
    def run(self, alive=None) -> None:
        """Answer jobs until `stop` (or until alive(), when given, says False: the HTTP side ended)."""
        while not self.stopping.is_set() and (alive is None or alive()):
            try:
                job = self.jobs.get(timeout=0.25)   # (wakes up to see `stopping`)
            except queue.Empty:
                continue
            self._answer(job)
        while True:   # fail what is still queued
            try:
                self.jobs.get_nowait().put("error", ShuttingDown("the server is shutting down"))
            except queue.Empty:
                break

    def _answer(self, job: Job) -> None:
        if job.cancel.is_set():     # its client left while it waited
            job.put("error", ShuttingDown("cancelled"))
            return
        if self.stopping.is_set():
            job.put("error", ShuttingDown("the server is shutting down"))
            return
        t0, cpu0 = time.perf_counter(), time.process_time()
        self.busy = True
        eng = self.engine
        tm = job.timings
        tm["queued_s"] = t0 - job.submitted
        try:
            stop = lambda: job.cancel.is_set() or self.stopping.is_set()   # noqa: E731
            for piece in eng.stream(job.ids, max_new_tokens=job.max_new_tokens, should_stop=stop, **job.params):
                if "first_text_s" not in tm:
                    tm["first_text_s"], tm["first_text_cpu_s"] = time.perf_counter() - t0, time.process_time() - cpu0
                job.put("text", piece)
            res = eng.last_result
            tm["prefill_s"], tm["decode_tps"] = res.prefill_s, res.decode_tps
            if res.finish_reason == "cancelled" and self.stopping.is_set() and not job.cancel.is_set():
                job.put("error", ShuttingDown("the server is shutting down"))
            else:
                job.put("done", res)
        except MiniRunError as e:   # a request the engine refuses (context full, bad sampling values)
            job.put("error", e)
        except Exception as e:      # a bug: report it, start the next request from a clean cache
            traceback.print_exc(file=sys.stderr)
            eng.reset()
            job.put("error", InternalError(f"{type(e).__name__}: {e}"))
        finally:
            self.busy = False
            self.served += 1
            self._seconds.append(time.perf_counter() - t0)
