"""The CPU's one-token step through numpy arrays and the fused kernels (runners.NumpyTokenRunner)
against the same step through torch's ops (runners.TorchRunner, the reference): the same logits to
float rounding, for float32, bfloat16 and quantized weights, dense and HCA caches."""
from __future__ import annotations

import pytest
import torch

from minirun.tools.bench import random_ids as _random_ids
from minirun.engine import Engine


def random_ids(n, seed):
    return _random_ids(n, 300, seed)   # (tiny_model_dir's vocabulary)


def decode_logits(eng, ids, n=6, torch_path=False):
    """Logits of n decode steps after the prompt ids (greedy), one [n, V] tensor."""
    if torch_path:
        eng.model.use_torch_ops()
    assert (eng.model.token_runner is None) == torch_path
    logits, _ = eng.prefill(ids)
    tok, out = int(logits[-1].argmax()), []
    for _ in range(n):
        lg = eng.step(tok)
        out.append(lg.float())
        tok = int(lg[-1].argmax())
    return torch.cat(out)


@pytest.mark.parametrize("kw", [dict(), dict(dtype="bfloat16"), dict(weights="q4_1"), dict(weights="q8_0"),
                                dict(kv="hca", key_store="exact", window=16, sinks=4, prefill_mode="hca")],
                         ids=["f32", "bf16", "q4_1", "q8_0", "hca"])
def test_numpy_token_equals_torch_token(tiny_model_dir, kw):
    d = tiny_model_dir("gqa-untied")
    ids = random_ids(80, seed=3)
    a = decode_logits(Engine.load(d, device="cpu", ctx=128, **kw), ids)
    b = decode_logits(Engine.load(d, device="cpu", ctx=128, **kw), ids, torch_path=True)
    # (bfloat16: torch's ops round each op's output to bfloat16, the fused kernels keep float32
    # inside a layer's half: a few of bfloat16's ulps, 2^-8 each)
    tol = 1e-2 if kw.get("dtype") == "bfloat16" else 1e-5
    assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


HCA_SMALL = dict(kv="hca", window=16, sinks=4, fit_min_tokens=40)


@pytest.mark.parametrize("kw", [dict(kv_budget=0.5), dict(kv_budget=0.5, far_positions="on"),
                                dict(groups=8, centroids=16), dict(groups=8, centroids=16, far_positions="on"),
                                dict(kv_budget=0.5, kv_values="q4")],
                         ids=["codebook", "codebook-far", "pairs", "pairs-far", "q4-values"])
@pytest.mark.parametrize("prompt", [3, 14, 90], ids=["sinks-filling", "ring-filling", "store"])
def test_numpy_hca_token_equals_torch_token(tiny_model_dir, kw, prompt):
    """HCACache.attend_np (the fused step, and the exact tier alone while the store is empty)
    against HCABase.attend's torch path, from a prompt that has not filled the sinks, one that
    fills the ring during decoding, and one with a store."""
    d = tiny_model_dir("gqa-untied", head_dim=32)   # (q4 values: groups of 32 channels)
    ids = random_ids(prompt, seed=5)
    load = lambda: Engine.load(d, device="cpu", ctx=160, **HCA_SMALL, **kw)   # noqa: E731
    a = decode_logits(load(), ids, n=12)
    b = decode_logits(load(), ids, n=12, torch_path=True)
    assert (a - b).abs().max().item() <= 1e-4 * max(1.0, b.abs().max().item())


def test_hidden_state_is_a_copy(tiny_model_dir):
    """forward(hidden=True) returns a state the next step does not overwrite."""
    eng = Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=64)
    eng.prefill(random_ids(10, seed=4))
    m, c = eng.model, eng.cache
    h1 = m.forward(torch.tensor([5]), c, hidden=True)
    keep = h1.clone()
    m.forward(torch.tensor([6]), c, hidden=True)
    assert torch.equal(h1, keep)
