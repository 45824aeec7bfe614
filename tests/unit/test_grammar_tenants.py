"""One tenant cannot hold every compile slot: with two slots and one compile per tenant in
flight, a tenant's second slow compile waits for its first, and another tenant's grammar
compiles meanwhile."""

from __future__ import annotations

import asyncio
import threading

import pytest

from llmplatform.sampling.grammar import GrammarCompiler, GrammarConfig
from llmplatform.sampling.structured_output import StructuredOutputSpec


class SlowForA(GrammarCompiler):
    """Compiles of sources starting with 'a' wait on a gate (the attacker's slow grammars)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.started: list[str] = []

    def _compile_now(self, spec):
        self.started.append(spec.source)
        if spec.source.startswith("a"):
            assert self.gate.wait(30), "the test never opened the gate"
        return super()._compile_now(spec)


@pytest.fixture
def compiler(tiny_model_dir):
    from llmplatform.llm.resolve import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    compiler = SlowForA(tokenizer, len(tokenizer),
                        stop_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")],
                        config=GrammarConfig(max_concurrent_compiles=2,
                                             max_compiles_per_tenant=1))
    assert compiler.wait_warm(120)  # the tests count compile starts and waiters
    yield compiler
    compiler.gate.set()
    compiler.close()


async def test_a_tenant_with_slow_compiles_holds_one_slot(compiler):
    attacker = [asyncio.create_task(compiler.compile(StructuredOutputSpec.regex(f"a{i}x+"),
                                                     tenant="key:attacker"))
                for i in range(3)]
    for _ in range(200):  # the compile processes start in the background first
        if compiler.started:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)
    assert compiler.started == ["a0x+"]  # the attacker's others wait for its first
    # Another tenant's grammar compiles at once on the free slot.
    grammar = await asyncio.wait_for(
        compiler.compile(StructuredOutputSpec.regex("[0-9]{7}"), tenant="key:victim"), 10)
    assert grammar.spec.source == "[0-9]{7}"
    compiler.gate.set()
    done = await asyncio.wait_for(asyncio.gather(*attacker), 30)
    assert [g.spec.source for g in done] == ["a0x+", "a1x+", "a2x+"]
    assert not compiler._tenants  # no per-tenant state left behind
