"""The tests' one polling helper (tests/polling.py) fails loudly: a wait that times out raises an
AssertionError naming what was awaited, the timeout, the last value and the last error."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.polling import WaitTimeout, wait_until, wait_until_async


def test_returns_the_first_truthy_value() -> None:
    values = iter([None, 0, [], {"ready": True}])
    assert wait_until(lambda: next(values), what="ready", interval_s=0) == {"ready": True}


def test_a_timeout_is_an_assertion_error_naming_what_and_the_last_value() -> None:
    counter = itertools.count()
    with pytest.raises(AssertionError) as info:
        wait_until(lambda: next(counter) < 0, what="the impossible", timeout_s=0.2, interval_s=0.01)
    assert isinstance(info.value, WaitTimeout)
    message = str(info.value)
    assert "the impossible" in message and "0.2 s" in message and "last value: False" in message
    assert next(counter) >= 2  # polled more than once, and once more after the deadline


def test_listed_exceptions_are_retried_and_the_last_one_reported() -> None:
    calls = itertools.count()

    def starting() -> str:
        if next(calls) < 3:
            raise ConnectionError("refused")
        return "up"

    assert wait_until(starting, what="up", retry_on=(ConnectionError,), interval_s=0) == "up"

    def down() -> bool:
        raise ConnectionError("never")

    with pytest.raises(WaitTimeout, match=r"last error: ConnectionError\('never'\)") as info:
        wait_until(down, what="a service", retry_on=(ConnectionError,), timeout_s=0.1, interval_s=0.01)
    assert isinstance(info.value.__cause__, ConnectionError)


def test_other_exceptions_end_the_wait_at_once() -> None:
    def broken() -> bool:
        raise KeyError("status")

    with pytest.raises(KeyError):
        wait_until(broken, what="anything", retry_on=(ConnectionError,), timeout_s=30)


def test_context_is_added_to_the_failure_only() -> None:
    seen: list[str] = []

    def context() -> str:
        seen.append("asked")
        return "--- the service's log ---"

    assert wait_until(lambda: True, what="x", context=context)
    assert seen == []
    with pytest.raises(WaitTimeout, match="the service's log"):
        wait_until(lambda: False, what="x", timeout_s=0.05, interval_s=0.01, context=context)
    assert seen == ["asked"]


def test_async_wait_awaits_coroutine_predicates() -> None:
    async def main() -> None:
        state = {"n": 0}

        async def grows() -> int:
            state["n"] += 1
            return state["n"] if state["n"] >= 3 else 0

        assert await wait_until_async(grows, what="three", interval_s=0) == 3
        with pytest.raises(WaitTimeout, match="never ready.*last value: 0"):
            await wait_until_async(lambda: 0, what="never ready", timeout_s=0.05, interval_s=0.01)

    asyncio.run(main())
