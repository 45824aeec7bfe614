"""FastChat conversation rendering: our renderer against fschat 0.2.36's own get_prompt()."""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest

from llmplatform.conversation import ConvTemplate, SeparatorStyle, render_chat_prompt
from llmplatform.errors import InvalidRequestError

CHATML_CONV = {
    "name": "chatml",
    "system_template": "<|im_start|>system\n{system_message}",
    "system_message": "You are a helpful assistant.",
    "roles": ["<|im_start|>user", "<|im_start|>assistant"],
    "messages": [],
    "offset": 0,
    "sep_style": 9,
    "sep": "<|im_end|>",
    "sep2": None,
    "stop_str": "<|im_end|>",
    "stop_token_ids": [32000, 32001],
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Line one\n\nline two\r\nthree"},
    ],
    # Empty assistant content renders like the open slot in FastChat; keep that quirk.
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "b"}],
]


def test_chatml_by_hand() -> None:
    prompt = render_chat_prompt(CHATML_CONV, [{"role": "user", "content": "Hi"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_system_message_replaces_the_templates() -> None:
    prompt = render_chat_prompt(
        CHATML_CONV, [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    )
    assert prompt.startswith("<|im_start|>system\nS<|im_end|>\n")


def test_stop_strings_and_ids() -> None:
    conv = ConvTemplate.from_dict(CHATML_CONV)
    assert conv.stop_strings == ["<|im_end|>"]
    assert conv.stop_token_ids == (32000, 32001)
    assert ConvTemplate.from_dict({**CHATML_CONV, "stop_str": ["a", "b"]}).stop_strings == ["a", "b"]
    assert ConvTemplate.from_dict({**CHATML_CONV, "stop_str": None}).stop_strings == []


def test_unknown_style_is_a_request_error() -> None:
    with pytest.raises(InvalidRequestError):
        ConvTemplate.from_dict({**CHATML_CONV, "sep_style": 99})
    with pytest.raises(InvalidRequestError):
        ConvTemplate.from_dict({k: v for k, v in CHATML_CONV.items() if k != "sep_style"})


def test_unknown_role_is_a_request_error() -> None:
    with pytest.raises(InvalidRequestError) as info:
        render_chat_prompt(CHATML_CONV, [{"role": "tool", "content": "x"}])
    assert info.value.param == "messages[0].role"


def _fastchat_templates() -> list[str]:
    fc = importlib.import_module("fastchat.conversation")
    return sorted(name for name, conv in fc.conv_templates.items() if conv.sep_style is not None)


def _wire_dict(conv: object) -> dict:
    """What a stock worker's /worker_get_conv_template sends: the dataclass through JSON."""
    return json.loads(json.dumps(dataclasses.asdict(conv)))


def test_enum_values_match_fastchat() -> None:
    fc = importlib.import_module("fastchat.conversation")
    assert {s.name: s.value for s in fc.SeparatorStyle} == {s.name: s.value for s in SeparatorStyle}


def test_matches_fastchat_for_every_template() -> None:
    fc = importlib.import_module("fastchat.conversation")
    names = _fastchat_templates()
    assert len(names) > 50
    for name in names:
        for messages in CONVERSATIONS:
            expected_conv = fc.get_conv_template(name)
            for message in messages:
                if message["role"] == "system":
                    expected_conv.set_system_message(message["content"])
                elif message["role"] == "user":
                    expected_conv.append_message(expected_conv.roles[0], message["content"])
                else:
                    expected_conv.append_message(expected_conv.roles[1], message["content"])
            expected_conv.append_message(expected_conv.roles[1], None)
            expected = expected_conv.get_prompt()
            got = render_chat_prompt(_wire_dict(fc.get_conv_template(name)), messages)
            assert got == expected, (name, messages)
