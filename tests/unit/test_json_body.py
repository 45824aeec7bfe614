"""The one JSON body parser every service uses (utils/json_body.py): what it refuses, read whole
or read then validated, and the field it names. Each service's envelope around it is tested at
its edge (test_gateway_bad_body.py, test_worker_protocol.py, test_controller_http.py)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict

from llmplatform.errors import InvalidRequestError
from llmplatform.utils.json_body import parse_json_body, read_json_body, validate_body


class Item(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    sizes: list[int] = []


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    items: list[Item] = []


UNREADABLE = [
    b"",
    b"  \n",
    b"{not json",
    b'{"model": "m"',
    b'{"model": "\\ud800"}',  # a lone surrogate escape: no UTF-8 text can hold it
    b'{"model": "caf\xe9"}',  # latin-1, not UTF-8
    b'{"model": "m", "items": ' + b"[" * 1000 + b"]" * 1000 + b"}",
]


@pytest.mark.parametrize("raw", UNREADABLE)
def test_what_cannot_be_read_is_refused_both_ways(raw: bytes) -> None:
    """A service that reads the body whole (the controller relaying params) refuses what one
    that validates it in one pass refuses: one parser, one JSON."""
    with pytest.raises(InvalidRequestError) as parsed:
        parse_json_body(Body, raw)
    with pytest.raises(InvalidRequestError) as read:
        read_json_body(raw)
    assert parsed.value.http_status == read.value.http_status == 400
    assert parsed.value.param is None and read.value.param is None


@pytest.mark.parametrize(("raw", "param", "message"), [
    (b"[1, 2]", None, "must be a JSON object"),
    (b"null", None, "must be a JSON object"),
    (b'{"items": []}', "model", "Missing required parameter: \'model\'"),
    (b'{"model": 5}', "model", "Invalid value for \'model\'"),
    (b'{"model": "m", "items": [{"name": "a", "sizes": [1, "2"]}]}', "items[0].sizes[1]",
     "Invalid value for \'items[0].sizes[1]\'"),
])
def test_a_bad_field_is_named_the_same_way_both_ways(raw: bytes, param: str | None,
                                                     message: str) -> None:
    with pytest.raises(InvalidRequestError) as parsed:
        parse_json_body(Body, raw)
    with pytest.raises(InvalidRequestError) as validated:
        validate_body(Body, read_json_body(raw))
    for error in (parsed.value, validated.value):
        assert error.param == param and message in error.message


def test_a_good_body_reads_the_same_both_ways() -> None:
    raw = b'{"model": "m", "items": [{"name": "a", "sizes": [1, 2]}], "extra": {"x": [1.5]}}'
    body = parse_json_body(Body, raw)
    assert body == validate_body(Body, read_json_body(raw))
    assert body.items[0].sizes == [1, 2]
    assert read_json_body(raw)["extra"] == {"x": [1.5]}  # passed on whole, unknown fields kept
