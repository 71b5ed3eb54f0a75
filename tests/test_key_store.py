"""The CPU cache's key stores (minirun/kv/key_store_cpu.py): each layout gets the store it names,
a store with no key encoded yet is scored by the exact-keys store, and the cache's stats count
exactly the stores' arrays (which the planner declares)."""
import pytest
import torch

from kernels_cpu import fastscan
from minirun import Engine
from minirun.kv.key_store_cpu import CodebookKeys, ExactKeys, PairKeys, ProductPairKeys
from minirun.planner import plan


def random_ids(n, seed=0):
    return torch.randint(4, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("setting,fast,kind", [
    (dict(kv_budget=0.5), True, ExactKeys),
    (dict(kv_budget=0.25, centroids=32), True, CodebookKeys),
    (dict(groups=16, centroids=16), True, PairKeys),
    (dict(groups=16, centroids=16), False, ProductPairKeys),
])
def test_each_layout_gets_its_store(tiny_model_dir, monkeypatch, setting, fast, kind):
    if fast and kind is PairKeys and not fastscan.available():
        pytest.skip("the fast-scan step needs AVX2")
    monkeypatch.setattr(fastscan, "available", lambda: fast)
    eng = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=400, kv="hca", window=16, sinks=4,
                      prefill_chunk=32, prefill_mode="hca", fit_min_tokens=64, **setting)
    c = eng.cache
    assert type(c.key_store) is kind and type(c.exact_store) is ExactKeys
    assert (c.key_store is c.exact_store) == (kind is ExactKeys)
    ran = []                                            # (store, decode step) of every call
    for store in {c.exact_store, c.key_store}:
        real = store.step
        store.step = lambda *a, real=real, store=store: ran.append((type(store), a[10] is not None)) or real(*a)
    eng.prefill(random_ids(300))
    prefill, ran[:] = ran[:], []
    for t in (5, 6, 7):
        eng.step(t)
    # the prompt's first chunks with a store came before the codebooks (fitted at 64 store keys)
    assert prefill[0] == (ExactKeys, False) and prefill[-1] == (kind, False)
    encodes = kind in (CodebookKeys, PairKeys)         # decode steps encode the leaving ring key ahead
    assert ran == [(kind, encodes)] * 3 * 2             # 3 steps, 2 layers
    s, p = eng.kv_stats(), plan(eng.args, eng.config).tiers
    stores = {c.exact_store, c.key_store}
    assert s["decode_scratch_bytes"] == sum(a.nbytes for st in stores for a in st.scratch) == p["decode scratch"][0]
    copies = sum(a.nbytes for a in c.key_store.copies)
    assert (copies > 0) == (kind is not ExactKeys)
    cb = c.codebooks.nbytes if c.codebooks is not None else 0
    assert s["codebook_bytes"] == cb + copies == p.get("codebooks", (0,))[0]
