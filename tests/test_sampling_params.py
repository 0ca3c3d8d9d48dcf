"""SamplingParams: defaults, normalisation, and one-line errors for every out-of-range field."""
import pytest

from qserve.errors import QServeError
from qserve.sampling_params import SamplingParams


def test_defaults_are_valid_and_random():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 1.0, 0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None
    assert not p.greedy and not p.has_penalties


def test_stop_str_becomes_list():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


@pytest.mark.parametrize("kw, greedy", [
    (dict(temperature=0), True), (dict(top_k=1), True), (dict(temperature=0.7, top_k=1), True),
    (dict(temperature=1e-3), False), (dict(top_k=2), False), (dict(top_k=-1), False)])
def test_greedy(kw, greedy):
    assert SamplingParams(**kw).greedy is greedy


@pytest.mark.parametrize("kw", [
    dict(repetition_penalty=1.1), dict(presence_penalty=-0.5), dict(frequency_penalty=2)])
def test_has_penalties(kw):
    assert SamplingParams(**kw).has_penalties


@pytest.mark.parametrize("kw, message", [
    (dict(n=0), "n=0 must be at least 1"),
    (dict(temperature=-1), "temperature=-1 must be >= 0"),
    (dict(top_p=0), "top_p=0 must be in (0, 1]"),
    (dict(top_p=1.5), "top_p=1.5 must be in (0, 1]"),
    (dict(top_k=-2), "top_k=-2 must be -1 or 0 (off) or a positive number of tokens"),
    (dict(min_p=-0.1), "min_p=-0.1 must be in [0, 1]"),
    (dict(min_p=1.1), "min_p=1.1 must be in [0, 1]"),
    (dict(repetition_penalty=0), "repetition_penalty=0 must be > 0 (1 = off)"),
    (dict(presence_penalty=2.5), "presence_penalty=2.5 must be in [-2, 2]"),
    (dict(frequency_penalty=-3), "frequency_penalty=-3 must be in [-2, 2]"),
    (dict(max_tokens=0), "max_tokens=0 must be at least 1"),
    (dict(min_tokens=-1), "min_tokens=-1 must be in [0, max_tokens=16]"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens=20 must be in [0, max_tokens=10]"),
    (dict(logprobs=21), "logprobs=21 must be in [0, 20] or None"),
    (dict(logprobs=-1), "logprobs=-1 must be in [0, 20] or None"),
    (dict(stop=["ok", ""]), "stop='' must be a non-empty string"),
    (dict(stop_token_ids=[-5]), "stop_token_ids entry -5 must be a token id >= 0"),
    (dict(output_kind="deltas"), "output_kind='deltas' must be one of cumulative, delta, final_only"),
])
def test_bad_values_name_value_and_range(kw, message):
    with pytest.raises(QServeError) as e:
        SamplingParams(**kw)
    assert str(e.value) == message
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


@pytest.mark.parametrize("kw", [
    dict(top_p=1e-6), dict(top_k=-1), dict(min_p=1), dict(presence_penalty=-2),
    dict(frequency_penalty=2), dict(logprobs=0), dict(logprobs=20), dict(min_tokens=16),
    dict(temperature=0, seed=0)])
def test_edges_of_ranges_are_accepted(kw):
    SamplingParams(**kw)
