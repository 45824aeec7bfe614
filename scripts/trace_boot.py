"""Run a module as ``__main__`` while recording which llmplatform source files execute, on signal.

Used by ``scripts/request_path.py``: SIGUSR1 starts recording (every thread's Python calls), SIGUSR2
stops it and writes the files seen, one per line, to ``$LLMPLATFORM_TRACE_OUT``. The profiler is
installed before the module starts so threads started later (the engine's step thread, uvicorn's
workers) carry it too; while not recording it only checks a flag.

    python scripts/trace_boot.py llmplatform.controller --port 21001
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
from pathlib import Path

_recording = False
_seen: set[str] = set()


def _profile(frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
    if _recording and event == "call":
        _seen.add(frame.f_code.co_filename)


def _start(signum, frame):  # noqa: ANN001
    global _recording
    _seen.clear()
    _recording = True


def _stop(signum, frame):  # noqa: ANN001
    global _recording
    _recording = False
    package = "/llmplatform/"
    files = sorted({f.split(package, 1)[1] for f in _seen if package in f and f.endswith(".py")})
    Path(os.environ["LLMPLATFORM_TRACE_OUT"]).write_text("\n".join(files) + "\n")


def main() -> None:
    module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
    threading.setprofile(_profile)
    sys.setprofile(_profile)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
