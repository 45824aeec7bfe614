"""A set of API keys checked in constant time: the gateway's keys and admin keys, and the web
UI's Cluster tab (which opens with the gateway's admin keys).

Keys are compared as SHA-256 digests with `hmac.compare_digest`, against every configured key
without stopping at a match: the time taken says nothing about which key matched or how much of
one (vLLM's timing-leak advisory). The set holds no key in the clear.
"""

from __future__ import annotations

import hashlib
import hmac


def key_digest(value: str) -> bytes:
    """A key as it is compared and looked up: its SHA-256 digest."""
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


class KeySet:
    """Digests of the configured keys; `matches` compares a presented key with all of them."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._digests = tuple(key_digest(key) for key in keys)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def matches(self, token: str) -> bool:
        presented = key_digest(token)
        matched = False
        for key in self._digests:
            matched |= hmac.compare_digest(presented, key)
        return matched
