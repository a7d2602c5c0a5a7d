"""A real vramd daemon process for tests: started, awaited, stopped, observed.

Readiness is the daemon's own sd_notify READY=1 on a NOTIFY_SOCKET the test
owns; log lines are read from the daemon's stderr as they come, so a test
can wait for an event ("session 3 ... SESSION_CANCELLED") instead of
sleeping.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class DaemonProc:
    def __init__(self, run_dir, *args: str, env: dict | None = None, listener: socket.socket | None = None,
                 ready_timeout: float = 30.0):
        self.run_dir = str(run_dir)
        self.socket = os.path.join(self.run_dir, "vramd.sock")
        self.notify_path = os.path.join(self.run_dir, "notify.sock")
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.notify.bind(self.notify_path)
        self.notes: list[str] = []
        e = dict(os.environ, NOTIFY_SOCKET=self.notify_path, PYTHONUNBUFFERED="1")
        e.pop("LISTEN_FDS", None)
        e.update(env or {})
        cmd = [sys.executable, "-m", "vramd.daemon", "--log-level", "debug", *args]
        if listener is None:
            cmd += ["--socket", self.socket]
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=e, stderr=subprocess.PIPE, text=True)
        else:  # socket activation: the listener becomes fd 3, LISTEN_PID is the exec'd pid
            lfd = listener.fileno()
            shell = 'LISTEN_PID=$$ LISTEN_FDS=1 LISTEN_FDNAMES=rpc exec "$@"'
            self.proc = subprocess.Popen(["sh", "-c", shell, "sh", *cmd], cwd=ROOT, env=e, stderr=subprocess.PIPE,
                                         text=True, pass_fds=[lfd], preexec_fn=lambda: os.dup2(lfd, 3))
        self.pid = self.proc.pid
        self.log: list[str] = []
        self._cond = threading.Condition()
        self._cursor = 0
        self._eof = False
        threading.Thread(target=self._read_log, daemon=True).start()
        self.expect_note("READY=1", ready_timeout)

    def _read_log(self) -> None:
        for line in self.proc.stderr:
            with self._cond:
                self.log.append(line)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def expect_note(self, key: str, timeout: float = 30.0) -> list[str]:
        """Wait for an sd_notify datagram containing `key`; returns every note seen so far."""
        self.notify.settimeout(timeout)
        deadline = time.monotonic() + timeout
        while not any(key in n for n in self.notes):
            self.notify.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                self.notes.append(self.notify.recv(4096).decode())
            except socket.timeout:
                raise AssertionError(f"no {key} from the daemon in {timeout} s; log:\n{''.join(self.log)}")
        return self.notes

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
        """The daemon's open fds (targets), as the kernel lists them."""
        out = []
        for fd in os.listdir(f"/proc/{self.pid}/fd"):
            try:
                out.append(os.readlink(f"/proc/{self.pid}/fd/{fd}"))
            except FileNotFoundError:
                pass
        return sorted(out)

    def stop(self, sig=signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.notify.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.notify.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
