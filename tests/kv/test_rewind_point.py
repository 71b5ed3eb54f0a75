"""The HCA cache's rewind point (minirun/kv/ring_checkpoint.py): a prompt that shares a long document
with the last one, but not its question and answer, prefills only its own suffix."""
import pytest
import torch

from minirun import Engine

from test_hca_cache import make_cache, push, random_ids


def held_positions(cache):
    return sorted(cache.slot_pos[cache.slot_pos >= 0].tolist() + list(range(cache.S, cache.S + cache.n_store)))


def test_truncate_back_into_the_checkpoints_ring():
    cache, args = make_cache(S=3, W=5)
    push(cache, args, 12, 0)                  # store 3..6, ring 7..11
    cache.checkpoint()
    push(cache, args, 9, 12)                  # 12..20: store 3..15, ring 16..20
    assert not cache.truncate(6)              # in the store at the checkpoint too
    assert cache.truncate(9)                  # 9 was in the checkpoint's ring: restored, then dropped from 9 on
    assert cache.offset == 9 and cache.n_store == 4 and held_positions(cache) == list(range(9))
    for slot, p in enumerate(cache.slot_pos.tolist()):   # the restored slots hold their own tokens
        if p >= 0:
            assert cache.ek[0, 0, slot, 0].item() == p and cache.ev[1, 1, slot, 0].item() == p + 0.5
    push(cache, args, 10, 9)                  # new tokens at 9..18 (ring 14..18, store 3..13)
    assert held_positions(cache) == list(range(19))
    assert cache.values.view(0, cache.n_store)[0, :, 0].tolist() == [p + 0.5 for p in range(3, 14)]
    # positions 9.. were rewritten since the checkpoint: it may restore up to 9 only
    assert not cache.truncate(10)
    assert cache.truncate(8) and held_positions(cache) == list(range(8))
    cache.reset()
    push(cache, args, 20, 0)
    assert not cache.truncate(9)              # reset dropped the copy


def hca_engine(d, **kw):
    return Engine.load(d, device="cpu", ctx=512, kv="hca", kv_budget=0.25, centroids=16, tau=0.9, window=16,
                       sinks=4, prefill_chunk=32, fit_min_tokens=32, **kw)


def test_next_question_reuses_the_document_after_a_long_answer(tiny_model_dir):
    """doc + q1, a 40-token answer (question and answer are past the 16-token ring), then doc + q2:
    the document is reused, with the answer of an engine that went back to the document while it
    was still in the ring (the same codebooks: both fitted them on doc + q1). Then doc + q3 after
    the second long answer: the logits of going back to the document through the ring only."""
    d = tiny_model_dir("gqa-untied")
    doc, q1, q2, q3 = random_ids(150, 0), random_ids(6, 1), random_ids(5, 2), random_ids(7, 3)
    eng = hca_engine(d)
    eng.generate(doc + q1, max_new_tokens=40, ignore_eos=True)
    assert eng.cache.S + eng.cache.n_store > len(doc)            # the document's end left the ring
    a2 = eng.generate(doc + q2, max_new_tokens=30, ignore_eos=True)
    assert a2.reused_tokens == len(doc)
    assert eng.cache.S + eng.cache.n_store > len(doc)
    la, reused = eng.prefill(doc + q3)
    assert reused == len(doc)

    ref = hca_engine(d)
    ref.generate(doc + q1, max_new_tokens=0)                     # doc + q1 only: q1 is still in the ring
    b2 = ref.generate(doc + q2, max_new_tokens=30, ignore_eos=True)
    assert b2.reused_tokens == len(doc) and b2.tokens == a2.tokens
    ref3 = hca_engine(d)
    ref3.generate(doc + q1, max_new_tokens=0)
    ref3.generate(doc + q2, max_new_tokens=0)
    lb, reused_b = ref3.prefill(doc + q3)
    assert reused_b == len(doc) and eng.cache.n_store == ref3.cache.n_store
    assert torch.equal(la, lb)


def test_without_the_copy_the_document_is_prefilled_again(tiny_model_dir):
    d = tiny_model_dir("gqa-untied")
    doc = random_ids(150, 0)
    eng = hca_engine(d)
    eng.generate(doc + random_ids(6, 1), max_new_tokens=40, ignore_eos=True)
    eng.cache.rewind_points.drop()
    assert eng.generate(doc + random_ids(5, 2), max_new_tokens=2).reused_tokens == 0


def test_long_questions_come_back_to_where_the_last_prompt_left_the_document(tiny_model_dir):
    """Questions longer than the 16-token ring: the copy at the end of a prompt does not reach back
    to the document, the one where a prompt left the cached tokens (the document's end) does."""
    d = tiny_model_dir("gqa-untied")
    doc, q1, q2, q3 = random_ids(150, 0), random_ids(6, 1), random_ids(30, 2), random_ids(30, 3)
    eng = hca_engine(d)
    eng.generate(doc + q1, max_new_tokens=20, ignore_eos=True)     # a short question first
    assert eng.generate(doc + q2, max_new_tokens=20, ignore_eos=True).reused_tokens == len(doc)
    la, reused = eng.prefill(doc + q3)                               # back past q2 + its answer
    assert reused == len(doc)
    ref = hca_engine(d)
    ref.generate(doc + q1, max_new_tokens=0)
    lb, reused_b = ref.prefill(doc + q3)                             # (q1 still in the ring)
    assert reused_b == len(doc) and torch.equal(la, lb)

    eng = hca_engine(d)
    eng.generate(doc + q2, max_new_tokens=20, ignore_eos=True)      # a long question first
    again = eng.generate(doc + q3, max_new_tokens=20, ignore_eos=True)
    assert again.reused_tokens == 0                                  # the document is prefilled again, once
    la, reused = eng.prefill(doc + q1)
    assert reused == len(doc)
    ref = hca_engine(d)
    ref.generate(doc + q2, max_new_tokens=0)                         # (the same codebooks: fitted on doc + q2)
    ref.reset()
    ref.prefill(doc)
    lb, _ = ref.prefill(doc + q1)
    assert torch.equal(la, lb)


def test_codebooks_fitted_after_the_copy_refuse_it(tiny_model_dir):
    """A prompt shorter than the ring leaves the store empty; a long answer then fills it and the
    codebooks are fitted from its keys (their full-precision copies dropped): the copy no longer
    fits the store, and the next prompt is prefilled from scratch, as a fresh engine would."""
    d = tiny_model_dir("gqa-untied")
    p1, p2 = random_ids(12, 4), random_ids(12, 4)[:10] + random_ids(4, 5)
    eng = hca_engine(d)
    eng.generate(p1, max_new_tokens=80, ignore_eos=True)
    assert eng.cache.codebooks is not None and eng.cache.rewind_points.copies["prompt"].codebooks is None
    again = eng.generate(p2, max_new_tokens=8, ignore_eos=True)
    assert again.reused_tokens == 0
    assert again.tokens == hca_engine(d).generate(p2, max_new_tokens=8, ignore_eos=True).tokens


@pytest.mark.parametrize("kv", ["dense", "hca"])
def test_rewind_to_the_document_keeps_it(tiny_model_dir, kv):
    """Engine.rewind (the chat's /reset) back to the document after a long answer."""
    d = tiny_model_dir("gqa-untied")
    doc = random_ids(150, 0)
    eng = hca_engine(d) if kv == "hca" else Engine.load(d, device="cpu", ctx=512)
    eng.prefill(doc)
    eng.generate(doc + random_ids(6, 1), max_new_tokens=40, ignore_eos=True)
    eng.rewind(len(doc))
    assert eng.cache.offset == len(doc) and eng._cached_ids == doc
