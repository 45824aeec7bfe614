"""The scheduler: each step, which sequences compute how many of their tokens.

One rule covers prefill, chunked prefill, decode and recompute after preemption: **each sequence's
computed tokens catch up with its tokens**. Every step has a budget of ``max_num_batched_tokens``
tokens, and at most ``max_num_seqs`` sequences run at once:

0. Sequences that can never run are rejected (listed in ``rejected`` with the reason, finished):
   more tokens than ``max_model_len`` or than the whole KV pool holds, or a request wanting more
   parallel sequences than ``max_num_seqs``.
1. Running sequences, in order (priority, then admission; see Priority below), each get
   ``min(uncomputed tokens, budget left)`` tokens: 1 for a decode, a chunk for a prefill still
   under way. When the KV pool lacks blocks for one, the LAST running sequence (the worst
   priority's most recently admitted) is preempted, possibly the one asking: its blocks are
   freed, its ``num_computed_tokens`` goes back to 0 and it goes to the FRONT of the waiting
   sequences of its priority. Its output tokens stay: it will be recomputed over prompt +
   output, which are simply more uncomputed tokens. The first running sequence can always take
   blocks from those after it, so it always progresses; and a victim is never one already
   served this step (it comes after the sequence asking).
2. Unless step 1 preempted (then the pool is full), waiting sequences are admitted in queue order
   (priority, then FCFS) while the budget, ``max_num_seqs`` and the free blocks allow. A prefill
   larger than the budget left is chunked. Admission stops at the first sequence that does not
   fit: nobody skips ahead of it. The exceptions are a
   sequence deferred for an in-flight prefix (below), and one whose LoRA adapter would make the
   running sequences' adapters outnumber the runner's slots (``max_loras``, engine.lora): each
   stays in its place and the next is considered.

Priority (``Sequence.priority``, lower first) orders both queues; engine.priority says how, and
why a waiting sequence never preempts a running one, but for background work: while foreground
sequences are unfinished, background ones get only the idle part of each step (engine.background
measures it), and are preempted first (step 0b) to admit the foreground ones at the head of the
queue. With every priority equal it is plain FCFS.

A chunk that reaches a sequence's last token ``samples``: the model appends one token, which
leaves the sequence one uncomputed token (its next decode).

Decodes first, then prefill chunks. A sequence left with its prefill unfinished by a step got the
last of that step's budget, so nothing was admitted after it; while it stays unfinished, every step
ends its budget at it again and admits nothing. Forked children are placed right after their
parent. Hence at most one sequence has an unfinished prefill, and only sequences of a worse
priority follow it in ``running`` (with equal priorities it is the last): step 1 serves every
decode of its priority or better before any prefill chunk, and a long prompt arriving is computed
in the budget those decodes leave, over as many steps as it takes, without ever delaying them
(with ``max_num_batched_tokens`` >= ``max_num_seqs``, every such decode runs every step).

Prefix caching (when the block manager has it). A sequence being admitted with nothing computed
(new, preempted, or a child that runs on its own) first takes the blocks of its longest cached
prefix: those tokens count as computed and its first chunk starts after them. The hit is capped so
that at least one token is left to compute (the model must produce logits to sample from; with
a whole prompt cached, its last full block is recomputed) and, for a parent with children to fork,
below the fork point. A request asking for prompt logprobs skips the lookup: it needs every prompt
position computed, and so does a mean pooling request (engine.pooling). After each step the
newly full blocks of each sequence are registered, generated tokens included, so a multi-turn
conversation's next prompt finds the previous answer cached. Then, for a model whose layers all
attend to a sliding window, the blocks the sequence's future queries cannot see are freed
(engine.block_manager): it holds about a window of KV however long it grows.

Prefixes in flight (``min_in_flight_prefix_blocks``, with prefix caching). Requests sharing a long
prefix often arrive together (one system prompt, several questions): admitted in the same step, each
would miss the cache and compute the prefix again, since its blocks are cached only once computed.
So a waiting sequence whose next ``min_in_flight_prefix_blocks`` or more full blocks after its
cached prefix are being computed in this very step by a running sequence (the block manager's
blocks in flight, by hash) is *deferred*: it stays in the queue, in place, and the scheduler goes on
to the next one, so unrelated requests are not held up. Next step those blocks are cached and it is
admitted with the hit (or deferred again, while the sharer's chunked prefill goes on: it is
admitted as soon as the blocks it shares are computed, not the whole of the other prompt).
Nothing waits on a waiting sequence, and no wait outlives the computation it waits for: only
sequences holding blocks have blocks in flight, each computes them in the step that allocated
them (so each step a sequence is deferred, its cached prefix grows), and one that is preempted,
aborted or failed frees them, which releases the waiter (it then computes, or finds cached, what
is left). Usually the wait is one step. A deferred sequence is waiting like any other
(``num_waiting``); while it waits, a sequence queued behind it may take the budget. Sequences
that skip the lookup (prompt logprobs, mean pooling) are never deferred; two children of one request
released to run on their own (their parent finished before the fork) share this path too.
``SchedulerOutput.deferred`` lists each sequence the first step it is deferred (the engine counts
and logs them).

Pooling sequences (``Sequence.pooling``, engine.pooling) are scheduled like any prompt, chunked
prefill included, but their chunks never sample: the engine finishes each one in the step that
computes its last prompt token, so it never decodes.

Parallel sampling (``n`` > 1). A request's children share the parent's prompt KV. They wait,
unschedulable, while the parent prefills ``P - 1`` of its ``P`` prompt tokens (its chunks stop
there and sample nothing; while running, the parent reserves ``max_num_seqs`` slots for its
children). Then each child is forked: it shares the parent's blocks and runs with ``P - 1``
computed tokens. All ``n`` sequences compute the last prompt token themselves and sample
independently; a write into the shared, partly filled last block copies it first
(``blocks_to_copy``). With ``P == 1`` nothing is shared: the children are independent sequences.
If the parent is preempted before the fork, its children wait for its recompute; a child
preempted after the fork recomputes alone.

Speculative decoding (engine.speculative): a decoding sequence's proposals
(``Sequence.spec_token_ids``, set before ``schedule``) are more tokens for its chunk to compute
(those past the budget dropped), carried in ``ScheduledChunk.spec_token_ids``; ``update`` counts
as computed only the proposals the runner accepted and frees the blocks of the rest.

``SchedulerOutput`` (engine.outputs) names sequences by id: a ``NewSequenceData`` when the runner
first computes one (new, a forked child, resumed after preemption), then ``CachedSequenceData``
(what changed); ``finished_seq_ids`` lists those it held that finished since the last step.

Pure Python, no torch.
"""

from __future__ import annotations

from collections import deque

from llmplatform.engine.block_manager import BlockManager
from llmplatform.engine.config import SchedulerConfig
from llmplatform.engine.outputs import (CachedSequenceData, ModelOutput, NewSequenceData,
                                        ScheduledChunk, SchedulerOutput)
from llmplatform.engine.background import BackgroundShare, StepShare
from llmplatform.engine.priority import (enqueue, has_foreground, insert_running, is_background,
                                         make_room_for_foreground)
from llmplatform.engine.sequence import Sequence, SequenceStatus
from llmplatform.engine.speculative.kv import settle_verified, trim_proposals


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_loras: int = 0) -> None:
        """``max_loras``: the runner's LoRA slots (engine.lora); 0 without LoRA."""
        self.config = config
        self.max_loras = max_loras
        self.block_manager = block_manager
        # Schedulable, not admitted, in priority order (lower first); among equals, new sequences
        # at the back, preempted ones at the front.
        self.waiting: deque[Sequence] = deque()
        # Admitted, in priority order, then admission order: the last is the first preempted.
        self.running: list[Sequence] = []
        # Parent seq_id -> its children waiting for the parent's prefill to reach the fork point.
        self._pending_children: dict[int, list[Sequence]] = {}
        # request_id -> all its sequences (parent first), until every one has finished.
        self._requests: dict[str, list[Sequence]] = {}
        # Waiting sequences deferred for an in-flight prefix since they last queued (reported once).
        self._deferred_seq_ids: set[int] = set()
        # Every unfinished sequence, by id (a step's records name sequences by id).
        self._live: dict[int, Sequence] = {}
        # Sequences the model runner holds state for (it got their NewSequenceData), and those of
        # them finished since the last step (reported in the next SchedulerOutput).
        self._in_runner: set[int] = set()
        self._finished_in_runner: list[int] = []
        # The background requests' share of each step (engine.background), fed by the engine.
        self.background = BackgroundShare(config.background_slowdown,
                                          config.background_max_step_tokens,
                                          config.background_grace_s)

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, seqs: list[Sequence]) -> None:
        """Queue a request's sequences: ``seqs[0]`` is the parent, the others share its prompt."""
        parent, children = seqs[0], seqs[1:]
        assert parent.request_id not in self._requests, f"duplicate request {parent.request_id}"
        for seq in seqs:
            assert seq.request_id == parent.request_id and seq.status is SequenceStatus.WAITING
            assert seq.prompt_token_ids == parent.prompt_token_ids and not seq.block_table
        self._requests[parent.request_id] = list(seqs)
        self._live.update((seq.seq_id, seq) for seq in seqs)
        if children and parent.num_prompt_tokens > 1:
            self._pending_children[parent.seq_id] = list(children)
            enqueue(self.waiting, parent)
        else:
            for seq in seqs:
                enqueue(self.waiting, seq)

    def finish(self, seq: Sequence) -> None:
        """Mark ``seq`` finished wherever it is and free its blocks (no-op if already finished)."""
        if seq.is_finished:
            return
        self._discard(seq)
        seq.status = SequenceStatus.FINISHED
        del self._live[seq.seq_id]
        if seq.seq_id in self._in_runner:
            self._in_runner.remove(seq.seq_id)
            self._finished_in_runner.append(seq.seq_id)
        self.block_manager.free(seq)
        # Children still waiting to share this parent's prefill now run on their own.
        for child in reversed(self._pending_children.pop(seq.seq_id, [])):
            enqueue(self.waiting, child, front=True)
        if all(s.is_finished for s in self._requests.get(seq.request_id, ())):
            self._requests.pop(seq.request_id, None)

    def abort_request(self, request_id: str) -> list[Sequence]:
        """Finish every unfinished sequence of the request at once; return them."""
        seqs = self._requests.get(request_id, [])
        aborted = [s for s in seqs if not s.is_finished]
        if seqs:
            self._pending_children.pop(seqs[0].seq_id, None)
        for seq in aborted:
            self.finish(seq)
        return aborted

    def get_request_seqs(self, request_id: str) -> list[Sequence]:
        return list(self._requests.get(request_id, ()))

    def sequence(self, seq_id: int) -> Sequence | None:
        """The unfinished sequence ``seq_id`` (None once finished)."""
        return self._live.get(seq_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Sequences not running: queued, preempted, or children waiting for their fork."""
        return len(self.waiting) + sum(len(c) for c in self._pending_children.values())

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self._pending_children)

    # ---- the step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledChunk] = []
        new_seqs: list[NewSequenceData] = []
        cached_seqs: list[CachedSequenceData] = []
        preempted: list[Sequence] = []
        blocks_to_copy: list[tuple[int, int]] = []
        rejected: list[tuple[int, str]] = []
        deferred: list[tuple[int, int]] = []
        num_prompt_tokens = 0

        # 0. Reject what can never run (every step: a sequence may outgrow the pool as it decodes).
        for seq in [*self.running, *self.waiting]:
            reason = self._rejection_reason(seq)
            if reason is not None:
                for s in [seq, *self._pending_children.pop(seq.seq_id, [])]:
                    self.finish(s)
                    rejected.append((s.seq_id, reason))

        # 0b. Background work gives way to the foreground at the head of the queue (engine.priority).
        foreground = has_foreground(self._live.values())
        yielded = make_room_for_foreground(self, budget, self._preempt) if foreground else []
        busy = self.background.busy(foreground)  # or it was a moment ago (engine.background)
        share = StepShare(self.background, busy)

        # 1. Running sequences, best priority and oldest first; the last are preempted for room.
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for an older sequence
            allowance = share.allowance(is_background(seq), budget)
            if allowance == 0:
                break  # background work, and the step has no idle tokens left (the rest is too)
            num_new_tokens = self._num_new_tokens(seq, allowance)
            num_blocks_before, num_copies_before = len(seq.block_table), len(blocks_to_copy)
            if self._allocate_or_preempt(seq, num_new_tokens, blocks_to_copy, preempted):
                if seq.seq_id in self._in_runner:
                    # A copy-on-write replaced the block it writes into: the table changes there.
                    changed_from = min([num_blocks_before] + [
                        seq.block_table.index(dst) for _, dst in blocks_to_copy[num_copies_before:]])
                    cached_seqs.append(CachedSequenceData(
                        seq.seq_id, seq.num_computed_tokens, changed_from,
                        tuple(seq.block_table[changed_from:])))
                else:  # a child forked last step: the runner meets it now
                    new_seqs.append(self._new_data(seq))
                scheduled.append(self._chunk(seq, num_new_tokens))
                num_prompt_tokens += self._num_prompt_tokens_in(seq, num_new_tokens)
                budget -= num_new_tokens
                share.took(is_background(seq), num_new_tokens)

        # 2. Waiting sequences in queue order but for deferrals, unless step 1 found the pool full.
        index = 0  # into self.waiting: the sequences before it are deferred this step
        while index < len(self.waiting) and budget > 0 and not preempted:
            seq = self.waiting[index]  # holds no blocks, has nothing computed
            num_target_tokens = self._num_target_tokens(seq)
            cached = self._cached_prefix(seq, num_target_tokens)
            num_in_flight_blocks = self._num_in_flight_blocks(seq, cached, num_target_tokens)
            if num_in_flight_blocks:
                if seq.seq_id not in self._deferred_seq_ids:
                    self._deferred_seq_ids.add(seq.seq_id)
                    deferred.append((seq.seq_id, num_in_flight_blocks))
                index += 1
                continue
            if not self._lora_fits(seq):  # waits for a slot; others may go ahead of it
                index += 1
                continue
            if self._num_seq_slots_used() + self._num_seq_slots(seq) > self.config.max_num_seqs:
                break
            allowance = share.allowance(is_background(seq), budget)
            if allowance == 0:
                break  # background work (as is the rest of the queue), and no idle tokens left
            num_cached_tokens = len(cached or ()) * bm.block_size
            num_total_tokens = min(num_target_tokens, num_cached_tokens + allowance)
            if not bm.can_allocate(bm.blocks_needed(seq, num_total_tokens, cached)):
                break
            if cached is not None:
                bm.take_cached_prefix(seq, cached)
            # Writing starts in a new block (after full cached blocks, if any): no copy.
            blocks_to_copy += bm.allocate_slots(seq, num_total_tokens)
            del self.waiting[index]
            self._deferred_seq_ids.discard(seq.seq_id)
            seq.status = SequenceStatus.RUNNING
            insert_running(self.running, seq)
            num_new_tokens = num_total_tokens - seq.num_computed_tokens
            new_seqs.append(self._new_data(seq))  # new, or resumed after preemption
            scheduled.append(self._chunk(seq, num_new_tokens))
            num_prompt_tokens += self._num_prompt_tokens_in(seq, num_new_tokens)
            budget -= num_new_tokens
            share.took(is_background(seq), num_new_tokens)

        finished, self._finished_in_runner = self._finished_in_runner, []
        return SchedulerOutput(scheduled=scheduled, new_seqs=new_seqs, cached_seqs=cached_seqs,
                               finished_seq_ids=finished,
                               preempted=[seq.seq_id for seq in [*yielded, *preempted]],
                               blocks_to_copy=blocks_to_copy, rejected=rejected, deferred=deferred,
                               num_prompt_tokens=num_prompt_tokens,
                               num_background_tokens=share.background_tokens, busy=busy)

    def update(self, output: SchedulerOutput, model_output: ModelOutput) -> None:
        """Advance each scheduled sequence past its chunk; append sampled tokens; fork children."""
        sampled = dict(zip(model_output.seq_ids, model_output.token_ids))
        for item in output.scheduled:
            seq = self._live.get(item.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # finished (aborted) since schedule()
            if item.samples:
                accepted = model_output.accepted.get(seq.seq_id)
                if accepted is not None:
                    seq.output_token_ids.extend(accepted.token_ids)
                seq.output_token_ids.append(sampled[seq.seq_id])
            if item.spec_token_ids:  # only the accepted proposals' KV stays (engine.speculative)
                settle_verified(seq, item, model_output.accepted[seq.seq_id], self.block_manager)
            else:
                seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
            self.block_manager.free_out_of_window(seq)  # sliding windows: what no query sees again
            if seq.seq_id in self._pending_children and seq.num_computed_tokens == seq.num_prompt_tokens - 1:
                self._fork_children(seq)

    # ---- internals ---------------------------------------------------------------------------

    def _num_target_tokens(self, seq: Sequence) -> int:
        """How far ``seq``'s computed tokens catch up: all its tokens, except that a parent with
        children still to fork stops its prefill at the fork point, P - 1."""
        if seq.seq_id in self._pending_children:
            return seq.num_prompt_tokens - 1
        return seq.num_tokens + len(seq.spec_token_ids)  # proposals: engine.speculative

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        num_new_tokens = min(self._num_target_tokens(seq) - seq.num_computed_tokens, budget)
        assert num_new_tokens > 0, f"nothing to compute for seq {seq.seq_id}"
        trim_proposals(seq, num_new_tokens)  # the proposals past the budget are dropped
        return num_new_tokens

    def _cached_prefix(self, seq: Sequence, num_target_tokens: int) -> list[int] | None:
        """The cached blocks ``seq`` may start from, or None when it must not look (no prefix
        caching, prompt logprobs wanted, or mean pooling). At least one target token is left to
        compute."""
        if not self.block_manager.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return None
        if seq.pooling is not None and seq.pooling.uses_every_position:
            return None  # a mean pool needs every prompt position's hidden state (engine.pooling)
        return self.block_manager.find_cached_prefix(seq, num_target_tokens - 1)

    def _num_in_flight_blocks(self, seq: Sequence, cached: list[int] | None,
                              num_target_tokens: int) -> int:
        """The full blocks right after ``seq``'s cached prefix that running sequences are
        computing this step, when there are enough to defer ``seq`` for; else 0. ``cached`` is
        ``_cached_prefix``'s answer (None: ``seq`` does not use the cache, it never defers)."""
        threshold = self.config.min_in_flight_prefix_blocks
        if cached is None or threshold == 0:
            return 0
        # The same cap as the lookup's: the blocks that could be hits next step.
        num_blocks = self.block_manager.num_in_flight_blocks(seq, len(cached), num_target_tokens - 1)
        return num_blocks if num_blocks >= threshold else 0

    def _chunk(self, seq: Sequence, num_new_tokens: int) -> ScheduledChunk:
        num_target_tokens = seq.num_tokens + len(seq.spec_token_ids)
        samples = seq.num_computed_tokens + num_new_tokens == num_target_tokens and seq.pooling is None
        return ScheduledChunk(seq.seq_id, num_new_tokens, samples, tuple(seq.spec_token_ids),
                              seq.spec_draft_probs if seq.spec_token_ids else None)

    @staticmethod
    def _num_prompt_tokens_in(seq: Sequence, num_new_tokens: int) -> int:
        start = seq.num_computed_tokens
        return max(0, min(start + num_new_tokens, seq.num_prompt_tokens) - start)

    def _new_data(self, seq: Sequence) -> NewSequenceData:
        """Everything the runner keeps for ``seq``, which it holds from now until it finishes."""
        self._in_runner.add(seq.seq_id)
        return NewSequenceData(
            seq_id=seq.seq_id, request_id=seq.request_id, index=seq.index,
            prompt_token_ids=tuple(seq.prompt_token_ids),
            output_token_ids=tuple(seq.output_token_ids), block_ids=tuple(seq.block_table),
            num_computed_tokens=seq.num_computed_tokens, params=seq.params, seed=seq.seed,
            stop_token_ids=seq.stop_token_ids, grammar=seq.grammar, pooling=seq.pooling,
            lora_id=seq.lora_id)

    def _lora_fits(self, seq: Sequence) -> bool:
        """Whether ``seq``'s adapter can run now: the running sequences' adapters never outnumber
        the runner's slots, so every step's adapters are resident together (engine.lora)."""
        if seq.lora_id is None:
            return True
        active = {s.lora_id for s in self.running if s.lora_id is not None}
        return seq.lora_id in active or len(active) < self.max_loras

    def lora_ids_in_use(self) -> set[int]:
        """The adapters of every unfinished sequence (an unloaded one's weights stay until then)."""
        return {s.lora_id for s in self._live.values() if s.lora_id is not None}

    def _allocate_or_preempt(self, seq: Sequence, num_new_tokens: int,
                             blocks_to_copy: list[tuple[int, int]], preempted: list[Sequence]) -> bool:
        """Give running ``seq`` slots for its chunk, preempting the last running sequences until
        they fit. False if ``seq`` itself had to be preempted."""
        bm = self.block_manager
        num_total_tokens = seq.num_computed_tokens + num_new_tokens
        # Recomputed each time: preempting a sequence that shares seq's block can spare a copy.
        while not bm.can_allocate(bm.blocks_needed(seq, num_total_tokens)):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        blocks_to_copy += bm.allocate_slots(seq, num_total_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        # Victims go from the back of ``running`` (its worst priority, newest first), each to the
        # front of its priority's waiting sequences: those keep their admission order.
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids.clear()
        seq.spec_draft_probs = None
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        enqueue(self.waiting, seq, front=True)

    def _fork_children(self, parent: Sequence) -> None:
        # Right after the parent: they were admitted with it (and this keeps every decode ahead of
        # any unfinished prefill, see the module docstring).
        index = self.running.index(parent) + 1
        for child in self._pending_children.pop(parent.seq_id):
            self.block_manager.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = SequenceStatus.RUNNING
            self.running.insert(index, child)
            index += 1

    def _num_seq_slots(self, seq: Sequence) -> int:
        """``max_num_seqs`` slots ``seq`` takes when running: its own and its unforked children's."""
        return 1 + len(self._pending_children.get(seq.seq_id, ()))

    def _num_seq_slots_used(self) -> int:
        return sum(self._num_seq_slots(s) for s in self.running)

    def _rejection_reason(self, seq: Sequence) -> str | None:
        num_tokens, bm = seq.num_tokens, self.block_manager
        if num_tokens > self.config.max_model_len:
            return (f"sequence has {num_tokens} tokens (prompt {seq.num_prompt_tokens} + output "
                    f"{len(seq.output_token_ids)}), more than max_model_len={self.config.max_model_len}")
        if not bm.can_ever_fit(num_tokens):
            return (f"sequence has {num_tokens} tokens, more than the KV cache holds "
                    f"({bm.num_blocks} blocks of {bm.block_size} = {bm.max_num_tokens} tokens)")
        if self._num_seq_slots(seq) > self.config.max_num_seqs:
            return (f"request asks for {self._num_seq_slots(seq)} parallel sequences, more than "
                    f"max_num_seqs={self.config.max_num_seqs}")
        return None

    def _discard(self, seq: Sequence) -> None:
        """Remove ``seq`` from whichever queue holds it (``Sequence`` compares by identity)."""
        self._deferred_seq_ids.discard(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            for parent_id, children in list(self._pending_children.items()):
                if seq in children:
                    children.remove(seq)
                    if not children:
                        del self._pending_children[parent_id]
