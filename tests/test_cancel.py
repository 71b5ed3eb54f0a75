"""Stopping an answer: Engine's should_stop (decode and prefill) and the chat's SIGINT handling."""
import os
import signal

import pytest

from minirun import Engine
from minirun.cli.chat import stop_on_sigint


def countdown(n: int):
    """A should_stop that says True from its (n+1)-th call on."""
    calls = {"n": 0}

    def should_stop():
        calls["n"] += 1
        return calls["n"] > n
    return should_stop


@pytest.mark.parametrize("kv", ["dense", "hca"])
def test_cancel_during_decode_keeps_cache_consistent(tiny_model_dir, kv):
    path = tiny_model_dir("gqa-untied")
    kw = dict(device="cpu", ctx=512, kv=kv, key_store="exact", window=16, sinks=4) if kv == "hca" else \
        dict(device="cpu", ctx=512)
    eng = Engine.load(path, **kw)
    prompt = list(range(5, 70))
    r = eng.generate(prompt, max_new_tokens=40, ignore_eos=True, should_stop=countdown(7))
    assert r.finish_reason == "cancelled"
    assert len(r.tokens) == 7                    # checked before each token: the 8th check stops
    assert eng.cache.offset == len(prompt) + 7   # every token kept was also fed: no half step
    # the next turn reuses the cache and gives what a fresh engine gives
    follow = prompt + r.tokens + [11, 12]
    again = eng.generate(follow, max_new_tokens=12, ignore_eos=True)
    assert again.reused_tokens == len(prompt) + 7
    fresh = Engine.load(path, **kw).generate(follow, max_new_tokens=12, ignore_eos=True)
    assert again.tokens == fresh.tokens


def test_cancel_during_prefill_keeps_the_chunks_done(tiny_model_dir):
    path = tiny_model_dir("gqa-untied")
    eng = Engine.load(path, device="cpu", ctx=512, prefill_chunk=16)
    prompt = list(range(3, 103))                 # 100 tokens: 7 chunks of 16
    r = eng.generate(prompt, max_new_tokens=5, should_stop=countdown(2))
    assert r.finish_reason == "cancelled" and r.tokens == []
    assert eng.cache.offset == 48                # 3 chunks: stop asked after the third
    assert eng.last_prefill["tokens"] == 48
    again = eng.generate(prompt, max_new_tokens=8, ignore_eos=True)
    assert again.reused_tokens == 48
    fresh = Engine.load(path, device="cpu", ctx=512, prefill_chunk=16).generate(prompt, max_new_tokens=8,
                                                                                  ignore_eos=True)
    assert again.tokens == fresh.tokens


def test_stop_on_sigint_sets_flag_then_raises_and_restores():
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with stop_on_sigint() as stopped:
            assert not stopped.is_set()
            os.kill(os.getpid(), signal.SIGINT)      # first Ctrl-C: a flag, no exception
            for _ in range(1000):                    # let the interpreter run the handler
                if stopped.is_set():
                    break
            assert stopped.is_set()
            os.kill(os.getpid(), signal.SIGINT)      # second Ctrl-C: KeyboardInterrupt
            for _ in range(1000):
                pass
    assert signal.getsignal(signal.SIGINT) is before
