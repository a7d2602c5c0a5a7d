"""A real vramd daemon process for tests: started, awaited, stopped, observed.

Readiness is the daemon's own sd_notify READY=1 (vramd.launcher); log lines
are read from the daemon's stderr as they come, so a test can wait for an
event ("session 3 ... SESSION_CANCELLED") instead of sleeping.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time

from vramd.launcher import DaemonProcess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class DaemonProc(DaemonProcess):
    def __init__(self, run_dir, *args: str, env: dict | None = None, listener: socket.socket | None = None):
        self.log: list[str] = []
        self._cond = threading.Condition()
        self._cursor = 0
        self._eof = False
        kw = {}
        if listener is not None:
            # Socket activation: the listener becomes fd 3 and LISTEN_PID is the pid that execs vramd.
            lfd = listener.fileno()
            shim = ("import os, sys; os.dup2(%d, 3); os.close(%d); os.environ['LISTEN_PID'] = str(os.getpid()); "
                    "os.environ['LISTEN_FDS'] = '1'; os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
                    % (lfd, lfd))
            kw = dict(argv_prefix=[sys.executable, "-c", shim], pass_fds=[lfd], socket_path=listener.getsockname())
        super().__init__(str(run_dir), "--log-level", "debug", *args, env=env, stderr=subprocess.PIPE, **kw)

    def on_started(self) -> None:
        # read the log from the start: a full pipe would block the daemon
        threading.Thread(target=self._read_log, daemon=True).start()

    def _read_log(self) -> None:
        for line in self.proc.stderr:
            with self._cond:
                self.log.append(line)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def expect_log(self, pattern: str, timeout: float = 30.0) -> re.Match:
        """Wait for a log line matching `pattern`, after the last line an expect_log matched."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                while self._cursor < len(self.log):
                    line = self.log[self._cursor]
                    self._cursor += 1
                    if (m := rx.search(line)):
                        return m
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    why = "daemon exited" if self._eof else f"nothing in {timeout} s"
                    raise AssertionError(f"no log line matching {pattern!r} ({why}); log:\n{''.join(self.log)}")
                self._cond.wait(left)

    def fds(self) -> list[str]:
        """The daemon's open fds (their targets), as the kernel lists them."""
        out = []
        for fd in os.listdir(f"/proc/{self.pid}/fd"):
            try:
                out.append(os.readlink(f"/proc/{self.pid}/fd/{fd}"))
            except FileNotFoundError:
                pass
        return sorted(out)
