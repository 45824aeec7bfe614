"""What a request asks its output to look like: one validated, hashable spec per request.

A :class:`StructuredOutputSpec` is built once, at the edge, from whichever request field carried
the constraint (the gateway's ``openai_api.response_format`` for OpenAI's ``response_format`` and
vLLM's ``guided_*`` extras and ``structured_outputs`` object; ``openai_api.tools`` for tool
calling), travels to the worker in the params dict
(:meth:`~StructuredOutputSpec.to_wire`), and is the grammar cache's key there. Its ``source`` is
canonical text (a JSON schema is re-serialised compactly, *keeping key order*: xgrammar emits
properties in schema order), so two requests with the same constraint share one compiled grammar.

Construction does only cheap checks (types, sizes, JSON syntax, the JSON-schema meta-schema, and
the keywords the grammar engine would silently not enforce); whether a regex or an EBNF grammar
compiles is decided by the compiler (:mod:`.grammar`), which raises the same
:class:`~llmplatform.errors.InvalidRequestError` naming the same field.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from llmplatform.errors import InvalidRequestError

# A constraint's canonical text is capped: grammars are compiled per distinct text, and the gateway's
# body limit alone would let one request pin a multi-megabyte schema in every worker's cache.
MAX_SOURCE_CHARS = 128 * 1024
MAX_CHOICES = 1024

# Validation keywords xgrammar 0.2 accepts but does not enforce (a violating output would pass the
# grammar). Refusing them is the honest answer: a constraint is enforced or the request is a 400.
_UNENFORCED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
    "minContains", "maxContains", "unevaluatedItems", "$dynamicRef", "$recursiveRef",
})
# Where subschemas sit, so that a property *named* "not" is not mistaken for the keyword.
_SCHEMA_VALUED = ("additionalProperties", "items", "contains", "propertyNames",
                  "unevaluatedProperties", "additionalItems")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


class StructuredOutputKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # source: the schema as compact JSON
    JSON_OBJECT = "json_object"  # source: "" (any JSON object)
    REGEX = "regex"  # source: the pattern (xgrammar's ECMAScript-like dialect)
    CHOICE = "choice"  # source: the choices as a JSON list of strings
    GRAMMAR = "grammar"  # source: EBNF/GBNF text with a ``root`` rule
    STRUCTURAL_TAG = "structural_tag"  # source: an xgrammar structural tag as JSON (tool calls)


@dataclass(frozen=True)
class StructuredOutputSpec:
    """One request's output constraint. Equal specs compile to the same grammar (``param`` is
    only the request field to name in errors and takes no part in equality)."""

    kind: StructuredOutputKind
    source: str
    strict: bool = True  # json_schema: properties the schema does not list are refused
    param: str = field(default="response_format", compare=False)
    after: str = ""
    """A reasoning model's end-of-thoughts tag (``</think>``): the output is free text up to and
    including it, and the constraint applies to what follows (the answer). "": from the start."""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, StructuredOutputKind):
            raise InvalidRequestError(f"unknown structured output kind {self.kind!r}",
                                      param=self.param)
        if not isinstance(self.source, str):
            raise InvalidRequestError("structured output source must be a string",
                                      param=self.param)
        if not isinstance(self.after, str) or len(self.after) > 64:
            raise InvalidRequestError("structured output 'after' must be a short string",
                                      param=self.param)
        if len(self.source) > MAX_SOURCE_CHARS:
            raise InvalidRequestError(
                f"{self.param} is {len(self.source)} characters long; at most "
                f"{MAX_SOURCE_CHARS} are accepted", param=self.param)

    # ---------------------------------------------------------------- constructors, one per kind

    @classmethod
    def json_schema(cls, schema: Any, *, strict: bool | None = True,
                    param: str = "response_format") -> StructuredOutputSpec:
        """``schema``: a dict, or its JSON text (vLLM's ``guided_json`` takes both)."""
        schema = _schema_object(schema, param)
        check_json_schema(schema, param)
        return cls(StructuredOutputKind.JSON_SCHEMA, _compact_json(schema, param),
                   strict=strict is not False, param=param)

    @classmethod
    def json_object(cls, *, param: str = "response_format") -> StructuredOutputSpec:
        return cls(StructuredOutputKind.JSON_OBJECT, "", strict=False, param=param)

    @classmethod
    def regex(cls, pattern: Any, *, param: str = "guided_regex") -> StructuredOutputSpec:
        if not isinstance(pattern, str) or not pattern:
            raise InvalidRequestError(f"{param} must be a non-empty string", param=param)
        return cls(StructuredOutputKind.REGEX, pattern, param=param)

    @classmethod
    def choice(cls, choices: Any, *, param: str = "guided_choice") -> StructuredOutputSpec:
        if (not isinstance(choices, (list, tuple)) or not choices
                or not all(isinstance(c, str) for c in choices)):
            raise InvalidRequestError(f"{param} must be a non-empty list of strings", param=param)
        if len(choices) > MAX_CHOICES:
            raise InvalidRequestError(f"{param} has {len(choices)} choices; at most "
                                      f"{MAX_CHOICES} are accepted", param=param)
        return cls(StructuredOutputKind.CHOICE, json.dumps(list(choices), ensure_ascii=False),
                   param=param)

    @classmethod
    def grammar(cls, ebnf: Any, *, param: str = "guided_grammar") -> StructuredOutputSpec:
        if not isinstance(ebnf, str) or not ebnf.strip():
            raise InvalidRequestError(f"{param} must be a non-empty EBNF grammar", param=param)
        return cls(StructuredOutputKind.GRAMMAR, ebnf, param=param)

    @classmethod
    def structural_tag(cls, tag: Any, *, param: str = "tools") -> StructuredOutputSpec:
        """An xgrammar structural tag (dict or JSON text); the gateway builds one to force tool
        calls (``openai_api.tools.calls``)."""
        tag = _schema_object(tag, param)
        return cls(StructuredOutputKind.STRUCTURAL_TAG, _compact_json(tag, param), param=param)

    @property
    def choices(self) -> list[str]:
        assert self.kind is StructuredOutputKind.CHOICE
        return json.loads(self.source)

    # ---------------------------------------------------------------- the wire (worker params)

    def to_wire(self) -> dict[str, Any]:
        """The params-dict form (``params["structured_output"]``): plain JSON."""
        wire = {"type": self.kind.value, "source": self.source, "strict": self.strict,
                "param": self.param}
        if self.after:
            wire["after"] = self.after
        return wire

    def after_thoughts(self, end_tag: str) -> StructuredOutputSpec:
        """This constraint, applied only after a reasoning model's ``end_tag``."""
        return dataclasses.replace(self, after=end_tag)

    @classmethod
    def from_wire(cls, wire: Any) -> StructuredOutputSpec:
        """Parse and re-check what :meth:`to_wire` produced (a worker trusts no params dict)."""
        name = "structured_output"
        if not isinstance(wire, Mapping):
            raise InvalidRequestError(f"{name} must be an object", param=name)
        spec = cls._from_wire(wire, name)
        after = wire.get("after", "")
        return dataclasses.replace(spec, after=after) if after != "" else spec

    @classmethod
    def _from_wire(cls, wire: Mapping[str, Any], name: str) -> StructuredOutputSpec:
        param = wire.get("param", name)
        param = param if isinstance(param, str) and param else name
        try:
            kind = StructuredOutputKind(wire.get("type"))
        except ValueError:
            raise InvalidRequestError(f"{name}.type {wire.get('type')!r} is not one of "
                                      f"{[k.value for k in StructuredOutputKind]}",
                                      param=param) from None
        source = wire.get("source", "")
        strict = wire.get("strict", True)
        if not isinstance(strict, bool):
            raise InvalidRequestError(f"{name}.strict must be a boolean", param=param)
        if kind is StructuredOutputKind.JSON_SCHEMA:
            return cls.json_schema(source, strict=strict, param=param)
        if kind is StructuredOutputKind.JSON_OBJECT:
            return cls.json_object(param=param)
        if kind is StructuredOutputKind.REGEX:
            return cls.regex(source, param=param)
        if kind is StructuredOutputKind.CHOICE:
            try:
                choices = json.loads(source) if isinstance(source, str) else None
            except ValueError:
                choices = None
            return cls.choice(choices, param=param)
        if kind is StructuredOutputKind.GRAMMAR:
            return cls.grammar(source, param=param)
        return cls.structural_tag(source, param=param)


# -------------------------------------------------------------------- JSON schema checks

def check_json_schema(schema: Mapping[str, Any], param: str) -> None:
    """Refuse a schema that is not a valid JSON schema, or that uses a keyword the grammar would
    accept without enforcing; the message names where in the schema."""
    from jsonschema import exceptions, validators

    validator = validators.validator_for(schema, default=validators.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except exceptions.SchemaError as e:
        where = "#/" + "/".join(str(p) for p in e.path)
        raise InvalidRequestError(f"{param}: invalid JSON schema at {where}: {e.message}",
                                  param=param) from None
    _check_keywords(schema, "#", param)


def _check_keywords(schema: Any, where: str, param: str) -> None:
    if not isinstance(schema, Mapping):
        return  # booleans are schemas too; anything else the meta-schema already refused
    for keyword in schema:
        if keyword in _UNENFORCED_KEYWORDS:
            raise InvalidRequestError(
                f"{param}: JSON schema keyword {keyword!r} at {where} is not supported "
                "(it could not be enforced)", param=param)
    if schema.get("uniqueItems") is True:
        raise InvalidRequestError(
            f"{param}: JSON schema keyword 'uniqueItems' at {where} is not supported "
            "(it could not be enforced)", param=param)
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise InvalidRequestError(
            f"{param}: 'allOf' with more than one subschema at {where} is not supported "
            "(it could not be enforced)", param=param)
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise InvalidRequestError(f"{param}: only local $ref ('#/...') is supported; got "
                                  f"{ref!r} at {where}", param=param)
    for key in _SCHEMA_VALUED:
        if isinstance(schema.get(key), Mapping):
            _check_keywords(schema[key], f"{where}/{key}", param)
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                _check_keywords(sub, f"{where}/{key}/{i}", param)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), Mapping):
            for name, sub in schema[key].items():
                _check_keywords(sub, f"{where}/{key}/{name}", param)


def _schema_object(value: Any, param: str) -> dict[str, Any]:
    if isinstance(value, str):
        if len(value) > MAX_SOURCE_CHARS:
            raise InvalidRequestError(f"{param} is {len(value)} characters long; at most "
                                      f"{MAX_SOURCE_CHARS} are accepted", param=param)
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidRequestError(f"{param} is not valid JSON: {e}", param=param) from None
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"{param} must be a JSON object", param=param)
    return dict(value)


def _compact_json(value: Any, param: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"{param} is not JSON-serialisable: {e}", param=param) from None


__all__ = [
    "MAX_SOURCE_CHARS", "StructuredOutputKind", "StructuredOutputSpec", "check_json_schema",
]
