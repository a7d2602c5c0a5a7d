"""Start a vramd daemon as a child process, know when it is ready, watch its log, stop it.

Readiness is the daemon's own sd_notify READY=1, received on a private
NOTIFY_SOCKET: no polling for the socket file.  A thread reads that socket
for the daemon's whole life (as systemd does), so its watchdog and status
notes never fill it; `expect_note` waits for what the thread has seen.  With no `stderr` given,
the daemon's log is captured line by line as it comes, so a test can wait
for an event (`expect_log("session 3 .* SESSION_CANCELLED")`) instead of
sleeping.  Used by the demo, the benchmarks and the tests.
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
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .runas import RunAs

ROOT = str(Path(__file__).resolve().parents[2])  # the source tree (the daemon runs there)


class DaemonProcess:
    def __init__(self, run_dir: str, *args: str, env: dict[str, str] | None = None, stderr: IO[str] | None = None,
                 listener: socket.socket | None = None, log_level: str | None = "debug", ready_timeout: float = 60.0,
                 argv_prefix: list[str] | None = None, drain_notes: bool = True, run_as: RunAs | None = None) -> None:
        """`argv_prefix`: what runs the interpreter (default [sys.executable]; e.g. ["nice", "-n", "10", python]).

        `run_as`: run the daemon as that user and groups (vramd.testing.runas), with the interpreter that
        user can reach and a clean environment, in its `cwd`; the notify socket becomes that user's.

        `log_level=None` passes no --log-level (the config's log_level decides).
        `drain_notes=False` stops reading the notify socket after READY=1: a
        service manager that never reads (to test that the daemon does not block).
        """
        self.run_dir = run_dir
        self.log: list[str] = []
        self._cond = threading.Condition()
        self._cursor = 0
        self._eof = False
        self._terminated = False
        self.capturing = stderr is None
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.notify.bind(os.path.join(run_dir, f"notify-{os.getpid()}-{id(self)}.sock"))
        if run_as is not None:  # the daemon sends its notes with its own rights
            os.chown(self.notify.getsockname(), run_as.uid, run_as.gid)
        self.notes: list[str] = []
        self._drain_notes = drain_notes
        self._notes_open = True
        e = dict(os.environ if run_as is None else run_as.environ(), NOTIFY_SOCKET=self.notify.getsockname(),
                 PYTHONUNBUFFERED="1")
        for k in ("LISTEN_FDS", "LISTEN_PID", "WATCHDOG_USEC", "WATCHDOG_PID"):
            e.pop(k, None)
        e.update(env or {})
        argv = list(argv_prefix or (run_as.python if run_as is not None else [sys.executable]))
        pass_fds: tuple[int, ...] = ()
        if listener is not None:
            # Socket activation: the listener becomes fd 3 and LISTEN_PID is the pid that execs vramd.
            lfd = listener.fileno()
            shim = (f"import os, sys; os.dup2({lfd}, 3); os.close({lfd}); "
                    "os.environ['LISTEN_PID'] = str(os.getpid()); os.environ['LISTEN_FDS'] = '1'; "
                    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
            argv, pass_fds = [*argv, "-c", shim], (lfd,)
            self.socket = listener.getsockname()
        else:
            self.socket = os.path.join(run_dir, "vramd.sock")
        cmd = [*argv, "-m", "vramd", *(["--log-level", log_level] if log_level else []), *args]
        if listener is None and "--socket" not in args:
            cmd += ["--socket", self.socket]
        kw: dict[str, Any] = {"pass_fds": pass_fds, "cwd": ROOT}
        if run_as is not None:
            kw = run_as.popen_kwargs(pass_fds)
            del kw["env"]
        self.proc = subprocess.Popen(cmd, env=e, stderr=subprocess.PIPE if self.capturing else stderr, text=True,
                                     **kw)
        self.pid = self.proc.pid
        try:
            if self.capturing:  # read the log from the start: a full pipe would block the daemon
                threading.Thread(target=self._read_log, daemon=True).start()
            self._note_reader = threading.Thread(target=self._read_notes, daemon=True)
            self._note_reader.start()
            self.expect_note("READY=1", ready_timeout)
        except BaseException:
            self.close()
            raise

    # --- what it says ----------------------------------------------------------

    def expect_note(self, key: str, timeout: float = 30.0, *, count: int = 1) -> list[str]:
        """Wait for `count` sd_notify datagrams containing `key`; returns every note seen so far."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while sum(key in n for n in self.notes) < count:
                if self.proc.poll() is not None and key == "READY=1":
                    raise RuntimeError(f"vramd exited with status {self.proc.returncode} before it was ready"
                                       + (f"; log:\n{''.join(self.log)}" if self.capturing else ""))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {key} from vramd in {timeout} s")
                self._cond.wait(min(left, 0.5))  # woken by each note; the timeout notices an early exit
            return list(self.notes)

    def _read_notes(self) -> None:
        """Read every note the daemon sends (until close, or READY=1 with drain_notes=False)."""
        self.notify.settimeout(0.2)  # to notice close(); the notes themselves wake the waiters
        while self._notes_open:
            try:
                note = self.notify.recv(4096).decode()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._cond:
                self.notes.append(note)
                self._cond.notify_all()
            if not self._drain_notes and "READY=1" in note:
                return

    def _read_log(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cond:
                self.log.append(line)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def expect_log(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        """Wait for a log line matching `pattern`, after the last line an expect_log matched."""
        if not self.capturing:
            raise RuntimeError("the daemon's log goes elsewhere (stderr= was given)")
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

    # --- stopping ----------------------------------------------------------------

    def terminate(self) -> None:
        """Send SIGTERM once (the daemon drains, then exits); stop() then only waits."""
        self._terminated = True
        self.proc.terminate()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None and not self._terminated:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self._close_notify()

    def _close_notify(self) -> None:
        self._notes_open = False
        reader = getattr(self, "_note_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join()
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

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
