"""Counters and gauges in the Prometheus text exposition format.

A few dozen series do not warrant prometheus_client: this registry keeps
them in dicts, renders text, and writes node_exporter textfiles atomically
(temporary file, fsync, rename).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Mapping

_HELP = {
    "vramd_build_info": ("gauge", "Always 1; the version that runs is its label"),
    "vramd_bytes_total": ("counter", "BO bytes moved, by backend and direction (read = dump, write = restore)"),
    "vramd_sessions_total": ("counter", "Sessions ended, by kind and outcome"),
    "vramd_bos_total": ("counter", "BOs handled by ended sessions, by kind"),
    "vramd_errors_total": ("counter", "Errors reported to clients, by code"),
    "vramd_requests_total": ("counter", "Requests handled, by type"),
    "vramd_connections_refused_total": ("counter", "Connections refused (unauthorised peer or limit)"),
    "vramd_sessions_active": ("gauge", "Sessions not yet reaped"),
    "vramd_connections": ("gauge", "Open client connections"),
    "vramd_staging_bytes_in_use": ("gauge", "Staging memory held by chunks in flight"),
    "vramd_staging_bytes_allocated": ("gauge", "Staging memory mapped (in use + idle)"),
    "vramd_staging_budget_bytes": ("gauge", "Configured staging budget"),
    "vramd_uptime_seconds": ("gauge", "Seconds since the daemon started"),
}


LabelKey = tuple[tuple[str, str], ...]


def _labels(labels: Mapping[str, object]) -> LabelKey:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Metrics:
    def __init__(self) -> None:
        self._values: dict[str, dict[LabelKey, float]] = {name: {} for name in _HELP}
        self._lock = threading.Lock()

    def declare(self, name: str, *label_sets: Mapping[str, object]) -> None:
        """Start each series of `name` at 0 (a counter's known label values), so that rate() sees its first step."""
        with self._lock:
            series = self._values[name]
            for labels in label_sets or ({},):
                series.setdefault(_labels(labels), 0)

    def inc(self, name: str, value: float = 1, **labels: object) -> None:
        key = _labels(labels)
        with self._lock:
            series = self._values[name]
            series[key] = series.get(key, 0) + value

    def count_error(self, err: BaseException, code: str) -> None:
        """vramd_errors_total{code}: each error once, however many replies carry it.

        A failed AddBos fails its session with the same error: the reply to the
        AddBos counts it, the session's end (and a Wait that reports it) does not again.
        """
        if getattr(err, "_vramd_counted", False):
            return
        try:
            err._vramd_counted = True  # type: ignore[attr-defined]
        except AttributeError:
            pass
        self.inc("vramd_errors_total", code=code)

    def set(self, name: str, value: float, **labels: object) -> None:
        with self._lock:
            self._values[name][_labels(labels)] = value

    def get(self, name: str, **labels: object) -> float:
        return self._values[name].get(_labels(labels), 0)

    def render(self) -> str:
        out = []
        with self._lock:
            for name, (kind, help_text) in _HELP.items():
                out.append(f"# HELP {name} {help_text}")
                out.append(f"# TYPE {name} {kind}")
                for key, value in sorted(self._values[name].items()):
                    lab = ",".join(f'{k}="{_escape(v)}"' for k, v in key)
                    num = repr(float(value)) if isinstance(value, float) and not value.is_integer() else str(int(value))
                    out.append(f"{name}{{{lab}}} {num}" if lab else f"{name} {num}")
        return "\n".join(out) + "\n"

    @staticmethod
    def write_textfile(path: str, text: str) -> None:
        """Write `text` (a render()) atomically: readers see the old file or the new one, never a torn one."""
        tmp = f"{path}.{os.getpid()}.tmp"
        data = text.encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.fchmod(fd, 0o644)  # node_exporter reads it: not the service's UMask=0077
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
