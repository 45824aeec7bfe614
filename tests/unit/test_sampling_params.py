"""SamplingParams: every validation rule (each naming its parameter), wire conventions, greedy."""

from __future__ import annotations

import dataclasses
import math

import pytest

from llmplatform.errors import InvalidRequestError
from llmplatform.sampling.params import (GREEDY_TEMPERATURE, MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS,
                                      MAX_STOP_STRING_LENGTH, MAX_STOP_STRINGS, SamplingParams,
                                      check_prompt_token_ids)


def test_defaults_are_valid_and_frozen() -> None:
    params = SamplingParams()
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.top_k is None
    assert params.stop == () and params.stop_token_ids == ()
    assert params.logprobs is None and params.prompt_logprobs is None
    assert params.max_stop_len == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# Wire conventions


@pytest.mark.parametrize("wire_top_k", [-1, 0, None])
def test_top_k_off_values_normalise_to_none(wire_top_k: int | None) -> None:
    assert SamplingParams(top_k=wire_top_k).top_k is None


def test_positive_top_k_is_kept() -> None:
    assert SamplingParams(top_k=1).top_k == 1
    assert SamplingParams(top_k=50).top_k == 50


def test_stop_string_becomes_a_tuple() -> None:
    assert SamplingParams(stop="###").stop == ("###",)


def test_stop_and_stop_token_ids_lists_become_tuples() -> None:
    params = SamplingParams(stop=["a", "bc"], stop_token_ids=[3, 7])  # type: ignore[arg-type]
    assert params.stop == ("a", "bc")
    assert params.stop_token_ids == (3, 7)
    assert params.max_stop_len == 2
    hash(params)  # frozen and made of tuples: usable as a key


# ---------------------------------------------------------------------------------------------
# greedy


@pytest.mark.parametrize("temperature, greedy", [
    (0.0, True),
    (GREEDY_TEMPERATURE / 2, True),
    (GREEDY_TEMPERATURE, False),
    (0.7, False),
    (2.0, False),
])
def test_greedy_property(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).greedy is greedy


# ---------------------------------------------------------------------------------------------
# Validation: every rule raises InvalidRequestError naming the parameter


_INVALID = [
    # finite numbers
    *[(name, value) for name in ("temperature", "top_p", "min_p", "presence_penalty",
                                 "frequency_penalty", "repetition_penalty")
      for value in (math.nan, math.inf, -math.inf, "0.5", None, True)],
    # ranges
    ("temperature", -0.1), ("temperature", 2.01),
    ("top_p", 0.0), ("top_p", -0.5), ("top_p", 1.01),
    ("top_k", -2), ("top_k", 2.5), ("top_k", "5"), ("top_k", True), ("top_k", False),
    ("min_p", -0.01), ("min_p", 1.01),
    ("presence_penalty", -2.01), ("presence_penalty", 2.01),
    ("frequency_penalty", -2.01), ("frequency_penalty", 2.01),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", 10.01),
    ("seed", 1.5), ("seed", "42"), ("seed", True), ("seed", 2**64), ("seed", -(2**63) - 1),
    ("seed", 10**4000),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.0), ("max_tokens", True),
    ("max_tokens", None),
    ("min_tokens", -1), ("min_tokens", 1.5), ("min_tokens", True),
    ("stop", ("ok", "")), ("stop", ("ok", 3)), ("stop", ("",)),
    ("stop", tuple(f"s{i}" for i in range(MAX_STOP_STRINGS + 1))),
    ("stop", ("x" * (MAX_STOP_STRING_LENGTH + 1),)), ("stop", 5), ("stop", None),
    ("stop_token_ids", (1, -1)), ("stop_token_ids", (1.0,)), ("stop_token_ids", (True,)),
    ("stop_token_ids", ("3",)), ("stop_token_ids", "12"), ("stop_token_ids", 12),
    ("stop_token_ids", {1: 2}),
    ("n", 0), ("n", 129), ("n", 1.0), ("n", True), ("n", "2"),
    ("logit_bias", {"-1": 5}), ("logit_bias", {-1: 5}), ("logit_bias", {"1.5": 5}),
    ("logit_bias", {"abc": 5}), ("logit_bias", {"": 5}), ("logit_bias", {" 1": 5}),
    ("logit_bias", {"1" * 11: 5}), ("logit_bias", {True: 5}), ("logit_bias", {1.0: 5}),
    ("logit_bias", {"1": 100.5}), ("logit_bias", {"1": -101}), ("logit_bias", {"1": math.nan}),
    ("logit_bias", {"1": math.inf}), ("logit_bias", {"1": "5"}), ("logit_bias", {"1": True}),
    ("logit_bias", {"1": None}), ("logit_bias", {"1": 1, 1: 2}), ("logit_bias", [1, 2]),
    ("logit_bias", "1:5"), ("logit_bias", 5),
    ("logit_bias", {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 1.0), ("logprobs", True),
    ("prompt_logprobs", -1), ("prompt_logprobs", MAX_LOGPROBS + 1), ("prompt_logprobs", "1"),
    ("prompt_logprobs", False),
]


@pytest.mark.parametrize("name, value", _INVALID, ids=[f"{n}={v!r}"[:40] for n, v in _INVALID])
def test_invalid_value_names_its_parameter(name: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams(**{name: value})
    assert excinfo.value.param == name
    assert excinfo.value.http_status == 400
    assert name in excinfo.value.message


def test_min_tokens_above_max_tokens_is_rejected() -> None:
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert excinfo.value.param == "min_tokens"
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


_VALID_EDGES = [
    ("temperature", 0.0), ("temperature", 2.0), ("temperature", 1),
    ("top_p", 1.0), ("top_p", 1e-9),
    ("min_p", 0.0), ("min_p", 1.0),
    ("presence_penalty", -2.0), ("presence_penalty", 2.0),
    ("frequency_penalty", -2.0), ("frequency_penalty", 2.0),
    ("repetition_penalty", 1e-3), ("repetition_penalty", 10.0),
    ("seed", 0), ("seed", -1), ("seed", 2**64 - 1), ("seed", -(2**63)),
    ("stop", ("x" * MAX_STOP_STRING_LENGTH,)),
    ("n", 1), ("n", 128),
    ("max_tokens", 1),
    ("stop", tuple(f"s{i}" for i in range(MAX_STOP_STRINGS))),
    ("stop_token_ids", (0, 49151)),
    ("logprobs", 0), ("logprobs", MAX_LOGPROBS),
    ("prompt_logprobs", 0), ("prompt_logprobs", MAX_LOGPROBS),
]


@pytest.mark.parametrize("name, value", _VALID_EDGES, ids=[f"{n}={v!r}"[:40] for n, v in _VALID_EDGES])
def test_boundary_values_are_accepted(name: str, value: object) -> None:
    params = SamplingParams(**{name: value})
    assert getattr(params, name) == value


def test_error_is_a_value_error_for_generic_handlers() -> None:
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)


# ---------------------------------------------------------------------------------------------
# logit_bias and the vocabulary


def test_logit_bias_keys_parse_and_pairs_are_sorted() -> None:
    params = SamplingParams(logit_bias={"50": -100, "7": 100.0, 3: 0.5, "0": -0.0})
    assert params.logit_bias == ((0, 0.0), (3, 0.5), (7, 100.0), (50, -100.0))
    assert SamplingParams(logit_bias={}).logit_bias == ()
    assert SamplingParams(logit_bias=None).logit_bias == ()  # type: ignore[arg-type]
    # Normalised pairs pass through as they are (dataclasses.replace re-runs the checks).
    assert dataclasses.replace(params, temperature=0.5).logit_bias == params.logit_bias
    hash(params)
    full = SamplingParams(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES)})
    assert len(full.logit_bias) == MAX_LOGIT_BIAS_ENTRIES


VOCAB = 49152


def test_check_vocab_names_the_field_of_an_id_outside_the_vocabulary() -> None:
    SamplingParams(stop_token_ids=(0, VOCAB - 1), logit_bias={VOCAB - 1: 1}).check_vocab(VOCAB)
    for params, field in [
        (SamplingParams(stop_token_ids=(5, VOCAB)), "stop_token_ids"),
        (SamplingParams(stop_token_ids=(60000,), min_tokens=2), "stop_token_ids"),  # the reproducer
        (SamplingParams(logit_bias={"9999999999": 1}), "logit_bias"),
        (SamplingParams(logit_bias={VOCAB: -100, 1: 1}), "logit_bias"),
    ]:
        with pytest.raises(InvalidRequestError) as excinfo:
            params.check_vocab(VOCAB)
        assert excinfo.value.param == field
        assert field in excinfo.value.message and str(VOCAB) in excinfo.value.message


@pytest.mark.parametrize("ids", [[1, VOCAB], [-1], [2**70], [1.0], [True], ["5"], [None]])
def test_prompt_token_ids_outside_the_vocabulary_are_refused(ids: list) -> None:
    with pytest.raises(InvalidRequestError) as excinfo:
        check_prompt_token_ids(ids, VOCAB)
    assert excinfo.value.param == "prompt"
    assert len(excinfo.value.message) < 200  # a huge id is not echoed whole


def test_prompt_token_ids_inside_the_vocabulary_pass() -> None:
    check_prompt_token_ids([0, 1, VOCAB - 1], VOCAB)
