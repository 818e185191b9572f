"""How much of the machine other work took while a benchmark ran, for the benchmark scripts."""

from __future__ import annotations

import contextlib
import os
import time


class CpuMeter:
    """How much of the machine other work took: CPU seconds all processes spent busy (/proc/stat)
    less those of this process and its children, over the wall time since the last ``lap``."""

    def __init__(self):
        self.last = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        import psutil

        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
        machine = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait
        me = psutil.Process()
        own = 0.0
        for proc in [me, *me.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = proc.cpu_times()  # children_*: its descendants already reaped
                own += t.user + t.system + t.children_user + t.children_system
        return time.perf_counter(), machine, own

    def share(self) -> tuple[float, float]:
        """(seconds since the last lap, the share of the CPUs other processes kept busy meanwhile)."""
        now = self._sample()
        (t0, machine0, own0), (t1, machine1, own1) = self.last, now
        self.last = now
        return t1 - t0, max(0.0, (machine1 - machine0) - (own1 - own0)) / ((t1 - t0) * os.cpu_count())

    def lap(self) -> str:
        seconds, others = self.share()
        return f"{seconds:.0f} s; other processes kept {100 * others:.0f}% of the CPUs busy meanwhile"
