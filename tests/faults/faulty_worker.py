"""``python -m tests.faults.faulty_worker FAULTS_JSON [worker flags...]``: a model worker whose
engine injects ``FAULTS_JSON``'s faults (tests/faults/faulty_runner.py), for the fault tests that
need them in a worker subprocess. The worker is the real one (``llmplatform.model_worker``);
only its engine's model runner is the faulty one.
"""

from __future__ import annotations

import functools
import sys

from llmplatform.llm.build import build_backend
from llmplatform.model_worker.__main__ import main
from tests.faults.faulty_runner import Faults


def run(argv: list[str]) -> None:
    faults = Faults.from_json(argv[0]) or Faults()
    main(argv[1:], build=functools.partial(build_backend, runner_factory=faults.runner_factory()))


if __name__ == "__main__":
    run(sys.argv[1:])
