"""The caches' key stores (minirun/kv/key_store_cpu.py, key_store_cuda.py): each layout gets the
store it names, a store with no key encoded yet is scored by the exact-keys store, and the CPU
cache's stats count exactly the stores' arrays (which the planner declares)."""
import pytest
import torch

from kernels_cpu import fastscan
from minirun import Engine
from minirun.kv.key_store_cpu import CodebookKeys, ExactKeys, PairKeys, ProductPairKeys
from minirun.kv.key_store_cuda import DeviceCodes, DeviceExactKeys
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


@pytest.mark.parametrize("setting,kind", [
    (dict(kv_budget=0.5), DeviceExactKeys),
    (dict(kv_budget=0.25, centroids=32), DeviceCodes),
    (dict(groups=16, centroids=16), DeviceCodes),       # nibble pairs: product-codebook indices on a GPU
])
def test_gpu_cache_gets_its_store(tiny_model_dir, setting, kind):
    """The GPU cache (on the kernel emulator): the layout's store scores every decode step; a
    prompt's chunks in hca mode before the codebooks are scored by the exact keys."""
    import cuda_emu
    with cuda_emu.emulated_hca_cuda():
        eng = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=400, kv="hca", window=16, sinks=4,
                          prefill_chunk=32, prefill_mode="hca", fit_min_tokens=64, **setting)
        c = eng.cache
        assert type(c.key_store) is kind and type(c.exact_store) is DeviceExactKeys
        assert (c.key_store is c.exact_store) == (kind is DeviceExactKeys)
        ran = []                                        # (store, every store token encoded) of each score
        for store in {c.exact_store, c.key_store}:
            real = store.score
            store.score = lambda *a, real=real, store=store: ran.append((type(store), c.n_encoded == c.n_store)) \
                or real(*a)
        eng.prefill(random_ids(120))
        assert ran[0] == (DeviceExactKeys, False)       # store tokens before the codebooks (fitted at 64)
        ran[:] = []
        for t in (5, 6):
            eng.step(t)
        assert ran == [(kind, kind is DeviceCodes)] * 2 * 2    # 2 steps, 2 layers
