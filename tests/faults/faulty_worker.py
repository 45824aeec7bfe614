"""``python -m tests.faults.faulty_worker FAULTS_JSON [worker flags...]``: a model worker whose
engine injects ``FAULTS_JSON``'s faults (tests/faults/faulty_runner.py), for the fault tests that
need them in a worker subprocess. The worker is the real one (``llmplatform.model_worker``);
only its engine's model runner is the faulty one.
"""

from __future__ import annotations

import sys

from llmplatform.model_worker.__main__ import main
from tests.faults.faulty_runner import Faults, paged_backends_with


def run(argv: list[str]) -> None:
    faults = Faults.from_json(argv[0]) or Faults()
    with paged_backends_with(faults):
        main(argv[1:])


if __name__ == "__main__":
    run(sys.argv[1:])
