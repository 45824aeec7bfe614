"""The offline API takes prompts in vLLM's dialect: strings, token-id lists and prompt dicts,
mixed; a prompt of the wrong type fails at the call with a TypeError; a progress bar by default."""

from __future__ import annotations

import pytest

from llmplatform import LLM, SamplingParams
from llmplatform.offline import normalize_prompts

GREEDY = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", device="cpu", kv_cache_memory="64MiB")


def test_every_prompt_form_generates_the_same_tokens(llm: LLM):
    text = "The quick brown fox"
    ids = list(llm.tokenizer(text)["input_ids"])
    forms = [text, ids, {"prompt": text}, {"prompt_token_ids": ids}]
    outputs = llm.generate(forms, GREEDY, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert len(tokens[0]) == 4 and all(t == tokens[0] for t in tokens), tokens
    assert [o.prompt_token_ids for o in outputs] == [ids] * 4
    assert [o.prompt for o in outputs] == [text, None, text, None]
    # One prompt alone, in each form, is one request.
    for form in forms:
        (single,) = llm.generate(form, GREEDY, use_tqdm=False)
        assert single.outputs[0].token_ids == tokens[0]


@pytest.mark.parametrize("prompts, message", [
    (42, "prompts has type int"),
    ([b"bytes"], "prompt 0 has type bytes"),
    (["ok", 3.5], "prompt 1 has type float"),
    ({"prompt_token_ids": ["a", "b"]}, "'prompt_token_ids' must be a list of ints"),
    ({"prompt": 5}, "'prompt' must be a string"),
    ({"prompt": "x", "prompt_token_ids": [1]}, "exactly one of"),
    ({"prompt": "x", "multi_modal_data": {}}, "unsupported prompt keys"),
    ([[1, 2], [3, "x"]], "prompt 1 has type list"),
])
def test_a_prompt_of_the_wrong_type_fails_at_the_call(llm: LLM, prompts, message):
    with pytest.raises(TypeError, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    # Nothing was queued: the engine is idle and still serves.
    assert not llm.engine.has_unfinished()
    assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_a_wrong_sampling_params_list_fails_at_the_call(llm: LLM):
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    with pytest.raises(TypeError, match="not SamplingParams"):
        llm.generate(["a"], [{"max_tokens": 3}], use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_progress_bar_counts_prompts(llm: LLM, capsys):
    llm.generate(["a", "b", "c"], GREEDY)  # use_tqdm defaults to on
    err = capsys.readouterr().err
    assert "generating" in err and "3/3" in err


def test_normalize_prompts_shapes():
    assert normalize_prompts("a") == [("a", None)]
    assert normalize_prompts([1, 2]) == [(None, [1, 2])]
    assert normalize_prompts([[1], "b"]) == [(None, [1]), ("b", None)]
    assert normalize_prompts([]) == []


def test_priorities_reorder_the_queue_not_the_outputs(llm: LLM):
    prompts = ["The quick brown fox", "Once upon a time", "In the beginning"]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    ranked = llm.generate(prompts, GREEDY, use_tqdm=False, priority=[3, -1, 0])
    assert [o.outputs[0].token_ids for o in ranked] == plain  # still in prompt order
    for bad in ([0, 1], [0, 1, 2.5], [0, True, 1]):
        with pytest.raises(ValueError, match="one integer per prompt"):
            llm.generate(prompts, GREEDY, use_tqdm=False, priority=bad)
