"""How many tokens a request may generate within the model's context, by OpenAI's rules.

Shared by the gateway (for stock FastChat workers, where it counts the prompt itself) and the
worker (which sizes requests that carry ``openai_max_tokens``, with no extra round trip).
"""

from __future__ import annotations

from llmplatform.errors import ContextLengthExceededError


def resolve_max_new_tokens(
    requested: int | None,
    *,
    prompt_tokens: int,
    context_length: int,
    default: int | None,
    prompt_param: str,
) -> int:
    """How many tokens the worker may generate; ContextLengthExceededError if none fit.

    `requested` None takes `default`, clamped to the room left; a `default` of None means "all
    the room left" (chat). An explicit request that does not fit is an error, as in OpenAI's API.
    """
    room = context_length - prompt_tokens
    what = "messages" if prompt_param == "messages" else "prompt"
    if requested is None:
        if room < 1:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {context_length} tokens. However, your "
                f"{what} resulted in {prompt_tokens} tokens. Please reduce the length of the {what}.",
                param=prompt_param,
            )
        return room if default is None else min(default, room)
    if prompt_tokens + requested > context_length:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {context_length} tokens. However, you "
            f"requested {prompt_tokens + requested} tokens ({prompt_tokens} in the {what}, "
            f"{requested} in the completion). Please reduce the length of the {what} or completion.",
            param=prompt_param,
        )
    return requested
