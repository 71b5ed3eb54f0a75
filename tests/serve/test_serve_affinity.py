"""The replicas' routing choice (serve/affinity.py), without Ray: block hashes and the ranking."""
import random

from minirun.serve.affinity import ReplicaView, block_hashes, choose, known_held, least_loaded, shared_blocks


def view(id_, held=(), load=0, capacity=5, last_sent=0.0):
    return ReplicaView(id_, frozenset(held), load, capacity, last_sent)


def test_block_hashes_are_chained_and_stable():
    ids = list(range(1000, 1300))
    h = block_hashes(ids, 64)
    assert len(h) == 300 // 64 and len(set(h)) == len(h)
    assert block_hashes(ids, 64) == h and block_hashes(ids[:200], 64) == h[:3]
    changed = ids[:130] + [7] + ids[131:]       # a token of the third block changes it and every later one
    other = block_hashes(changed, 64)
    assert other[:2] == h[:2] and all(a != b for a, b in zip(other[2:], h[2:]))
    assert block_hashes(ids[:63], 64) == []


def test_shared_blocks_is_the_longest_held_prefix():
    doc = block_hashes(list(range(640)), 64)                   # 10 blocks
    held = set(block_hashes(list(range(384)) + [1] * 256, 64))   # the same first 6 blocks, then others
    assert shared_blocks(doc, held) == 6
    for k in range(11):
        assert shared_blocks(doc, set(doc[:k])) == k
    assert shared_blocks([], held) == 0 and shared_blocks(doc, set()) == 0


def test_the_replica_holding_the_document_comes_first():
    a, b = list(range(1000)), list(range(5000, 6000))
    ha, hb = block_hashes(a), block_hashes(b)
    views = [view("r1", ha, load=1, last_sent=5.0), view("r2", hb, load=0, last_sent=9.0)]
    follow_up_a = block_hashes(a + [3, 4, 5] * 30)
    ranks = choose(follow_up_a, views)
    assert ranks[0] == ["r1"] and ranks[1] == ["r2"]
    assert choose(block_hashes(b + [9] * 70), views)[0] == ["r2"]


def test_short_or_unshared_prompts_go_to_the_least_loaded():
    a = list(range(1000))
    views = [view("r1", block_hashes(a), load=1), view("r2", load=0)]
    assert choose(block_hashes(list(range(7000, 7500))), views) == [["r2", "r1"]]   # shares nothing
    assert choose(block_hashes(a[:100]), views) == [["r2", "r1"]]    # shares 64 tokens: under MIN_SHARED_TOKENS
    assert choose(block_hashes(a[:200]), views)[0] == ["r1"]         # 192 tokens: worth going to r1 for


def test_an_overloaded_holder_is_passed_over():
    a = block_hashes(list(range(1000)))
    busy = [view("r1", a, load=4), view("r2", load=1)]               # 3 above the least loaded (the limit is 2)
    assert choose(a, busy) == [["r2", "r1"]]
    full = [view("r1", a, load=2, capacity=2), view("r2", load=1)]   # at its capacity
    assert choose(a, full) == [["r2", "r1"]]
    assert choose(a, [view("r1", a, load=3), view("r2", load=1)])[0] == ["r1"]
    assert choose(a, []) == []


def test_least_loaded_ties_spare_the_fullest_and_most_recent_caches():
    views = [view("old", range(5), last_sent=1.0), view("new", range(5), last_sent=2.0), view("empty")]
    assert least_loaded(views[:2], random.Random(0)) == ["old", "new"]
    assert least_loaded([views[0], views[2]], random.Random(0)) == ["empty", "old"]
    # more than two replicas: two at random, so load spreads over all of them
    seen = {tuple(least_loaded(views, random.Random(s))) for s in range(40)}
    assert all(len(p) == 2 for p in seen) and {i for p in seen for i in p} == {"old", "new", "empty"}


def test_what_a_replica_holds_is_its_report_and_what_it_was_sent_since():
    doc_a, doc_b = frozenset(block_hashes(list(range(640)))), frozenset(block_hashes(list(range(900, 1540))))
    assert known_held((5.0, doc_a), None) == (doc_a, 5.0)
    assert known_held((5.0, doc_a), (4.0, doc_b)) == (doc_a, 5.0)         # the report came after: it says all
    assert known_held((5.0, doc_a), (6.0, doc_b)) == (doc_a | doc_b, 6.0)  # its other slot still holds doc_a
