"""Which replica answers a prompt: the one whose cache already holds the longest prefix of it.

Plain functions over token ids and replica summaries, no Ray: the Ray request router
(serve/router.py) feeds them what the replicas report and what it sent them since.

A replica's summary is the set of chained hashes of the full `block`-token blocks its cache holds
(as vLLM's prefix-cache block hashes): hash i covers tokens [0, (i + 1) * block), so the set is
closed under prefixes and a prompt's first k blocks are held where its (k-1)-th hash is.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import numpy as np

BLOCK = 64                 # tokens a hash covers
MIN_SHARED_TOKENS = 128    # a shorter shared prefix is cheap to prefill again: balance the load instead
MAX_EXTRA_LOAD = 2         # requests the replica holding the prefix may have above the least loaded one


def block_hashes(ids, block: int = BLOCK) -> list[int]:
    """Chained 64-bit hashes of the full blocks of `ids` [T] -> [T // block] (the same on every
    machine: blake2b over the ids as little-endian int64)."""
    arr = np.asarray(ids, dtype="<i8")
    out, h = [], b""
    for i in range(len(arr) // block):
        h = hashlib.blake2b(h + arr[i * block:(i + 1) * block].tobytes(), digest_size=8).digest()
        out.append(int.from_bytes(h, "little"))
    return out


def shared_blocks(prompt: list[int], held) -> int:
    """How many leading blocks of the prompt (its block_hashes) a replica holds (`held`: a set of
    hashes). Binary search: the held blocks of one prompt are a prefix of its hashes."""
    lo, hi = 0, len(prompt)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if prompt[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo


def known_held(reported: tuple[float, frozenset], sent: tuple[float, frozenset] | None) -> tuple[frozenset, float]:
    """What a replica holds as far as the router knows -> (block hashes, as of when): its last
    report (when, blocks), with the prompt it was sent after that report (sent: when, blocks),
    which its slots will hold beside what they reported."""
    if sent is None or sent[0] <= reported[0]:
        return reported[1], reported[0]
    return reported[1] | sent[1], sent[0]


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica."""
    id: str
    held: frozenset      # chained block hashes of what its cache holds (or will, once its queue drains)
    load: int            # requests sent to it and not finished
    capacity: int        # the most requests it takes at once
    last_sent: float     # when it was last given a request (0: never): the oldest cache is the one to lose


def least_loaded(views: list[ReplicaView], rng: random.Random) -> list[str]:
    """Power of two choices: two replicas at random, the less loaded first; on a tie the one whose
    cache holds less, then the one given a request longest ago (its cache is the cheapest to lose)."""
    pick = views if len(views) <= 2 else rng.sample(views, 2)
    return [v.id for v in sorted(pick, key=lambda v: (v.load, len(v.held), v.last_sent))]


def choose(prompt: list[int], views: list[ReplicaView], block: int = BLOCK, min_shared: int = MIN_SHARED_TOKENS,
           max_extra_load: int = MAX_EXTRA_LOAD, rng: random.Random | None = None) -> list[list[str]]:
    """Replica ids in ranks, the most preferred rank first (the shape of Ray Serve's
    RequestRouter.choose_replicas): first the replicas sharing the longest prefix with the prompt
    (`prompt`: its block_hashes), when that prefix is at least `min_shared` tokens and the replica
    is not overloaded (below its capacity, at most `max_extra_load` requests above the least loaded
    replica); then two replicas by least_loaded. Empty `views`: no ranks."""
    if not views:
        return []
    rng = rng or random
    fallback = least_loaded(views, rng)
    shared = {v.id: shared_blocks(prompt, v.held) for v in views}
    best = max(shared.values())
    if best * block < min_shared:
        return [fallback]
    floor = min(v.load for v in views)
    holders = [v for v in views if shared[v.id] == best and v.load < v.capacity and v.load <= floor + max_extra_load]
    if not holders:
        return [fallback]
    first = [v.id for v in sorted(holders, key=lambda v: (v.load, -v.last_sent))]
    return [first, [i for i in fallback if i not in first] or fallback]
