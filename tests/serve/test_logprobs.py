"""Log-probabilities: each answer token's and each prompt token's equal the model's own (Engine.logits
over the whole sequence), in the engine and through the server's OpenAI fields (chat `logprobs` /
`top_logprobs`, completions `logprobs` and `echo`: what lm-eval's local-completions reads)."""
from __future__ import annotations

import math

import openai
import pytest
import torch

from minirun import Engine
from minirun.serve.server import make_server
from test_serve import ThreadServer

CTX = 512


@pytest.fixture(scope="module")
def eng(tiny_model_dir):
    return Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=CTX)


def reference(eng, ids: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every position of ids [T] -> [T, V] (a fresh cache)."""
    return torch.log_softmax(eng.logits(ids).float(), -1)


def test_answer_logprobs_equal_the_models(eng):
    ids = list(range(5, 40))
    res = eng.generate(ids, max_new_tokens=8, temperature=0.8, seed=3, ignore_eos=True, logprobs=3)
    ref = reference(eng, ids + res.tokens)
    assert [t for t, _, _ in res.logprobs] == res.tokens
    for i, (tok, lp, top) in enumerate(res.logprobs):
        row = ref[len(ids) - 1 + i]
        assert abs(lp - row[tok].item()) <= 1e-4
        assert [t for t, _ in top] == row.topk(3).indices.tolist()
        assert all(abs(v - row[t].item()) <= 1e-4 for t, v in top)
    greedy = eng.generate(ids, max_new_tokens=4, ignore_eos=True, logprobs=1)
    assert all(top[0][0] == tok for tok, _, top in greedy.logprobs)     # greedy: the most likely one
    assert eng.generate(ids, max_new_tokens=2, ignore_eos=True).logprobs is None


def test_prompt_logprobs_equal_the_models(eng):
    ids = list(range(7, 30))
    got = eng.prompt_logprobs(ids, top=2)
    ref = reference(eng, ids)
    assert got[0] == (ids[0], None, [])
    for i in range(1, len(ids)):
        tok, lp, top = got[i]
        assert tok == ids[i] and abs(lp - ref[i - 1, tok].item()) <= 1e-4 and len(top) == 2


@pytest.fixture(scope="module")
def served(eng):
    srv = ThreadServer(make_server(eng, "tiny", max_queue=4, log_level="warning"))
    yield srv
    srv.close()


def test_completions_echo_and_logprobs_as_lm_eval_reads_them(served, eng):
    """lm-eval's loglikelihood request: the context and continuation as token ids, echo, logprobs 1,
    max_tokens 1; it sums token_logprobs[ctxlen:-1] and checks each against the top one."""
    ids = list(range(11, 41))
    r = served.client().completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=1,
                                           temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference(eng, ids)
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) <= 1e-4
        assert math.isclose(max(lp.top_logprobs[i].values()), ref[i - 1].max().item(), abs_tol=1e-4)
    assert r.choices[0].text.startswith(eng.detokenize(ids))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_and_top_logprobs(served):
    c = served.client()
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                  temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
    assert all(e.top_logprobs[0].token == e.token for e in content)        # greedy
    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                            temperature=0, logprobs=True, stream=True, extra_body={"ignore_eos": True}))
    streamed = [e for ch in chunks for choice in ch.choices if choice.logprobs for e in choice.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"
