"""The sampler: the distribution it draws from, and a token (never an exception) for any parameters
SamplingParams accepts, whatever the logits hold."""
import itertools

import pytest
import torch

from minirun.errors import MiniRunError
from minirun.sampling import Sampler, SamplingParams


def draws(params: SamplingParams, logits: torch.Tensor, n: int, history=None) -> torch.Tensor:
    sampler = Sampler(params)
    return torch.tensor([sampler(logits, history) for _ in range(n)])


def test_temperature_draws_follow_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0])
    for t in (1.0, 0.5):
        freq = torch.bincount(draws(SamplingParams(temperature=t, seed=3), logits, 4000), minlength=5) / 4000
        assert torch.allclose(freq, torch.softmax(logits / t, 0), atol=0.03), (t, freq)


def test_top_p_and_top_k_keep_the_most_likely_tokens():
    logits = torch.tensor([3.0, 2.5, 0.0, -1.0])
    p = torch.softmax(logits, 0)
    got = set(draws(SamplingParams(temperature=1.0, top_p=float(p[0] + p[1] / 2), seed=1), logits, 300).tolist())
    assert got == {0, 1}
    assert set(draws(SamplingParams(temperature=1.0, top_k=1, seed=1), logits, 50).tolist()) == {0}


ROUGH = [torch.tensor([1.0, 5.0, -2.0, 0.5]),
         torch.tensor([float("inf"), 1.0, float("-inf"), 0.0]),
         torch.tensor([float("nan"), 2.0, float("nan"), 1.0]),
         torch.tensor([3e38, -3e38, 1.0, 0.0]),
         torch.full((4,), float("nan")),
         torch.full((4,), float("-inf"))]
EXTREMES = dict(temperature=[0.0, 1e-300, 1e-5, 1.0, 1e30], top_p=[1e-320, 1e-6, 1.0], min_p=[0.0, 0.999999],
                top_k=[0, 1, 10**12], repetition_penalty=[1e-320, 0.01, 1.0, 1e30])


@pytest.mark.parametrize("logits", ROUGH, ids=["plain", "inf", "nan", "huge", "all-nan", "all-ninf"])
def test_any_accepted_parameters_give_a_token(logits):
    history = torch.tensor([0, 1, 3])
    names = list(EXTREMES)
    for values in itertools.product(*EXTREMES.values()):
        params = SamplingParams(**dict(zip(names, values)), seed=0)
        tok = Sampler(params)(logits, history)
        assert 0 <= tok < 4, params
        if not logits.isnan().any() and params.temperature < 1e-5 and params.repetition_penalty == 1.0:
            assert tok == int(logits.argmax()), params     # greedy


def test_a_vanishing_top_p_is_the_most_likely_token():
    logits = torch.tensor([0.1, 0.3, 0.2])
    assert set(draws(SamplingParams(temperature=1.0, top_p=1e-320, seed=5), logits, 40).tolist()) == {1}


def test_out_of_range_parameters_are_refused():
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=1.0), dict(top_k=-1),
                dict(repetition_penalty=0.0)):
        with pytest.raises(MiniRunError):
            SamplingParams(**bad)
