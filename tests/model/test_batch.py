"""Several sequences through one forward (Model.run over a Batch, Engine.step_batch, and prompt
chunks through Engine.forward_chunks): each gets the tokens and logits it gets alone; the checks a
batch makes before it writes anything."""
from __future__ import annotations

import pytest
import torch

import kernels_cuda
from minirun import Engine
from minirun.errors import ContextError

# the same checks through the GPU runner where a GPU is present (float32 there sums in other orders)
GPU = pytest.mark.skipif(not (kernels_cuda.available() and torch.cuda.is_available()), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]
TOL = {"cpu": (1e-4, 2e-4), "cuda": (2e-3, 2e-3)}   # (decode logits, prefill logits), absolute


def tol(device: str, setting: str, which: int) -> float:
    """The logits' tolerance (which 0: decode, 1: prefill); bfloat16 on a GPU: a rounding apart
    (as tests/model/test_cuda_graph.py), its batched and single GEMMs summing in other orders."""
    return 0.05 if device == "cuda" and SETTINGS[setting].get("dtype") == "bfloat16" else TOL[device][which]

N_NEW = 10
SETTINGS = {"dense": dict(kv="dense"),
            "hca": dict(kv="hca", kv_budget=0.5, window=16, sinks=4, fit_min_tokens=32),
            "hca-far": dict(kv="hca", key_store="exact", window=16, sinks=4, far_positions="on"),
            # quantized weights: the fused kernels' GEMVs take the batch's B rows at once
            "dense-q4_1": dict(kv="dense", weights="q4_1"),
            "hca-bf16": dict(kv="hca", kv_budget=0.5, window=16, sinks=4, fit_min_tokens=32, dtype="bfloat16")}


def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(4, 300, (n,), generator=g).tolist() for n in (30, 47, 64, 81)]


def batch_greedy(engines, ids):
    """Greedy decoding of every prompt together -> (tokens per sequence, logits [N_NEW - 1, B, V])."""
    toks = [int(e.prefill(p)[0][-1].argmax()) for e, p in zip(engines, ids)]
    out, logits = [[t] for t in toks], []
    for _ in range(N_NEW - 1):
        lg = Engine.step_batch(engines, toks)
        toks = lg.argmax(-1).tolist()
        for o, t in zip(out, toks):
            o.append(t)
        logits.append(lg)
    return out, torch.stack(logits)


def alone_greedy(eng, ids):
    eng.reset()
    tok = int(eng.prefill(ids)[0][-1].argmax())
    out, logits = [tok], []
    for _ in range(N_NEW - 1):
        lg = eng.step(tok)
        tok = int(lg[-1].argmax())
        out.append(tok)
        logits.append(lg[-1])
    return out, torch.stack(logits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_batch_of_four_decodes_each_as_alone(tiny_model_dir, setting, device):
    eng = Engine.load(tiny_model_dir("gqa-untied"), device=device, ctx=160, **SETTINGS[setting])
    seqs = [eng] + [eng.sibling() for _ in range(3)]
    assert all(s.model is eng.model and s.cache is not eng.cache for s in seqs[1:])
    ids = prompts()
    got, lb = batch_greedy(seqs, ids)
    alone = Engine.load(tiny_model_dir("gqa-untied"), device=device, ctx=160, **SETTINGS[setting])
    for i, p in enumerate(ids):
        want, la = alone_greedy(alone, p)
        assert got[i] == want, i
        assert (lb[:, i] - la).abs().max().item() <= tol(device, setting, 0)
        assert seqs[i].cache.offset == len(p) + N_NEW - 1


def prefill_together(engines, ids):
    """Each engine's prefill_steps driven together, every step one Engine.forward_chunks of all the
    prompts not yet read -> (last logits [1, V] per engine, sequences per forward)."""
    steps = [e.prefill_steps(p) for e, p in zip(engines, ids)]
    pending = {i: s.send(None) for i, s in enumerate(steps)}
    last, sizes = {}, []
    while pending:
        idx = list(pending)
        sizes.append(len(idx))
        hidden = Engine.forward_chunks([engines[i] for i in idx], [pending[i] for i in idx])
        for j, i in enumerate(idx):
            try:
                pending[i] = steps[i].send(hidden[j:j + 1])
            except StopIteration as done:
                last[i] = done.value[0]
                del pending[i]
    return [last[i] for i in range(len(engines))], sizes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("setting", ["dense", "hca", "dense-q4_1"])
def test_prompts_read_together_answer_as_alone(tiny_model_dir, setting, device):
    """Four prompts of 30-81 tokens in chunks of 16, each chunk of all of them in one forward: each
    prompt's last logits are those of its prefill alone, and the decoding after them too."""
    kw = dict(device=device, ctx=160, prefill_chunk=16, **SETTINGS[setting])
    eng = Engine.load(tiny_model_dir("gqa-untied"), **kw)
    seqs = [eng] + [eng.sibling() for _ in range(3)]
    ids = prompts()
    last, sizes = prefill_together(seqs, ids)
    assert sizes == [4, 4, 3, 2, 1, 1]                 # (2, 3, 4, 6 chunks)
    alone = Engine.load(tiny_model_dir("gqa-untied"), **kw)
    for i, p in enumerate(ids):
        alone.reset()
        want = alone.prefill(p)[0]
        assert (last[i] - want).abs().max().item() <= tol(device, setting, 1), i
        assert seqs[i]._cached_ids == p and seqs[i].cache.offset == len(p)
    toks = [int(lg[-1].argmax()) for lg in last]
    for _ in range(N_NEW - 1):
        toks = Engine.step_batch(seqs, toks).argmax(-1).tolist()
    for i, p in enumerate(ids):
        assert seqs[i]._cached_ids[:len(p)] == p
        assert seqs[i]._cached_ids[len(p):] == alone_greedy(alone, p)[0][:N_NEW - 1], i


def test_a_prefill_sent_none_stops_before_its_chunk(tiny_model_dir):
    """The driver stops a prefill by sending None instead of a chunk's result: the cache holds the
    chunks run so far, and the next prefill of the prompt reuses them."""
    eng = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=160, prefill_chunk=16)
    ids = prompts()[3]
    steps = eng.prefill_steps(ids)
    chunk = steps.send(None)
    for _ in range(2):
        chunk = steps.send(eng.model.forward(chunk.tokens, chunk.cache, hidden=True))
    with pytest.raises(StopIteration):
        steps.send(None)
    assert eng._cached_ids == ids[:32] and eng.cache.offset == 32
    assert eng.prefill(ids)[1] == 32


def test_a_batch_refuses_before_it_writes(tiny_model_dir):
    d = tiny_model_dir("gqa-untied")
    eng = Engine.load(d, device="cpu", ctx=40)
    full, other = eng.sibling(), Engine.load(d, device="cpu", ctx=40)
    eng.prefill(list(range(4, 20)))
    full.prefill(list(range(4, 44)))
    with pytest.raises(ContextError, match="full"):
        Engine.step_batch([eng, full], [5, 6])
    assert eng.cache.offset == 16 and full.cache.offset == 40
    with pytest.raises(ValueError, match="one model"):
        Engine.step_batch([eng, other], [5, 6])
    with pytest.raises(ValueError, match="one token for each"):
        Engine.step_batch([eng], [5, 6])
    with pytest.raises(ValueError, match="one model"):
        Engine.forward_chunks([eng, other], [eng.prefill_steps([5, 6]).send(None)] * 2)
