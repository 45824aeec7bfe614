"""Chat history as Gradio hands it over, and what of it reaches the model."""

from __future__ import annotations

from llmplatform.webui.messages import (
    drop_last_answer,
    error_message,
    last_exchange,
    normalize_history,
    text_of,
    to_openai_messages,
)

GRADIO_HISTORY = [  # Chatbot.preprocess output in Gradio 6: content is a list of parts
    {"role": "user", "metadata": None, "content": [{"text": "Hi", "type": "text"}],
     "options": None},
    {"role": "assistant", "metadata": None, "content": [{"text": "Hello", "type": "text"}]},
]


def test_text_of_every_content_shape():
    assert text_of("x") == "x"
    assert text_of(None) == ""
    assert text_of({"type": "text", "text": "y"}) == "y"
    assert text_of([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "ab"


def test_normalize_makes_fresh_plain_messages():
    normalized = normalize_history(GRADIO_HISTORY)
    assert normalized == [{"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello"}]
    normalized[0]["content"] = "changed"
    assert GRADIO_HISTORY[0]["content"][0]["text"] == "Hi"
    assert normalize_history(None) == []


def test_openai_messages_skip_errors_and_empty_answers():
    history = normalize_history(GRADIO_HISTORY) + [
        {"role": "user", "content": "Again"}, error_message("model is gone"),
        {"role": "user", "content": "Once more"}, {"role": "assistant", "content": ""},
        {"role": "user", "content": "Last"}]
    assert to_openai_messages("  Be brief. ", history) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Again"}, {"role": "user", "content": "Once more"},
        {"role": "user", "content": "Last"}]
    assert to_openai_messages("   ", history[:1])[0] == {"role": "user", "content": "Hi"}


def test_drop_last_answer_keeps_the_question():
    history = GRADIO_HISTORY + [{"role": "user", "content": "Q"},
                                {"role": "assistant", "content": "A"}, error_message("boom")]
    assert drop_last_answer(history)[-1] == {"role": "user", "content": "Q"}
    assert len(drop_last_answer(history)) == 3
    assert drop_last_answer([]) == []


def test_last_exchange_is_what_a_vote_records():
    assert last_exchange([{"role": "user", "content": "Q"}]) is None
    assert last_exchange(GRADIO_HISTORY) == ("Hi", "Hello")
    partial_then_error = [{"role": "user", "content": "Q"},
                          {"role": "assistant", "content": "half"}, error_message("boom")]
    prompt, answer = last_exchange(partial_then_error)
    assert prompt == "Q" and answer.startswith("half\n\n") and "boom" in answer
