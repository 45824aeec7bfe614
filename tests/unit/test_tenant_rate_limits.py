"""TenantLimiter with a pinned clock: exact admissions, refusals, retry times and header values."""

from __future__ import annotations

import pytest

from llmplatform.openai_api.rate_limits import TenantLimiter, TokenBucket, openai_duration, ratelimit_headers
from llmplatform.openai_api.settings import TenantLimits


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_requests_in_flight_are_counted_per_tenant_and_given_back() -> None:
    limiter = TenantLimiter(TenantLimits(max_concurrent_requests=2), clock=Clock())
    assert [limiter.admit("a").refused for _ in range(3)] == [None, None, "concurrency"]
    assert limiter.admit("b").refused is None
    limiter.release("a")
    assert limiter.admit("a").refused is None and limiter.num_in_flight("a") == 2
    for _ in range(2):
        limiter.release("a")
    assert limiter.num_in_flight("a") == 0
    # Nothing per minute to remember: no buckets kept at all.
    assert limiter.num_tenants_tracked == 0


def test_batch_lines_count_per_minute_but_not_in_flight() -> None:
    # A batch line (concurrent=False) is its owner's usage, but neither takes nor needs one of the
    # owner's in-flight places: the batch runner bounds its own lines, and a batch must not crowd
    # its owner's interactive requests out.
    limiter = TenantLimiter(TenantLimits(max_concurrent_requests=1, max_requests_per_minute=3),
                            clock=Clock())
    assert limiter.admit("a").refused is None
    assert [limiter.admit("a", concurrent=False).refused for _ in range(3)] == [None, None, "requests"]
    assert limiter.num_in_flight("a") == 1
    limiter.release("a", concurrent=False)
    limiter.release("a")
    assert limiter.num_in_flight("a") == 0


def test_requests_per_minute_refill_continuously() -> None:
    clock = Clock()
    limiter = TenantLimiter(TenantLimits(max_concurrent_requests=None, max_requests_per_minute=3), clock=clock)
    windows = [limiter.admit("a").requests for _ in range(3)]
    assert [w.remaining for w in windows] == [2, 1, 0]
    assert windows[-1].reset_s == pytest.approx(60.0)
    refused = limiter.admit("a")
    assert refused.refused == "requests" and refused.retry_after_s == pytest.approx(20.0)
    clock.now += 19.9
    assert limiter.admit("a").refused == "requests"
    clock.now += 0.1
    assert limiter.admit("a").refused is None  # one refilled every 20 s
    clock.now += 600
    assert limiter.admit("a").requests.remaining == 2  # refilled to the limit, not past it


def test_tokens_are_charged_after_the_fact_and_a_debt_is_waited_out() -> None:
    clock = Clock()
    limiter = TenantLimiter(TenantLimits(max_concurrent_requests=None, max_tokens_per_minute=600), clock=clock)
    assert limiter.admit("a").tokens.remaining == 600
    limiter.charge("a", 900)  # one large request: 300 below zero
    refused = limiter.admit("a")
    assert refused.refused == "tokens" and refused.tokens.remaining == 0
    assert refused.retry_after_s == pytest.approx(30.1)  # 10 tokens/s: 30 s of debt, then one
    clock.now += 30.0
    assert limiter.admit("a").refused == "tokens"  # exactly zero: nothing to spend
    clock.now += 0.1
    assert limiter.admit("a").refused is None
    limiter.charge("b", 0)  # nothing used: nothing tracked
    assert limiter.admit("b").tokens.remaining == 600


def test_a_refusal_takes_nothing() -> None:
    limits = TenantLimits(max_concurrent_requests=1, max_requests_per_minute=5)
    limiter = TenantLimiter(limits, clock=Clock())
    assert limiter.admit("a").requests.remaining == 4
    assert limiter.admit("a").refused == "concurrency"
    limiter.release("a")
    assert limiter.admit("a").requests.remaining == 3  # the refused one cost no request


def test_the_table_of_buckets_is_bounded() -> None:
    clock = Clock()
    limiter = TenantLimiter(TenantLimits(max_concurrent_requests=None, max_requests_per_minute=1),
                            clock=clock, max_tenants=4)
    for n in range(10):
        assert limiter.admit(f"addr:{n}").refused is None
        assert limiter.num_tenants_tracked <= 4
    clock.now += 60  # every bucket full again: all can go
    limiter.admit("addr:new")
    assert limiter.num_tenants_tracked == 1


def test_a_full_table_is_not_scanned_for_every_new_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    """New tenants (addresses) arriving at a full table cost a few bucket refills each, not a
    scan of the table each: the scan runs on the event loop."""
    limiter = TenantLimiter(TenantLimits(max_concurrent_requests=None, max_requests_per_minute=1),
                            clock=Clock(), max_tenants=64)
    for n in range(64):
        limiter.admit(f"addr:{n}")
    refills = 0
    refill = TokenBucket.refill

    def counting(bucket: TokenBucket, now: float) -> None:
        nonlocal refills
        refills += 1
        refill(bucket, now)

    monkeypatch.setattr(TokenBucket, "refill", counting)
    for n in range(64, 128):
        assert limiter.admit(f"addr:{n}").refused is None
    assert limiter.num_tenants_tracked == 64
    # Each new tenant's own refill, and 4 scans of 64 (once per 16 added), not 64 scans.
    assert refills == 64 + 4 * 64


def test_headers_are_openais() -> None:
    limits = TenantLimits(max_concurrent_requests=None, max_requests_per_minute=60, max_tokens_per_minute=1000)
    decision = TenantLimiter(limits, clock=Clock()).admit("a")
    assert dict(ratelimit_headers(decision)) == {
        b"x-ratelimit-limit-requests": b"60", b"x-ratelimit-remaining-requests": b"59",
        b"x-ratelimit-reset-requests": b"1s",
        b"x-ratelimit-limit-tokens": b"1000", b"x-ratelimit-remaining-tokens": b"1000",
        b"x-ratelimit-reset-tokens": b"0s"}
    assert [openai_duration(s) for s in (0.0204, 1.5, 360, 90.25)] == ["21ms", "1.5s", "6m0s", "1m30.25s"]
    assert ratelimit_headers(TenantLimiter(TenantLimits(), clock=Clock()).admit("a")) == []


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_limits_are_checked_at_construction(bad: object) -> None:
    with pytest.raises(ValueError):
        TenantLimits(max_requests_per_minute=bad)  # type: ignore[arg-type]
