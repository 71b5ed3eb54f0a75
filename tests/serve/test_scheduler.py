"""The server's slots (minirun/serve/worker.py): jobs join and leave a running batch, each answer is
the one its prompt gets alone, prompts that arrive together are read in one forward a chunk, a long
prompt is read in chunks between the others' tokens, a follow-up reaches the slot holding its
document, and a cancelled job frees its slot at once."""
from __future__ import annotations

import asyncio
import threading

import torch

from minirun import Engine
from minirun.serve.worker import EngineWorker, Job

CHUNK = 8      # prompt tokens per forward: a prompt of 100 tokens is 13 steps


def load(tiny_model_dir, parallel=1, **kw):
    return Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=512, prefill_chunk=CHUNK,
                       parallel=parallel, **kw)


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 300, (n,), generator=g).tolist()


GREEDY = dict(temperature=0.0, ignore_eos=True)


async def answer_all(worker: EngineWorker, jobs: list[tuple[list[int], int]], cancel_after: dict | None = None,
                     then=None):
    """Submit every (ids, max_new) at once to a worker running in its own thread -> the events of
    each job; cancel_after {job index: texts}: that job's client leaves after so many text events;
    then: called once all are queued (to start the worker only then)."""
    loop = asyncio.get_running_loop()
    made = [Job(ids, n, dict(GREEDY), loop) for ids, n in jobs]
    for job in made:
        worker.submit(job)
    if then is not None:
        then()

    async def events(i, job):
        got = []
        while True:
            kind, value = await job.next_event()
            got.append((kind, value))
            if kind == "text" and cancel_after and len([k for k, _ in got if k == "text"]) == cancel_after.get(i):
                job.cancel.set()
            if kind in ("done", "error"):
                return got
    return await asyncio.gather(*(events(i, j) for i, j in enumerate(made)))


class Running:
    """A worker running in its own thread for the length of a `with` block; `answer` submits jobs
    together and waits for all of them."""

    def __init__(self, worker: EngineWorker):
        self.worker = worker
        self.thread = threading.Thread(target=worker.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def answer(self, jobs, **kw):
        return asyncio.run(answer_all(self.worker, jobs, **kw))

    def __exit__(self, *exc):
        self.worker.stop()
        self.thread.join(30)


def run_worker(worker: EngineWorker, jobs, **kw):
    with Running(worker) as r:
        return r.answer(jobs, **kw)


def final(events) -> object:
    kind, value = events[-1]
    assert kind == "done", events[-1]
    return value


def test_jobs_join_a_running_batch_and_each_answers_as_alone(tiny_model_dir, monkeypatch):
    eng = load(tiny_model_dir, parallel=3)
    worker = EngineWorker(eng)
    assert len(worker.slots) == 3 and all(s.engine.model is eng.model for s in worker.slots)
    sizes = []
    step_batch = Engine.step_batch
    monkeypatch.setattr(Engine, "step_batch", staticmethod(lambda engines, toks: (sizes.append(len(engines)),
                                                                                   step_batch(engines, toks))[1]))
    jobs = [(prompt(i, 20 + 17 * i), 6 + 3 * i) for i in range(5)]     # 5 jobs, 3 slots: two wait, then join
    got = run_worker(worker, jobs)
    alone = load(tiny_model_dir)
    for (ids, n), events in zip(jobs, got):
        res = final(events)
        want = alone.generate(ids, max_new_tokens=n, **GREEDY)
        assert res.tokens == want.tokens and len(res.tokens) == n
        assert "".join(v for k, v in events if k == "text") == res.text
        alone.reset()
    assert max(sizes) == 3 and 2 in sizes        # full batches, and smaller ones as jobs left
    assert not worker.busy and worker.served == 5


def count_chunk_forwards(monkeypatch, before=None) -> list[int]:
    """Engine.forward_chunks recorded: the number of prompts in each call; before(calls so far,
    this one included), when given, runs ahead of each forward."""
    sizes = []
    forward_chunks = Engine.forward_chunks

    def counted(engines, chunks):
        sizes.append(len(chunks))
        if before is not None:
            before(len(sizes))
        return forward_chunks(engines, chunks)
    monkeypatch.setattr(Engine, "forward_chunks", staticmethod(counted))
    return sizes


def test_prompts_that_arrive_together_are_read_in_one_forward_a_chunk(tiny_model_dir, monkeypatch):
    """Three prompts of 20, 37 and 54 tokens (3, 5, 7 chunks) submitted at once: each chunk step
    reads all the prompts still unread in one forward, and each answer is the one it gets alone."""
    worker = EngineWorker(load(tiny_model_dir, parallel=3))
    sizes = count_chunk_forwards(monkeypatch)
    jobs = [(prompt(20 + i, 20 + 17 * i), 5) for i in range(3)]
    running = Running(worker)
    try:
        got = asyncio.run(answer_all(worker, jobs, then=running.thread.start))   # (all queued before it starts)
    finally:
        running.__exit__()
    assert sizes == [3, 3, 3, 2, 2, 1, 1]
    alone = load(tiny_model_dir)
    for (ids, n), events in zip(jobs, got):
        assert final(events).tokens == alone.generate(ids, max_new_tokens=n, **GREEDY).tokens
        alone.reset()


def test_a_long_prompt_is_read_between_the_other_answers_tokens(tiny_model_dir, monkeypatch):
    """While slot 1 reads a 200-token prompt (25 chunks), slot 0 keeps decoding: its tokens arrive
    between the chunks, not after them."""
    eng = load(tiny_model_dir, parallel=2)
    worker = EngineWorker(eng)
    log = []
    monkeypatch.setattr(worker, "_decode", (lambda f: lambda ready: (log.append(("decode", len(ready))), f(ready)))(
        worker._decode))
    monkeypatch.setattr(worker, "_prefill_chunks", (lambda f: lambda slots: (log.append(("chunk", len(slots))), f(slots)))(
        worker._prefill_chunks))
    got = run_worker(worker, [(prompt(1, 10), 40), (prompt(2, 200), 4)])
    assert final(got[1]).prompt_tokens == 200
    chunks = [i for i, (k, _) in enumerate(log) if k == "chunk"]
    decodes_during = [i for i, (k, _) in enumerate(log) if k == "decode" and chunks[2] < i < chunks[-1]]
    assert len(decodes_during) >= 15          # one decode step of slot 0 after each chunk of slot 1


def test_a_follow_up_reaches_the_slot_that_holds_its_document(tiny_model_dir):
    """Two documents on two slots, then a follow-up of each (sent together): each reuses its own
    document's cache (cached tokens near its length), whichever slot is least recently used."""
    worker = EngineWorker(load(tiny_model_dir, parallel=2))
    doc_a, doc_b = prompt(3, 120), prompt(4, 120)
    with Running(worker) as r:
        first = r.answer([(doc_a, 5), (doc_b, 5)])
        holder = {tuple(s.engine._cached_ids[:120]): s for s in worker.slots}
        follow = [(doc + final(ev).tokens + prompt(5 + i, 6), 4) for i, (doc, ev) in enumerate(zip((doc_a, doc_b), first))]
        second = r.answer(follow[::-1])             # (b's first: the least recently used slot is a's)
    for (ids, _), events in zip(follow[::-1], second):
        res = final(events)
        assert res.reused_tokens >= 120 + 4
        assert holder[tuple(ids[:120])].engine._cached_ids[:len(ids)] == ids


def test_an_unrelated_prompt_takes_the_least_recently_used_slot(tiny_model_dir):
    worker = EngineWorker(load(tiny_model_dir, parallel=2))
    with Running(worker) as r:
        r.answer([(prompt(7, 60), 3)])
        r.answer([(prompt(8, 60), 3)])              # the empty slot, not the one holding prompt 7
        assert sorted(len(s.engine._cached_ids) for s in worker.slots) == [63, 63]
        r.answer([(prompt(9, 60), 3)])              # the slot used longest ago: prompt 7's
    held = [s.engine._cached_ids[:60] for s in worker.slots]
    assert prompt(8, 60) in held and prompt(9, 60) in held


def test_a_cancelled_job_frees_its_slot_and_the_next_one_runs(tiny_model_dir):
    """One slot: a job whose client leaves after 3 pieces ends "cancelled" at once; a job cancelled
    while its long prompt is being read stops within a chunk; the next job answers as alone."""
    eng = load(tiny_model_dir)
    worker = EngineWorker(eng)
    ids = prompt(10, 30)
    with Running(worker) as r:
        got = r.answer([(ids, 400)], cancel_after={0: 3})
        res = final(got[0])
        assert res.finish_reason == "cancelled" and len(res.tokens) < 20
        loop_jobs = r.answer([(prompt(11, 400), 4), (ids, 6)], cancel_after={})
    assert final(loop_jobs[1]).tokens == load(tiny_model_dir).generate(ids, max_new_tokens=6, **GREEDY).tokens
    assert not worker.busy and len(eng._cached_ids) == eng.cache.offset


def test_a_job_cancelled_inside_its_prompt_stops_within_a_chunk(tiny_model_dir, monkeypatch):
    """The client leaves while the third chunk of a 400-token prompt is read: no chunk after it."""
    eng = load(tiny_model_dir)
    worker = EngineWorker(eng)
    held = {}

    def leave_at_third(calls):
        if calls == 3:
            held["job"].cancel.set()
    chunks = count_chunk_forwards(monkeypatch, before=leave_at_third)

    async def go():
        held["job"] = job = Job(prompt(12, 400), 4, dict(GREEDY), asyncio.get_running_loop())
        worker.submit(job)
        while True:
            kind, value = await job.next_event()
            if kind in ("done", "error"):
                return kind, value
    with Running(worker):
        kind, res = asyncio.run(go())
    assert kind == "done" and res.finish_reason == "cancelled" and res.tokens == []
    assert len(chunks) == 3
    assert len(eng._cached_ids) == eng.cache.offset == CHUNK * 3


def test_warm_up_leaves_every_slot_empty_and_answers_unchanged(tiny_model_dir, monkeypatch):
    """warm_up runs a prompt on each slot, a token alone and a batch of all, then empties the caches:
    the next jobs see fresh slots and answer as they would without it."""
    eng = load(tiny_model_dir, parallel=3)
    worker = EngineWorker(eng)
    sizes = []
    step_batch = Engine.step_batch
    monkeypatch.setattr(Engine, "step_batch", staticmethod(lambda engines, toks: (sizes.append(len(engines)),
                                                                                   step_batch(engines, toks))[1]))
    worker.warm_up()
    assert sizes == [3]
    assert all(s.engine._cached_ids == [] and s.engine.cache.offset == 0 for s in worker.slots)
    jobs = [(prompt(i, 30), 8) for i in range(3)]
    got = run_worker(worker, jobs)
    fresh = run_worker(EngineWorker(load(tiny_model_dir, parallel=3)), jobs)
    assert [final(g).tokens for g in got] == [final(f).tokens for f in fresh]
    assert all(final(g).reused_tokens == 0 for g in got)
