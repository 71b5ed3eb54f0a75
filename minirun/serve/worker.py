"""The engine's thread: N slots, each a sequence with its own KV cache, stepped together.

The Engine is not thread-safe, so one thread runs every forward (`minirun serve`: the main
thread, where the engine was loaded; `start` runs it in a thread of its own). The HTTP side
(asyncio) hands a Job to `submit`, which queues it (bounded: QueueFull, 503), and reads its events
from an asyncio queue the worker feeds through the event loop:
  ("text", piece)* then ("done", GenerationResult) | ("error", Exception).

Continuous batching (what llama-server's slots and vLLM's scheduler do): a queued job takes a
free slot at the next step; each step advances every slot still reading its prompt by one chunk,
all of them in one forward (Engine.prefill_steps' chunks through Engine.forward_chunks), and then
decodes one token for every answering slot in one forward (Engine.step_batch): the weights are read
once for all of them, so prompts that arrive together are read together. A long prompt delays the
others' next token by one chunk's forward (512 tokens on a CPU), not by its whole prefill. A job
goes to the free slot whose cache holds the longest prefix of its prompt when that covers at
least half of it (a follow-up about a document reaches the slot that read the document), else to
the least recently used one; Engine.prefill then reuses what the cache shares with the prompt.
Stopping: a Job's `cancel` (its client went away) or the worker's `stopping` (the server shuts
down) ends that answer at the next step (within one token or one chunk), and the slot is free.
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
    prompt_logprobs: int | None = None   # echo with logprobs: the prompt's, this many most likely beside each
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    # seconds, filled by the worker: queued, to the first text (wall and the process's CPU time,
    # which does not depend on what else the machine runs), prefill, and the decode tokens/s
    timings: dict = field(default_factory=dict)
    result: object = None     # the GenerationResult being filled (its logprobs grow as tokens come)

    def put(self, kind: str, value=None) -> None:
        """From the worker thread: one event into the request's queue, through its event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:   # the loop is closed (the server stopped): nobody listens any more
            pass

    async def next_event(self) -> tuple[str, object]:
        return await self.events.get()


@dataclass
class Slot:
    """One sequence of the served model: its engine (the shared model, a cache of its own) and the
    job it answers: while `prefill` (Engine.prefill_steps) runs, its prompt, `chunk` the forward it
    waits for; then `dec`'s tokens."""
    engine: object
    job: Job | None = None
    dec: object = None
    prefill: object = None
    chunk: object = None
    used: float = 0.0                  # when it last took a job: the least recently used goes first
    t0: float = 0.0                    # when it took the job (wall, and the process's CPU time)
    cpu0: float = 0.0
    decode_t0: float | None = None     # when its prompt was read


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class EngineWorker:
    """Runs Jobs on `parallel` slots of `engine` (the engine itself and parallel - 1 siblings; by
    default the engine's config.parallel, which its memory plan counted), in the calling thread
    (`run`) or its own (`start`)."""

    def __init__(self, engine, max_queue: int = 16, parallel: int | None = None):
        parallel = engine.config.parallel if parallel is None else parallel
        if max_queue < 1:
            raise MiniRunError(f"--max-queue must be at least 1, got {max_queue}")
        if parallel < 1:
            raise MiniRunError(f"--parallel must be at least 1, got {parallel}")
        self.engine = engine
        self.slots = [Slot(engine)] + [Slot(engine.sibling()) for _ in range(parallel - 1)]
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.stopping = threading.Event()
        self.served = 0
        self._seconds = deque(maxlen=8)     # the last jobs' durations: the Retry-After estimate
        self._thread = threading.Thread(target=self.run, name="minirun-engine", daemon=True)

    def start(self) -> "EngineWorker":
        self._thread.start()
        return self

    def warm_up(self) -> None:
        """Run once each forward the slots run (a short prompt on every slot, one token alone, one
        token for all of them in one forward), then empty their caches. The kernels' first calls
        load or compile their machine code: seconds that the first requests would wait for. A slot
        that holds tokens already (a prompt cache loaded at start) is left as it is."""
        engines = [s.engine for s in self.slots if not s.engine._cached_ids]
        if not engines:
            return
        ids = self.engine.tokenize("Hello")
        for eng in engines:
            eng.prefill(ids)
        engines[0].step(ids[-1])
        if len(engines) > 1:
            self.engine.step_batch(engines, [ids[-1]] * len(engines))
        for eng in engines:
            eng.reset()

    def submit(self, job: Job) -> None:
        """Queue a job; QueueFull when the queue is full, ShuttingDown once the server stops."""
        if self.stopping.is_set():
            raise ShuttingDown("the server is shutting down")
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull(self.retry_after()) from None

    def retry_after(self) -> int:
        """Seconds until the queue has room, by the mean duration of recent jobs over the slots (at least 1)."""
        mean = sum(self._seconds) / len(self._seconds) if self._seconds else 1.0
        return max(1, min(3600, math.ceil(mean / len(self.slots))))

    @property
    def queued(self) -> int:
        return self.jobs.qsize()

    def held_ids(self) -> list[list[int]]:
        """The tokens each slot's cache holds (copies: the worker thread may change them meanwhile)."""
        return [list(s.engine._cached_ids) for s in self.slots]

    @property
    def slot_count(self) -> int:
        return len(self.slots)

    @property
    def active(self) -> int:
        return sum(s.job is not None for s in self.slots)

    @property
    def busy(self) -> bool:
        return self.active > 0

    def stop(self, timeout: float | None = None) -> None:
        """Stop now: the jobs being answered end at their next step, the queued ones fail."""
        self.stopping.set()
        if timeout is not None and self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the worker's loop ---------------------------------------------------------------------------
    def run(self, alive=None) -> None:
        """Answer jobs until `stop` (or until alive(), when given, says False: the HTTP side ended)."""
        while not self.stopping.is_set() and (alive is None or alive()):
            self._admit()
            if self.busy:
                self.step()
        for slot in self.slots:    # end what is still being answered, fail what is queued
            if slot.job is not None:
                self._end(slot, "cancelled")
        while True:
            try:
                self.jobs.get_nowait().put("error", ShuttingDown("the server is shutting down"))
            except queue.Empty:
                break

    def _admit(self) -> None:
        """Queued jobs into free slots; waits a little for one when nothing runs (to see `stopping`)."""
        while any(s.job is None for s in self.slots):
            try:
                job = self.jobs.get(timeout=0.25) if not self.busy else self.jobs.get_nowait()
            except queue.Empty:
                return
            if job.cancel.is_set():     # its client left while it waited
                job.put("error", ShuttingDown("cancelled"))
                continue
            self._begin(self._slot_for(job.ids), job)

    def _slot_for(self, ids: list[int]) -> Slot:
        """The free slot whose cache holds the longest prefix of ids, when that is at least half of
        them; else the least recently used free slot."""
        free = [s for s in self.slots if s.job is None]
        reuse = max(free, key=lambda s: shared_prefix(s.engine._cached_ids, ids))
        if 2 * shared_prefix(reuse.engine._cached_ids, ids) >= len(ids):
            return reuse
        return min(free, key=lambda s: s.used)

    def _begin(self, slot: Slot, job: Job) -> None:
        slot.t0, slot.cpu0 = time.perf_counter(), time.process_time()
        job.timings["queued_s"] = slot.t0 - job.submitted
        slot.job, slot.used = job, slot.t0
        try:
            slot.dec = slot.engine.decoding(job.ids, job.max_new_tokens, **job.params)
            job.result = slot.dec.res
            if job.prompt_logprobs is not None:    # (a forward of the prompt in a cache of its own)
                job.result.prompt_logprobs = slot.engine.prompt_logprobs(job.ids, job.prompt_logprobs)
        except MiniRunError as e:   # sampling values the engine refuses
            self._fail(slot, e)
            return
        stop = lambda: job.cancel.is_set() or self.stopping.is_set()   # noqa: E731
        slot.prefill = slot.engine.prefill_steps(job.ids, should_stop=stop)
        self._guarded([slot], self._advance, slot, None)     # (to its first chunk)

    def step(self) -> None:
        """One step: a prompt chunk for each slot still prefilling, all in one forward, then one token
        for every answering slot in one forward."""
        reading = [s for s in self.slots if s.prefill is not None]
        if reading:
            self._prefill_chunks(reading)
        ready = [s for s in self.slots if s.job is not None and s.prefill is None]
        for slot in ready:
            if slot.job.cancel.is_set() or self.stopping.is_set():
                self._end(slot, "cancelled")
        ready = [s for s in ready if s.job is not None]
        if ready:
            self._guarded(ready, self._decode, ready)

    def _prefill_chunks(self, reading: list[Slot]) -> None:
        """The next prompt chunk of every slot still reading its prompt, in one forward (its failure
        fails them all); then each slot's prefill goes on with its row."""
        hidden = self._guarded(reading, reading[0].engine.forward_chunks, [s.engine for s in reading],
                               [s.chunk for s in reading])
        if hidden is not None:
            for i, slot in enumerate(reading):
                self._guarded([slot], self._advance, slot, hidden[i:i + 1])

    def _advance(self, slot: Slot, hidden) -> None:
        """Hand a slot's prefill its chunk's hidden state [1, D] (None: to start it) -> its next
        chunk, or the prompt read and the first token taken."""
        try:
            slot.chunk = slot.prefill.send(hidden)
            return
        except StopIteration as done:
            logits, reused = done.value
        slot.prefill = slot.chunk = None
        eng, res = slot.engine, slot.dec.res
        dt = time.perf_counter() - slot.t0
        res.prefill_s, res.reused_tokens = dt, reused
        res.prefill_tps = (res.prompt_tokens - reused) / max(dt, 1e-9)
        slot.job.timings["prefill_s"] = dt
        slot.decode_t0 = time.perf_counter()
        if len(eng._cached_ids) < res.prompt_tokens:     # stopped inside the prompt
            self._end(slot, "cancelled")
        else:
            self._take(slot, logits[-1])

    def _decode(self, ready: list[Slot]) -> None:
        toks = [s.dec.next for s in ready]
        if len(ready) == 1:
            logits = ready[0].engine.step(toks[0])
        else:
            logits = ready[0].engine.step_batch([s.engine for s in ready], toks)
        for i, slot in enumerate(ready):
            self._take(slot, logits[i])

    def _take(self, slot: Slot, logits) -> None:
        piece = slot.dec.take(logits)
        self._emit(slot, piece)
        if slot.dec.done:
            self._done(slot)

    def _emit(self, slot: Slot, piece: str) -> None:
        if not piece:
            return
        tm = slot.job.timings
        if "first_text_s" not in tm:
            tm["first_text_s"], tm["first_text_cpu_s"] = time.perf_counter() - slot.t0, time.process_time() - slot.cpu0
        slot.job.put("text", piece)

    def _end(self, slot: Slot, reason: str) -> None:
        """End a slot's answer early (cancelled, or the server stops)."""
        if slot.prefill is not None:      # let the prefill finish its bookkeeping, its pending chunk not run
            try:
                while True:
                    slot.prefill.send(None)
            except StopIteration:
                pass
            slot.prefill, slot.chunk, slot.decode_t0 = None, None, time.perf_counter()
        self._emit(slot, slot.dec.finish(reason))
        self._done(slot)

    def _done(self, slot: Slot) -> None:
        job, res = slot.job, slot.dec.res
        now = time.perf_counter()
        res.decode_s = now - (slot.decode_t0 or now)
        res.decode_tps = len(res.tokens) / max(res.decode_s, 1e-9)
        job.timings["decode_tps"] = res.decode_tps
        slot.engine.last_result = res       # (as Engine.stream leaves it)
        if res.finish_reason == "cancelled" and self.stopping.is_set() and not job.cancel.is_set():
            job.put("error", ShuttingDown("the server is shutting down"))
        else:
            job.put("done", res)
        self._free(slot)

    def _fail(self, slot: Slot, e: Exception) -> None:
        slot.job.put("error", e)
        self._free(slot)

    def _free(self, slot: Slot) -> None:
        self.served += 1
        self._seconds.append(time.perf_counter() - slot.t0)
        slot.job = slot.dec = slot.prefill = slot.chunk = slot.decode_t0 = None

    def _guarded(self, slots: list[Slot], fn, *args):
        """Run one step's work for `slots` -> what fn returns, None when it failed: a refusal
        (MiniRunError) fails their jobs, a bug too, reported, their caches started afresh; the
        other slots go on."""
        try:
            return fn(*args)
        except MiniRunError as e:
            for slot in slots:
                if slot.job is not None:
                    self._fail(slot, e)
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            for slot in slots:
                if slot.job is not None:
                    slot.engine.reset()
                    self._fail(slot, InternalError(f"{type(e).__name__}: {e}"))
