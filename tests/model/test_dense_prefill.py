"""Dense attention of a prompt after cached tokens (grouped query heads, no K/V copies) against a
plain softmax reference, and a chunked prefill against a one-shot one."""
import pytest
import torch

from minirun import Engine
from minirun.kv.dense import dense_attention


def reference(q, K, V, pos0):
    """q [T, Hq, hd] at positions pos0..; K, V [Hkv, n, hd]: softmax(q k / sqrt(hd)) v with K/V repeated."""
    T, Hq, hd = q.shape
    rep = Hq // K.shape[0]
    K, V = K.repeat_interleave(rep, 0), V.repeat_interleave(rep, 0)             # [Hq, n, hd]
    s = torch.einsum("thd,hnd->htn", q, K) / hd ** 0.5
    later = torch.arange(K.shape[1])[None, :] > (pos0 + torch.arange(T))[:, None]   # [T, n]
    p = torch.softmax(s.masked_fill(later, float("-inf")), -1)
    return torch.einsum("htn,hnd->thd", p, V)


@pytest.mark.parametrize("Hq,Hkv", [(9, 3), (4, 4), (8, 2)])
@pytest.mark.parametrize("T,pos0", [(2, 1), (7, 40), (33, 300)])
def test_attention_after_cached_tokens(Hq, Hkv, T, pos0):
    g = torch.Generator().manual_seed(T + pos0)
    q = torch.randn(T, Hq, 16, generator=g)
    K, V = torch.randn(Hkv, pos0 + T, 16, generator=g), torch.randn(Hkv, pos0 + T, 16, generator=g)
    assert (dense_attention(q, K, V, pos0) - reference(q, K, V, pos0)).abs().max().item() <= 1e-5


def test_chunked_prefill_equals_one_shot(tiny_model_dir):
    d = tiny_model_dir("gqa-untied")
    ids = torch.randint(4, 300, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    one = Engine.load(d, device="cpu", ctx=256).logits(ids)
    chunked = Engine.load(d, device="cpu", ctx=256, prefill_chunk=16).logits(ids)
    assert (one - chunked).abs().max().item() <= 1e-4
