"""OpenAI function tools at the gateway: the request's tools and ``tool_choice``
(:mod:`.calls`), the grammar that forces a call in the model's syntax (:mod:`.calls`), and the
parsers that read calls out of the generated text (:mod:`.parsers`).

Only the gateway reads tool calls: workers render tools into the prompt with their chat template
(``llm.tool_support``) and stream text; the syntax names the two agree on are
``protocol.tool_calls``.
"""
