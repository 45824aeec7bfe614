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

Background requests (``priority >= BACKGROUND_PRIORITY``, protocol.worker: the gateway's batch
lines) are the one exception to "a waiting sequence never preempts a running one", and they get
only idle capacity. While any foreground sequence (a better priority) is unfinished:

- a step gives background sequences only the tokens engine.background allows: as many as keep
  the step within ``background_slowdown`` of what it would take without them, found by
  measuring the steps (a few rows ride along nearly free where the weights' reading dominates,
  as on a GPU; on a small CPU every row costs its arithmetic);
- a foreground sequence at the head of the waiting queue that lacks a ``max_num_seqs`` slot or
  free blocks preempts running background sequences (worst first) until it fits
  (``make_room_for_foreground``): background work never holds an interactive request out. The
  victims recompute later, mostly from the prefix cache, which keeps their freed blocks.

With no foreground sequence unfinished, a step gives background sequences up to
``background_max_step_tokens``, which bounds how long an arriving interactive request waits for
the step under way. With no background sequence, nothing here applies.

Pure Python, no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from llmplatform.engine.sequence import Sequence
from llmplatform.protocol.worker import BACKGROUND_PRIORITY

if TYPE_CHECKING:
    from llmplatform.engine.scheduler import Scheduler


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


def is_background(seq: Sequence) -> bool:
    return seq.priority >= BACKGROUND_PRIORITY


def has_foreground(seqs: Iterable[Sequence]) -> bool:
    """Whether any of ``seqs`` (the unfinished ones) is foreground work."""
    return any(seq.priority < BACKGROUND_PRIORITY for seq in seqs)


def make_room_for_foreground(sched: Scheduler, budget: int,
                             preempt: Callable[[Sequence], None]) -> list[Sequence]:
    """Preempt running background sequences, worst first, until the foreground sequences at the
    head of the waiting queue fit (a ``max_num_seqs`` slot and the blocks of their first chunk
    each, within the step's ``budget``). Returns the victims. Stops at the first waiting sequence
    that is background work, or that would not fit even with every background one gone."""
    bm, config = sched.block_manager, sched.config
    victims: list[Sequence] = []
    num_slots = sched._num_seq_slots_used()
    num_blocks = 0
    for seq in list(sched.waiting):  # victims join it (behind every foreground sequence)
        if is_background(seq) or budget <= 0:
            break
        # As admission will count it (engine.scheduler, step 2): after its cached prefix.
        num_target_tokens = sched._num_target_tokens(seq)
        cached = sched._cached_prefix(seq, num_target_tokens)
        num_tokens = min(num_target_tokens, len(cached or ()) * bm.block_size + budget)
        num_slots += sched._num_seq_slots(seq)
        num_blocks += bm.blocks_needed(seq, num_tokens, cached)
        # What every running background sequence holds (their blocks counted once each, shared
        # ones too: an estimate): if even that would not make room, preempt none for this one.
        background = [s for s in sched.running if is_background(s)]
        held = len({b for s in background for b in s.block_table})
        if (num_slots - sum(sched._num_seq_slots(s) for s in background) > config.max_num_seqs
                or not bm.can_allocate(num_blocks - held)):
            break
        while ((num_slots > config.max_num_seqs or not bm.can_allocate(num_blocks))
               and sched.running and is_background(sched.running[-1])):
            victim = sched.running[-1]
            num_slots -= sched._num_seq_slots(victim)
            preempt(victim)
            victims.append(victim)
        if num_slots > config.max_num_seqs or not bm.can_allocate(num_blocks):
            break
        budget -= num_tokens - len(cached or ()) * bm.block_size
    return victims
