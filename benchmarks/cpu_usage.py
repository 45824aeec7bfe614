"""Who used the CPU during a timed section: the one ``/proc/stat`` reader the benchmarks share."""

from __future__ import annotations

import os
import time

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot, from ``/proc/stat``; (0, 0)
    where it cannot be read. Busy = user + nice + system + irq + softirq."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal ...
        busy = (values[0] + values[1] + values[2] + values[5] + values[6]) / _CLK_TCK
        steal = values[7] / _CLK_TCK if len(values) > 7 else 0.0
        return busy, steal
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0


class CpuMonitor:
    """Who used the cores during a timed section: this process (all its threads) and everything
    else on the machine (``/proc/stat`` busy time minus ours; other tenants of a shared VM show up
    here), in cores on average. On a shared machine the numbers of a section with ``others`` well
    above 0 are slowed down, multi-threaded small ops most (every OpenMP region waits for its
    slowest thread, which may have lost its time slice)."""

    def _snapshot(self) -> tuple[float, float, float, float]:
        busy, steal = machine_cpu_seconds()
        return time.perf_counter(), busy, steal, time.process_time()

    def start(self) -> None:
        self._start = self._snapshot()

    def stop(self) -> dict[str, float]:
        end = self._snapshot()
        wall = max(1e-9, end[0] - self._start[0])
        own = (end[3] - self._start[3]) / wall
        busy = (end[1] - self._start[1]) / wall
        return {"own_cores": round(own, 2), "other_cores": round(max(0.0, busy - own), 2),
                "steal_cores": round((end[2] - self._start[2]) / wall, 2)}
