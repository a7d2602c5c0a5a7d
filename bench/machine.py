"""What a bench run records about the machine it ran on, so runs on different machines can be told apart.

The 2-core VMs these benches run on are not all alike: the same code and bench gave a
daemon CPU time per 10,000-BO dump + restore of 1.2-1.4 s on one and 0.6 s on another
(bench/README.md, client_rate.py), so every JSON names the CPU and how much of the run the
hypervisor took back (steal time, from /proc/stat).
"""
from __future__ import annotations

import os
import platform


def _cpu_ticks() -> tuple[int, int]:
    """(all ticks, steal ticks) of every CPU so far, from /proc/stat's first line."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields), fields[7] if len(fields) > 7 else 0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class Machine:
    """Start one at the beginning of a run; `summary()` at its end."""

    def __init__(self) -> None:
        self.load_before = list(os.getloadavg())
        self._ticks = _cpu_ticks()

    def summary(self) -> dict:
        total, steal = _cpu_ticks()
        spent = total - self._ticks[0]
        return {
            "cpu_model": _cpu_model(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "loadavg_before": self.load_before, "loadavg_after": list(os.getloadavg()),
            "steal_share": round((steal - self._ticks[1]) / spent, 4) if spent > 0 else 0.0,
        }

    @staticmethod
    def line(s: dict) -> str:
        return (f"{s['cpu_model']}, {s['cpus']} cpus; load average {s['loadavg_before'][0]:.2f} before, "
                f"{s['loadavg_after'][0]:.2f} after; steal {100 * s['steal_share']:.1f} % of CPU time")
