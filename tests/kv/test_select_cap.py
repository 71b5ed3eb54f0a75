"""The selection cap (EngineConfig.max_select): per head, at most `cap` of the tau set, the highest by
score (whole score buckets from the top); on the CPU cache, inside the key store's one-call steps."""
import numpy as np
import pytest
import torch

from minirun import Engine
from minirun.config import EngineConfig
from minirun.errors import MiniRunError

from test_hca_cache import random_ids


def test_max_select_validated():
    with pytest.raises(MiniRunError, match="max_select must be at least 1"):
        EngineConfig(kv="hca", max_select=0)


def _engines(d, **kw):
    base = dict(device="cpu", ctx=512, kv="hca", key_store="exact", tau=1.0, window=16, sinks=4, prefill_chunk=32)
    return [Engine.load(d, **{**base, **kw, "max_select": m}) for m in (None, 10_000, 6)]


def test_cap_above_the_store_changes_nothing_and_a_small_one_bounds_the_selection(tiny_model_dir):
    """Exact keys, tau = 1 (every store token): a cap >= the store is the uncapped step (the
    one-call kernel against the generic path, 1e-4); a cap of 6 keeps 6 tokens per head and step
    and moves the logits."""
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(150, seed=7)
    free, big, small = _engines(d)
    outs = []
    for eng in (free, big, small):
        eng.prefill(ids)
        eng.cache.record_selection = []
        outs.append(torch.stack([eng.step(t).reshape(-1) for t in (5, 9, 11)]))
    n = small.cache.n_store     # (each step recorded counts / its own store size, >= n - 3)
    assert n > 100 and all(np.all(f <= 6 / (n - 3) + 1e-9) for f in small.cache.record_selection)
    assert len(small.cache.record_selection) == 3 * small.args.num_hidden_layers
    assert all(np.allclose(f, 1.0) for f in big.cache.record_selection)   # tau = 1: every token, no cap
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-4
    assert (outs[0] - outs[2]).abs().max().item() > 1e-3


def test_capped_step_equals_top_k_attention(tiny_model_dir):
    """With exact keys and tau = 1 a capped decode step's store part is softmax attention over each
    head's top c <= cap keys by exact score (c: what the step kept, in whole 1/32-logit buckets from
    the top), through the model's first layer output."""
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(120, seed=8)
    eng = _engines(d)[2]
    eng.prefill(ids)
    c = eng.cache
    q = torch.randn(1, c.Hq, c.hd, generator=torch.Generator().manual_seed(1))
    k = torch.randn(1, c.Hkv, c.hd, generator=torch.Generator().manual_seed(2))
    v = torch.randn(1, c.Hkv, c.hd, generator=torch.Generator().manual_seed(3))
    got = c.attend(0, q, k, v)[0]                                              # [Hq, hd]
    kept = c.key_store.counts.copy()
    assert (kept >= 1).all() and (kept <= 6).all() and (kept == 6).any()
    # reference: exact tier + new token + top-6 store keys by exact score, one softmax per head
    qs = q[0].float() * c.scale
    K = c.exact_keys.view(0, c.n_store - c.exact_base).float()                # [Hkv, n, hd]
    V = c.values.view(0, c.n_store).float()
    live = c.slot_pos >= 0
    EK, EV = c.ek[0][:, live].float(), c.ev[0][:, live].float()
    for h in range(c.Hq):
        kv = int(c.q_to_kv[h])
        zs = K[kv] @ qs[h]
        top = torch.topk(zs, int(kept[h])).indices
        keys = torch.cat([EK[kv], k[0, kv][None].float(), K[kv, top]])
        vals = torch.cat([EV[kv], v[0, kv][None].float(), V[kv, top]])
        want = torch.softmax(keys @ qs[h], 0) @ vals
        assert (got[h].float() - want).abs().max().item() <= 1e-5, h


@pytest.mark.parametrize("centroids", [32, 16])   # packed levels; 16: nibble pairs (fast scan on AVX2)
def test_cap_on_codebook_stores(tiny_model_dir, centroids):
    """Codebook keys, tau = 0.9: the packed (compact) and fast-scan selections are capped too."""
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(200, seed=9)
    kw = dict(device="cpu", ctx=512, kv="hca", groups=8, centroids=centroids, tau=0.9, window=16, sinks=4,
              prefill_chunk=32, fit_min_tokens=48)
    free, capped = (Engine.load(d, **kw, max_select=m) for m in (None, 3))
    outs = []
    for eng in (free, capped):
        eng.prefill(ids)
        eng.cache.record_selection = []
        outs.append(torch.stack([eng.step(t).reshape(-1) for t in (5, 9)]))
        assert eng.cache.n_encoded == eng.cache.n_store > 150
    n = capped.cache.n_store
    assert max(f.max() for f in free.cache.record_selection) * (n - 2) > 3    # tau alone takes more
    assert all(np.all(f <= 3 / (n - 2) + 1e-9) for f in capped.cache.record_selection)
    assert (outs[0] - outs[1]).abs().max().item() > 1e-3


def test_cli_max_select(tiny_model_dir, capsys, monkeypatch):
    """--max-select reaches the cache from generate and bench; 0 is one line and exit 2 (a usage error,
    before the model loads)."""
    from minirun.cli.main import main
    import minirun.engine as me
    seen = []
    real = me.Engine.load.__func__

    def load(cls, *a, **kw):
        seen.append(kw.get("max_select"))
        return real(cls, *a, **kw)
    monkeypatch.setattr(me.Engine, "load", classmethod(load))
    d = str(tiny_model_dir("gqa-untied"))
    hca = ["--kv", "hca", "--kv-budget", "0.5", "--window", "8", "--sinks", "2", "--ctx", "256"]
    def ok(args):
        try:
            main(args)
        except SystemExit as e:
            assert e.code in (0, None)
    ok(["generate", d, "-p", "hello there " * 20, "-n", "3", *hca, "--max-select", "4"])
    assert seen == [4]
    ok(["bench", d, "-p", "", "-n", "2", "-d", "64", "--kv", "hca", "--kv-budget", "0.5", "-r", "1", "--max-select", "5"])
    assert seen[-1] == 5
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["generate", d, "-p", "hi", *hca, "--max-select", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "'--max-select': 0 is not in the range 1<=x<=" in err[0]
