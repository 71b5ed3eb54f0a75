"""An engine replica (serve/replicas.py's EngineReplica, the class Ray Serve runs in each actor) with
two slots, called directly without Ray: it answers two prompts at once, and its routing report
holds both prompts' blocks (the router sends each follow-up to the replica holding its document)."""
import asyncio

from minirun.serve.affinity import BLOCK, block_hashes, shared_blocks
from minirun.serve.replicas import EngineReplica

OPTIONS = dict(ctx=1024, device="cpu", dtype="float32", kv="dense", kv_budget="0.25", tau=0.9, window=256, sinks=16,
               max_select=None, threads=1, hca_opts={}, weights="stored", parallel=2)


def test_two_slots_answer_at_once_and_report_both_documents(tiny_model_dir):
    replica = EngineReplica(tiny_model_dir("gqa-untied"), OPTIONS, max_queue=2)
    docs = [[3 + (7 * i) % 200 for i in range(3 * BLOCK + 10)], [3 + (11 * i + 5) % 200 for i in range(4 * BLOCK + 3)]]

    async def answer(ids):
        return [ev async for ev in replica.generate(ids, 48, {"temperature": 0, "ignore_eos": True})]

    async def both():
        return await asyncio.gather(*(answer(ids) for ids in docs))
    try:
        results = asyncio.run(both())
        stats = replica.record_routing_stats()
    finally:
        replica.worker.stop(timeout=10)
    done = [r[-1] for r in results]
    assert [d[0] for d in done] == ["done", "done"] and [len(d[1].tokens) for d in done] == [48, 48]
    # each took a slot at once: neither waited for the other's answer in the queue
    queued = [d[2]["queued_s"] for d in done]
    answer_s = [d[2]["prefill_s"] + 48 / d[2]["decode_tps"] for d in done]
    assert max(queued) < min(answer_s) / 2, (queued, answer_s)
    held = set(stats["blocks"])
    for ids, d in zip(docs, done):
        held_ids = ids + list(d[1].tokens)
        assert shared_blocks(block_hashes(held_ids), held) == len(held_ids) // BLOCK
    assert stats["queued"] == 0 and not replica.answering


def test_a_replica_sends_its_first_text_at_once_then_text_batched_by_interval():
    """batched_text: the first piece goes alone; pieces that come within the interval go as one;
    what is left goes before "done"; an error ends the stream as an error event."""
    from minirun.serve.replicas import batched_text
    from minirun.serve.worker import Job

    async def run(events, interval):
        job = Job([1], 4, {}, asyncio.get_running_loop())

        async def feed():
            for delay, kind, value in events:
                await asyncio.sleep(delay)
                job.events.put_nowait((kind, value))
        feeder = asyncio.create_task(feed())
        got = [ev async for ev in batched_text(job, interval)]
        await feeder
        return got
    got = asyncio.run(run([(0, "text", "a"), (0.01, "text", "b"), (0.01, "text", "c"), (0.3, "text", "d"),
                           (0.01, "done", "result")], interval=0.1))
    assert got == [("text", "a"), ("text", "bc"), ("text", "d"), ("done", "result", {})]
    got = asyncio.run(run([(0, "text", "a"), (0.01, "text", "b"), (0, "error", ValueError("x"))], interval=0.1))
    assert got[:2] == [("text", "a"), ("text", "b")] and got[2][0] == "error" and got[2][1] == "InternalError"
