"""LoRA in the scheduler and the prefix cache (no torch): the running sequences' adapters never
outnumber ``max_loras`` (a sequence whose adapter finds no slot waits in its place while others go
ahead, and runs once a slot frees); an adapter's id salts the first block hash, so no two adapters
(or an adapter and the base model) share a cached block, and (salt, adapter) pairs stay apart."""

from __future__ import annotations

from llmplatform.engine.block_manager import BlockManager
from llmplatform.engine.config import SchedulerConfig
from llmplatform.engine.prefix_cache import hash_block_tokens, salt_root
from llmplatform.engine.sequence import Sequence
from llmplatform.sampling.params import SamplingParams
from tests.unit.scheduler_helpers import RecordingScheduler, seq_of, step

PROMPT = list(range(300, 309))  # 9 tokens: two full blocks of 4


def make_scheduler(max_loras: int) -> RecordingScheduler:
    # Without the prefix cache: "e" would wait a step for "a"'s blocks (same adapter, same prompt).
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32)
    return RecordingScheduler(config, BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=False),
                              max_loras=max_loras)


def add(sched: RecordingScheduler, request_id: str, lora_id: int | None, max_tokens: int) -> Sequence:
    seq = Sequence(request_id, list(PROMPT), SamplingParams(max_tokens=max_tokens), lora_id=lora_id)
    sched.add_request([seq])
    return seq


def test_a_sequence_whose_adapter_finds_no_slot_waits_and_others_go_ahead() -> None:
    sched = make_scheduler(max_loras=2)
    first, second = add(sched, "a", 1, max_tokens=2), add(sched, "b", 2, max_tokens=9)
    third, base = add(sched, "c", 3, max_tokens=9), add(sched, "d", None, max_tokens=9)
    same = add(sched, "e", 1, max_tokens=9)
    out = step(sched)
    assert [seq_of(item) for item in out.scheduled] == [first, second, base, same]
    assert list(sched.waiting) == [third]
    step(sched)  # first's last token: it finishes (the engine would finish it now)
    sched.finish(first)
    out = step(sched)  # adapter 1 still runs (same): adapter 3 still has no slot
    assert third in sched.waiting and third not in [seq_of(i) for i in out.scheduled]
    sched.finish(same)
    out = step(sched)
    assert seq_of(out.scheduled[-1]) is third and not sched.waiting
    assert {s.lora_id for s in sched.running} == {2, 3, None}
    assert out.new_seqs[-1].lora_id == 3  # the runner learns each sequence's adapter
    assert sched.lora_ids_in_use() == {2, 3}


def test_adapter_ids_salt_the_block_hashes_apart() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    seqs = {key: Sequence(f"s{i}", list(PROMPT), SamplingParams(), cache_salt=key[0], lora_id=key[1])
            for i, key in enumerate([(None, None), (None, 1), (None, 2), ("t", None), ("t", 1)])}
    for seq in seqs.values():
        bm.find_cached_prefix(seq, seq.num_tokens)  # fills the hash memo
    firsts = {key: seq.block_hashes[0] for key, seq in seqs.items()}
    assert len(set(firsts.values())) == len(firsts)
    assert firsts[(None, 1)] == hash_block_tokens(salt_root(None, 1), PROMPT[:4])
    # The unsalted, base-model chain is unchanged, and a salt alone hashes as before.
    assert salt_root(None, None) is None
    assert salt_root("t") == salt_root("t", None)
    # No salt's text can stand in for an adapter: the adapter's root is its own domain.
    assert salt_root("\x01" + "\x00" * 7) != salt_root(None, 1)


def test_the_same_adapter_hits_and_another_misses() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)

    def run(lora_id: int | None) -> int:
        seq = Sequence("r", list(PROMPT), SamplingParams(), lora_id=lora_id)
        cached = bm.find_cached_prefix(seq, seq.num_tokens - 1)
        bm.take_cached_prefix(seq, cached)
        bm.allocate_slots(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)
        bm.free(seq)
        return len(cached)

    assert [run(1), run(2), run(None), run(1), run(2), run(None)] == [0, 0, 0, 2, 2, 2]
