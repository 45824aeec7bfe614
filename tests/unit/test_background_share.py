"""engine.background: the background requests' share of a step, found from step durations, on
synthetic machines (a step's duration a function of its tokens): no real timings."""

from __future__ import annotations

import statistics

import pytest

from llmplatform.engine.background import PROBE_EVERY, BackgroundShare, size_class


def run(share: BackgroundShare, cost, foreground_tokens: int, steps: int = 400) -> list[tuple[int, float]]:
    """Busy steps of ``foreground_tokens`` on a machine whose step of n tokens takes ``cost(n)``
    seconds: each step's background tokens and its duration over the same step without them."""
    seen = []
    for _ in range(steps):
        background = share.tokens(True, foreground_tokens)
        seconds = cost(foreground_tokens + background)
        share.observe(foreground_tokens, background, True, seconds)
        seen.append((background, seconds / cost(foreground_tokens)))
    return seen


def test_on_a_machine_where_rows_cost_arithmetic_the_share_keeps_the_slowdown():
    # A small CPU: 20 ms to read the weights, 1 ms a token. Four interactive decodes take 24 ms;
    # 20% more allows 4.8 tokens of background work.
    share = BackgroundShare(slowdown=0.2, max_step_tokens=256)
    seen = run(share, lambda n: 0.020 + 0.001 * n, 4)[100:]
    given = [b for b, _ in seen if b]
    assert 2 <= statistics.mean(given) <= 5
    assert statistics.mean(r for _, r in seen) <= 1.2
    assert max(r for _, r in seen) <= 1.2 + 0.002 / 0.024 + 1e-9  # one token past, at worst
    # One busy step in PROBE_EVERY gives nothing (the reference stays measured).
    assert sum(1 for b, _ in seen if b == 0) == pytest.approx(len(seen) / PROBE_EVERY, abs=2)


def test_on_a_machine_where_rows_are_nearly_free_the_share_grows_to_its_limit():
    # A GPU-like step: the weights' reading is all, rows cost 10 microseconds each.
    share = BackgroundShare(slowdown=0.2, max_step_tokens=64)
    seen = run(share, lambda n: 0.010 + 0.00001 * n, 4, steps=200)
    assert max(b for b, _ in seen) == 64 and seen[-1][0] in (0, 64)


def test_a_slower_step_halves_the_share_and_the_first_steps_measure_the_reference():
    share = BackgroundShare(slowdown=0.2, max_step_tokens=256)
    assert share.tokens(True, 3) == 0  # no reference for 3 foreground tokens yet: measure it
    share.observe(3, 0, True, 0.030)
    assert share.tokens(True, 3) == 1
    for _ in range(5):
        share.observe(3, share.tokens(True, 3), True, 0.031)
    grown = share.allowance
    assert grown > 1
    share.observe(3, int(grown), True, 0.050)  # much slower than the reference
    assert share.allowance == max(1.0, grown / 2)


def test_without_foreground_work_the_step_limit_applies_and_nothing_is_learnt():
    share = BackgroundShare(slowdown=0.2, max_step_tokens=100)
    assert share.tokens(False, 0) == 100
    share.observe(0, 100, False, 5.0)
    assert share.tokens(True, 2) == 0 and share.allowance == 1.0


def test_no_slowdown_allowed_means_no_background_work_beside_the_foreground():
    share = BackgroundShare(slowdown=0.0, max_step_tokens=100)
    share.observe(2, 0, True, 0.02)
    assert [share.tokens(True, 2) for _ in range(3)] == [0, 0, 0]
    assert share.tokens(False, 0) == 100


def test_size_classes_are_exact_for_decode_sized_steps_and_coarse_above():
    assert [size_class(n) for n in (1, 4, 16, 17, 32, 33, 200)] == [1, 4, 16, 32, 32, 64, 256]
    with pytest.raises(ValueError):
        BackgroundShare(slowdown=-0.1, max_step_tokens=10)


def test_for_a_grace_period_after_foreground_work_the_busy_share_applies():
    now = [100.0]
    share = BackgroundShare(slowdown=0.2, max_step_tokens=100, grace_s=1.0, clock=lambda: now[0])
    share.fix(3)
    assert share.busy(True) and share.tokens(True, 0) == 3
    now[0] += 0.5  # the last foreground request finished; its user is likely to send another
    assert share.busy(False) and share.tokens(share.busy(False), 0) == 3
    now[0] += 0.6  # gone quiet: background work takes big steps again
    assert not share.busy(False) and share.tokens(False, 0) == 100
    assert share.busy(True)  # and a new foreground request brings the share back at once


def test_a_grace_step_without_foreground_tokens_gets_what_one_decode_would_allow():
    now = [0.0]
    share = BackgroundShare(slowdown=0.2, max_step_tokens=100, grace_s=1.0, clock=lambda: now[0])
    assert share.tokens(True, 0) == 0  # no reference for one foreground token yet
    share.observe(1, 0, True, 0.02)
    assert share.tokens(True, 0) == 1
    share.observe(0, 1, True, 5.0)  # a grace step teaches nothing (no foreground to compare)
    assert share.allowance == 1.0
