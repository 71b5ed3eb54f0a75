"""The Ray Serve request router of the engine replicas: each request goes to the replica whose
cache holds the longest prefix of its prompt (affinity.choose), else to the less loaded of two.

It runs where the replicas' handle is called (the HTTP ingress). What a replica's cache holds
comes from two places: its own report (EngineReplica.record_routing_stats, polled by Serve's
controller every `request_routing_stats_period_s`: the block hashes of what its slots hold and when
that last changed) and what this router sent it since (a follow-up sent right after its document
must find it before the next report). Clocks are compared across machines, so they are assumed
roughly in step (NTP).
"""
from __future__ import annotations

import random
import time

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from . import affinity


class DocumentRouter(RequestRouter):
    """RequestRouter whose requests carry `blocks=affinity.block_hashes(prompt)` as a keyword."""

    def initialize_state(self, block: int = affinity.BLOCK, min_shared: int = affinity.MIN_SHARED_TOKENS,
                         max_extra_load: int = affinity.MAX_EXTRA_LOAD, **_):
        self.block, self.min_shared, self.max_extra_load = block, min_shared, max_extra_load
        self.sent: dict[ReplicaID, tuple[float, frozenset]] = {}   # replica -> (when, the blocks it was sent)
        self.rng = random.Random()

    def held(self, r: RunningReplica) -> tuple[frozenset, float]:
        """(block hashes r's cache holds, when that was last known)."""
        stats = r.routing_stats or {}
        reported = (float(stats.get("at", 0.0)), frozenset(stats.get("blocks", ())))
        return affinity.known_held(reported, self.sent.get(r.replica_id))

    async def loads(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Requests in flight on each replica: Serve's queue-length cache, else a probe (as its
        power-of-two router does); a replica that does not answer counts as full."""
        out, unknown = {}, []
        for r in replicas:
            n = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if n is None:
                unknown.append(r)
            else:
                out[r.replica_id] = n
        if unknown:
            for r, n in await self._probe_queue_lens(unknown, 0):
                out[r.replica_id] = r.max_ongoing_requests if n is None else n
        return out

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        prompt = list((pending_request.kwargs.get("blocks") if pending_request is not None else None) or ())
        loads = await self.loads(candidate_replicas)
        views, by_id = [], {}
        for r in candidate_replicas:
            held, when = self.held(r)
            key = r.replica_id.unique_id
            by_id[key] = r
            views.append(affinity.ReplicaView(key, held, loads.get(r.replica_id, 0), r.max_ongoing_requests, when))
        ranks = affinity.choose(prompt, views, self.block, self.min_shared, self.max_extra_load, self.rng)
        return [[by_id[i] for i in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        blocks = pending_request.kwargs.get("blocks") if pending_request is not None else None
        if blocks is not None:
            self.sent[replica_id] = (time.time(), frozenset(blocks))

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.sent.pop(replica_id, None)
