"""Start a vramd daemon as a child process and know when it is ready.

Readiness is the daemon's own sd_notify READY=1, received on a private
NOTIFY_SOCKET: no polling for the socket file.  Used by the demo, the
benchmarks and the tests.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


class DaemonProcess:
    def __init__(self, run_dir: str, *args: str, env: dict | None = None, stderr=None, pass_fds=(),
                 argv_prefix: list[str] | None = None, socket_path: str | None = None, ready_timeout: float = 60.0,
                 ):
        self.run_dir = run_dir
        self.socket = socket_path or os.path.join(run_dir, "vramd.sock")
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.notify.bind(os.path.join(run_dir, f"notify-{os.getpid()}-{id(self)}.sock"))
        self.notes: list[str] = []
        e = dict(os.environ, NOTIFY_SOCKET=self.notify.getsockname(), PYTHONUNBUFFERED="1")
        for k in ("LISTEN_FDS", "LISTEN_PID", "WATCHDOG_USEC", "WATCHDOG_PID"):
            e.pop(k, None)
        e.update(env or {})
        cmd = [*(argv_prefix or [sys.executable]), "-m", "vramd.daemon", *args]
        if socket_path is None and "--socket" not in args:
            cmd += ["--socket", self.socket]
        self.proc = subprocess.Popen(cmd, env=e, stderr=stderr, text=True, pass_fds=pass_fds,
                                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.pid = self.proc.pid
        try:
            self.on_started()
            self.expect_note("READY=1", ready_timeout)
        except BaseException:
            self.close()
            raise

    def on_started(self) -> None:
        """Hook run after the process started, before waiting for READY=1."""

    def expect_note(self, key: str, timeout: float = 30.0) -> list[str]:
        """Wait for an sd_notify datagram containing `key`; returns every note seen so far."""
        deadline = time.monotonic() + timeout
        while not any(key in n for n in self.notes):
            if self.proc.poll() is not None and key == "READY=1":
                raise RuntimeError(f"vramd exited with status {self.proc.returncode} before it was ready")
            self.notify.settimeout(max(0.001, min(1.0, deadline - time.monotonic())))
            try:
                self.notes.append(self.notify.recv(4096).decode())
            except socket.timeout:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no {key} from vramd in {timeout} s") from None
        return self.notes

    def terminate(self) -> None:
        """Send SIGTERM once (the daemon drains, then exits); stop() then only waits."""
        self._terminated = True
        self.proc.terminate()

    def stop(self, sig=signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None and not getattr(self, "_terminated", False):
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self._close_notify()

    def _close_notify(self) -> None:
        if self.notify.fileno() >= 0:
            path = self.notify.getsockname()
            self.notify.close()
            try:
                os.unlink(path)
            except OSError:
                pass

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close_notify()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
