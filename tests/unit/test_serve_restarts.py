"""serve's restart decisions (`serve/restarts.py`), exactly, on a clock the test moves: restarts
with a doubling backoff, a worker in a crash loop left down and retried later, a failed retry
left down again twice as long, a retry that held judged afresh, and the controller's or the
gateway's crash loop fatal. Plus the controller's down list (`controller/down_workers.py`)."""

from __future__ import annotations

import pytest

from llmplatform.controller.down_workers import DownWorkers
from llmplatform.protocol.controller import WorkerStateReport
from llmplatform.serve.restarts import RestartHistory, RestartPolicy, Verdict

POLICY = RestartPolicy(max_restarts_per_minute=2, initial_backoff_s=1.0, max_backoff_s=3.0,
                       down_retry_s=10.0, max_down_retry_s=25.0, window_s=60.0)


def run(history: RestartHistory, exits: list[float]) -> list[tuple[Verdict, float, int]]:
    """Each exit at its time, the service started again at once after each (the delay is the
    supervisor's to wait; what matters here is when it exits)."""
    decisions = []
    for at in exits:
        decision = history.exited(at, "exit code 1")
        decisions.append((decision.verdict, decision.delay_s, decision.number))
        history.started(at + decision.delay_s)
    return decisions


def test_a_worker_in_a_crash_loop_is_left_down_and_retried_with_a_growing_delay() -> None:
    history = RestartHistory(POLICY, degradable=True)
    history.started(0.0)
    assert run(history, [1.0, 3.0, 6.0, 20.0, 45.0, 90.0]) == [
        (Verdict.RESTART, 1.0, 1),
        (Verdict.RESTART, 2.0, 2),
        (Verdict.DOWN, 10.0, 1),    # the 3rd exit within 60 s with 2 restarts allowed
        (Verdict.DOWN, 20.0, 2),    # its retry (started at 16) exits 4 s later: down again
        (Verdict.DOWN, 25.0, 3),    # capped
        (Verdict.DOWN, 25.0, 4),
    ]


def test_a_retry_that_holds_for_the_window_starts_afresh() -> None:
    history = RestartHistory(POLICY, degradable=True)
    history.started(0.0)
    run(history, [1.0, 2.0, 3.0])
    assert history.times_down == 1
    history.started(13.0)                     # the retry
    decision = history.exited(13.0 + 61.0, "killed by SIGKILL")
    assert (decision.verdict, decision.delay_s, decision.number) == (Verdict.RESTART, 1.0, 1)
    assert history.times_down == 0


def test_the_reason_says_how_and_how_often() -> None:
    history = RestartHistory(RestartPolicy(max_restarts_per_minute=0), degradable=True)
    history.started(0.0)
    decision = history.exited(5.0, "killed by SIGKILL")
    assert decision.verdict is Verdict.DOWN
    assert decision.reason == ("exited unexpectedly (killed by SIGKILL) 1 times within 60 s "
                               "(restarts allowed: 0, --max-restarts-per-minute)")
    history.started(65.0)
    assert history.exited(67.0, "exit code 3").reason == "exited again (exit code 3) 2 s after being retried"


def test_the_controller_or_the_gateway_in_a_crash_loop_is_fatal() -> None:
    history = RestartHistory(POLICY, degradable=False)
    history.started(0.0)
    assert [v for v, _, _ in run(history, [1.0, 2.0, 3.0])] == [
        Verdict.RESTART, Verdict.RESTART, Verdict.FATAL]


def test_exits_older_than_the_window_are_forgotten() -> None:
    history = RestartHistory(POLICY, degradable=True)
    history.started(0.0)
    assert [v for v, _, _ in run(history, [1.0, 2.0, 70.0, 130.0])] == [Verdict.RESTART] * 4


def test_bad_policies_are_refused() -> None:
    with pytest.raises(ValueError):
        RestartPolicy(down_retry_s=0)
    with pytest.raises(ValueError):
        RestartPolicy(max_restarts_per_minute=-1)


def test_the_down_list_keeps_models_and_drops_workers_that_are_live_again() -> None:
    now = [100.0]
    down = DownWorkers(lambda: now[0])
    report = WorkerStateReport(worker_name="http://w:1", service="worker 1", down=True,
                               reason="exited 3 times", retry_in_s=30.0)
    down.mark_down("http://w:1", report, ("tiny",))
    now[0] = 110.0
    down.mark_down("http://w:1", report.model_copy(update={"reason": "exited again"}), ())
    now[0] = 115.0
    [listed] = down.listed(live=set())
    assert (listed.model_names, listed.reason, listed.down_for_s, listed.retry_in_s) == (
        ["tiny"], "exited again", 15.0, 25.0)
    assert down.listed(live={"http://w:1"}) == [] and down.listed(live=set()) == []
    down.mark_down("http://w:1", report, ())
    assert down.mark_up("http://w:1") and not down.mark_up("http://w:1")
