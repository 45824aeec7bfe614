"""Request priority in the scheduler's queues (engine.scheduler).

A request's ``priority`` (vLLM's field: an integer, lower runs first, default 0) is copied to each
of its sequences (``Sequence.priority``). The scheduler keeps both of its queues in priority order,
stably:

- ``waiting`` holds each priority's sequences in FCFS order: a new sequence joins the back of its
  priority's, a preempted one (or children released to run on their own) their front. The head of
  the queue is the best priority's oldest sequence, and admission, which never lets a sequence
  skip the one ahead of it that does not fit, admits no worse priority before a better one (but
  for the scheduler's deferrals: an in-flight prefix, a LoRA slot).
- ``running`` holds each priority's sequences in admission order. The scheduler serves it in that
  order (a better-priority prefill admitted beside worse-priority decodes is computed before
  them) and preempts from its back: the victim is the worst priority's most recently admitted
  sequence, and never one already served in the step (it comes after the sequence that needs the
  blocks).

With every priority equal these are FCFS's queues exactly (append, appendleft, append).

How this compares with vLLM's priority policy (``--scheduling-policy priority``): vLLM orders its
waiting queue by ``(priority, arrival_time)`` and preempts the running request with the largest
``(priority, arrival_time)``; among equals ours preempts the latest *admitted*, which is what
FCFS preempts (a sequence readmitted after a preemption counts as admitted anew). vLLM serves its
running requests in admission order and undoes the chunk of a victim it had already served this
step; serving them in priority order makes that case impossible. As in vLLM's v1 scheduler (its
v0 forced such preemptions), a waiting sequence never preempts a running one, whatever their
priorities: a better-priority arrival waits for blocks or a ``max_num_seqs`` slot to free, and
goes first when one does. A running sequence thus never loses computed work to a newcomer, and
preemption stays a response to the running set outgrowing the pool. Lower priorities may wait
indefinitely while better ones keep coming; there is no aging.

Pure Python, no torch.
"""

from __future__ import annotations

from collections import deque

from llmplatform.engine.sequence import Sequence


def enqueue(waiting: deque[Sequence], seq: Sequence, *, front: bool = False) -> None:
    """Queue ``seq`` in ``waiting`` behind every waiting sequence of its priority or better, or
    (``front``) ahead of every one of its priority or worse. With one priority throughout this is
    ``append`` / ``appendleft``, and the scan stops at once."""
    priority = seq.priority
    if front:
        index = 0
        while index < len(waiting) and waiting[index].priority < priority:
            index += 1
    else:
        index = len(waiting)
        while index > 0 and waiting[index - 1].priority > priority:
            index -= 1
    waiting.insert(index, seq)


def insert_running(running: list[Sequence], seq: Sequence) -> None:
    """Admit ``seq`` into ``running`` behind every running sequence of its priority or better."""
    index = len(running)
    while index > 0 and running[index - 1].priority > seq.priority:
        index -= 1
    running.insert(index, seq)
