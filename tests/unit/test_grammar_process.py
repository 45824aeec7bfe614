"""A grammar process is killed once, whoever kills it: a compile past its deadline and the
compiler's close race for the same process (a full-suite run closed its pipe twice and the
close raised EBADF, which left a closed compiler in place of the worker's)."""

from __future__ import annotations

import threading

from llmplatform.sampling.grammar_process import GrammarProcess
from tests.unit.grammar_helpers import make_compiler


def test_killing_a_process_from_two_threads_at_once_kills_it_once(tiny_model_dir):
    compiler, _ = make_compiler(tiny_model_dir)
    try:
        process = GrammarProcess(compiler.tokenizer_info_json)
    finally:
        compiler.close()
    start = threading.Barrier(8)
    errors: list[BaseException] = []

    def kill() -> None:
        start.wait()
        try:
            process.kill()
        except BaseException as exc:  # noqa: BLE001 - the test reports any
            errors.append(exc)

    threads = [threading.Thread(target=kill) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert not process.alive
    process.kill()  # and again, later: still nothing to do
