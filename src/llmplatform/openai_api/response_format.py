"""The request fields that ask for structured output, turned into one spec at the gateway.

OpenAI's ``response_format`` and vLLM's ``guided_*`` extras and ``structured_outputs`` object
each become a :class:`~llmplatform.sampling.structured_output.StructuredOutputSpec` (at most one
per request), which travels to the worker in the params dict. Only the gateway reads these fields;
the spec itself is shared with the workers, which compile it (``sampling``).
"""

from __future__ import annotations

from typing import Any, Mapping

from llmplatform.errors import InvalidRequestError
from llmplatform.sampling.structured_output import StructuredOutputSpec

# vLLM ``structured_outputs`` members that only loosen or tune generation; honoured by design.
_STRUCTURED_OUTPUTS_HINTS = frozenset({"disable_fallback", "disable_any_whitespace",
                                       "disable_additional_properties", "whitespace_pattern"})


def spec_from_response_format(response_format: Any) -> StructuredOutputSpec | None:
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object``, ``json_schema``."""
    param = "response_format"
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise InvalidRequestError("response_format must be an object", param=param)
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec.json_object(param=param)
    if kind == "json_schema":
        body = response_format.get("json_schema")
        if not isinstance(body, Mapping) or body.get("schema") is None:
            raise InvalidRequestError(
                "response_format of type json_schema needs json_schema.schema", param=param)
        strict = body.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError("response_format.json_schema.strict must be a boolean",
                                      param=param)
        return StructuredOutputSpec.json_schema(body["schema"], strict=strict, param=param)
    raise InvalidRequestError(
        f"response_format.type {kind!r} is not one of 'text', 'json_object', 'json_schema'",
        param=param)


def spec_from_request(*, response_format: Any = None, guided_json: Any = None,
                      guided_regex: Any = None, guided_choice: Any = None,
                      guided_grammar: Any = None, structured_outputs: Any = None
                      ) -> StructuredOutputSpec | None:
    """The one constraint a request asks for, from OpenAI's and vLLM's fields; two at once is a
    400 naming the second (there is no sensible intersection of, say, a schema and a regex)."""
    found: list[StructuredOutputSpec] = []
    if (spec := spec_from_response_format(response_format)) is not None:
        found.append(spec)
    if guided_json is not None:
        found.append(StructuredOutputSpec.json_schema(guided_json, param="guided_json"))
    if guided_regex is not None:
        found.append(StructuredOutputSpec.regex(guided_regex, param="guided_regex"))
    if guided_choice is not None:
        found.append(StructuredOutputSpec.choice(guided_choice, param="guided_choice"))
    if guided_grammar is not None:
        found.append(StructuredOutputSpec.grammar(guided_grammar, param="guided_grammar"))
    if structured_outputs is not None:
        found.extend(_specs_from_structured_outputs(structured_outputs))
    if len(found) > 1:
        raise InvalidRequestError(
            f"only one output constraint may be given; got {found[0].param} and "
            f"{found[1].param}", param=found[1].param)
    return found[0] if found else None


def _specs_from_structured_outputs(body: Any) -> list[StructuredOutputSpec]:
    """vLLM's newer ``structured_outputs`` object: json | regex | choice | grammar | json_object."""
    name = "structured_outputs"
    if not isinstance(body, Mapping):
        raise InvalidRequestError(f"{name} must be an object", param=name)
    specs = []
    for key, value in body.items():
        if value is None or key in _STRUCTURED_OUTPUTS_HINTS:
            continue
        param = f"{name}.{key}"
        if key == "json":
            specs.append(StructuredOutputSpec.json_schema(value, param=param))
        elif key == "regex":
            specs.append(StructuredOutputSpec.regex(value, param=param))
        elif key == "choice":
            specs.append(StructuredOutputSpec.choice(value, param=param))
        elif key == "grammar":
            specs.append(StructuredOutputSpec.grammar(value, param=param))
        elif key == "json_object":
            if value is not True and value is not False:
                raise InvalidRequestError(f"{param} must be a boolean", param=param)
            if value:
                specs.append(StructuredOutputSpec.json_object(param=param))
        else:
            raise InvalidRequestError(f"{param} is not supported", param=param)
    return specs
