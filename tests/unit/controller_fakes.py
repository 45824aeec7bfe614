"""Worker addresses, a settable clock and a scripted random source for controller unit tests."""

from __future__ import annotations

A = "http://127.0.0.1:1"
B = "http://127.0.0.1:2"
C = "http://127.0.0.1:3"


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FixedRandom:
    """Returns the given values from random(), in order; one draw too many fails the test."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def random(self) -> float:
        if not self.values:
            raise AssertionError("dispatch drew a random number where none was scripted")
        return self.values.pop(0)
