"""The compile processes of a :class:`~.grammar.GrammarCompiler`: grammar processes
(:mod:`.grammar_process`) that compile and probe one grammar at a time, each killed at its
deadline, started in the background when the compiler is built."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time

from llmplatform.sampling.grammar_process import GrammarProcess, GrammarProcessDied

# A mask's budget is CPU time; on a busy machine its wall time may reach this many budgets.
STARVED_LIMIT = 20


class CompileRefused(Exception):
    """A spec refused in its grammar process (does not compile, too slow, too large...): the
    client's doing, shared by every caller waiting for that compile. The message reads after
    what was compiled ("the JSON schema ...")."""


class CompileProcesses:
    """Idle processes to compile in, taken by one pool thread at a time. Thread-safe."""

    def __init__(self, tokenizer_info_json: str, *, num_processes: int,
                 pool: concurrent.futures.Executor) -> None:
        self._tokenizer_info_json = tokenizer_info_json
        self._idle: queue.SimpleQueue[GrammarProcess] = queue.SimpleQueue()
        self._all: list[GrammarProcess] = []
        self._lock = threading.Lock()
        self._closed = False
        # Done once every warm-up has ended (the first boots the fork server: seconds): a
        # compile's time limit starts after that, so that a cold worker's first grammar is not
        # refused for the boot.
        self.warm: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._num_warming = num_processes
        for _ in range(num_processes):
            pool.submit(self._warm_one)

    def compile(self, request: tuple, *, compile_timeout_s: float, token_budget_s: float
                ) -> tuple:
        """Sends ``request`` (grammar_child's ``compile``) to an idle process and returns its
        ``compiled`` reply. Raises CompileRefused for a refusal, a compile past
        ``compile_timeout_s`` or a probed mask past ``token_budget_s`` of CPU time (the process
        is then killed), or a crash."""
        process = self._take()
        position: int | None = None  # the mask the probe is computing
        try:
            process.send(request)
            reply = process.receive(deadline=time.monotonic() + compile_timeout_s)
            while reply is not None and reply[0] == "probe":  # each probed mask: one budget
                position = reply[1]
                reply = process.receive_within_cpu(
                    token_budget_s, wall_limit_s=STARVED_LIMIT * token_budget_s)
        except GrammarProcessDied:
            self._forget(process)
            raise CompileRefused("crashed its compile process") from None
        if reply is None:  # past a deadline: stop the CPU it burns, free the slot
            self._forget(process)
            if position is not None:
                raise CompileRefused(
                    f"is too slow to follow: choosing output token {position + 1} took longer "
                    f"than the per-token budget of {token_budget_s * 1000:.0f} ms; simplify it "
                    "(nested repetitions such as (.{1,50}){1,50} make every token slower than "
                    "the last)")
            raise CompileRefused(
                f"took longer than {compile_timeout_s:g} s to compile; simplify it")
        self._idle.put(process)
        if reply[0] == "refused":
            raise CompileRefused(reply[1])
        return reply

    def close(self) -> None:
        with self._lock:
            self._closed = True
            processes, self._all = self._all, []
        for process in processes:
            process.kill()

    def _warm_one(self) -> None:
        try:
            self._idle.put(self._new())
        finally:
            with self._lock:
                self._num_warming -= 1
                if self._num_warming == 0:
                    self.warm.set_result(None)

    def _new(self) -> GrammarProcess:
        process = GrammarProcess(self._tokenizer_info_json, name="grammar-compile")
        with self._lock:
            if not self._closed:
                self._all.append(process)
                return process
        process.kill()  # closed while it started
        raise GrammarProcessDied("the grammar compiler is closed")

    def _take(self) -> GrammarProcess:
        while True:
            try:
                process = self._idle.get_nowait()
            except queue.Empty:
                return self._new()
            if process.alive:
                return process
            self._forget(process)

    def _forget(self, process: GrammarProcess) -> None:
        process.kill()
        with self._lock:
            if process in self._all:
                self._all.remove(process)
