"""vramctl pull --serve: a pull that a streamed restore inside CRIU reads while it downloads (vramd.oci.serve;
docs/criu-integration.md, "Restoring from a registry").

    vramctl pull --serve [--serve-timeout S] [--foreground] HOST/REPO[:TAG|@DIGEST] IMAGE_DIR [registry options]

By default it returns to the shell once IMAGE_DIR is laid out and its socket listens (exit 0, one line on
stdout), so `vramctl pull --serve ... && criu restore ...` has no race: a child process (its own session, stdout
on /dev/null) goes on serving, and reports a failure on stderr (`vramctl: CODE: message`), removing IMAGE_DIR.
A failure before it listens is the command's own (exit 1, nothing left).  `--foreground` serves in the command
itself: the same line once it listens, then its exit status is the serve's.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType

from ..errors import VramdError
from ..oci.pull import Puller
from ..oci.registry import Reference, Registry
from ..oci.serve import Server
from .common import EXIT_FAILURE, EXIT_OK, Failure

DEFAULT_TIMEOUT = 300.0


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--serve", action="store_true", help="lay IMAGE_DIR out at once and serve a streamed restore "
                   "of it (CRIU's amdgpu plugin, KFD_VRAMD=1) on IMAGE_DIR/.vramd-supply.sock while the blobs "
                   "download; returns once it listens")
    p.add_argument("--serve-timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                   help=f"with --serve: how long to wait for the restore to connect (default {DEFAULT_TIMEOUT:g})")
    p.add_argument("--foreground", action="store_true", help="with --serve: serve in this process (exit status: "
                   "the serve's) instead of returning once it listens")


class _Stop(Exception):
    """SIGTERM or SIGHUP: the serve stops, removing what it made."""


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    raise _Stop(f"stopped by signal {signum}")


def _report(e: BaseException) -> None:
    if isinstance(e, VramdError):
        print(f"vramctl: {e.code}: {e.describe()}", file=sys.stderr, flush=True)
    else:
        print(f"vramctl: {e}", file=sys.stderr, flush=True)


def cmd_serve(ns: argparse.Namespace, registry: Callable[[argparse.Namespace, Reference], Registry]) -> int:
    if ns.serve_timeout <= 0:
        raise Failure("--serve-timeout must be above 0")
    if ns.foreground:
        return _serve(ns, registry, lambda line: print(line, flush=True))
    r, w = os.pipe2(os.O_CLOEXEC)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the server: it reports readiness (or its failure, on stderr) through the pipe's end
        os.close(r)
        os.setsid()  # the shell's job control and hang-up are not its
        code = EXIT_FAILURE
        try:
            code = _serve(ns, registry, lambda line: _ready(w, line))
        except BaseException as e:  # the child's last word: nothing above it reports
            _report(e)
        finally:
            os._exit(code)
    os.close(w)
    got = b""
    while chunk := os.read(r, 4096):
        got += chunk
    os.close(r)
    if got:
        print(got.decode(errors="replace"), end="", flush=True)
        return EXIT_OK
    _pid, status = os.waitpid(pid, 0)  # it failed before it listened, and said why on stderr
    return os.waitstatus_to_exitcode(status) or EXIT_FAILURE


def _ready(w: int, line: str) -> None:
    """In the server: the line for the shell, then stdout to /dev/null (a `$(...)` around it ends now)."""
    os.write(w, (line + "\n").encode())
    os.close(w)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


def _serve(ns: argparse.Namespace, registry: Callable[[argparse.Namespace, Reference], Registry],
           ready: Callable[[str], None]) -> int:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    ref = Reference.parse(ns.ref)
    try:
        reg = registry(ns, ref)
    except (Failure, VramdError, OSError) as e:
        _report(e)
        return EXIT_FAILURE
    wake, woken = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # the serve's waits end on a signal (Server's `_wait`)
    old = signal.set_wakeup_fd(woken, warn_on_full_buffer=False)
    server = Server(Puller(reg, ref.repo, concurrency=ns.concurrency), ref.ref, ns.dir, timeout=ns.serve_timeout,
                    warn=lambda text: print(f"vramctl: warning: {text}", file=sys.stderr, flush=True), wake=wake)
    try:
        if not server.open():
            ready(f"{ns.dir} holds {ref} ({server.chain()[0].digest}) already: nothing to serve")
            return EXIT_OK
        ready(f"serving {ref} ({server.chain()[0].digest}) into {ns.dir} (pid {os.getpid()}): a restore connects "
              f"to {server.socket_path} within {ns.serve_timeout:g} s")
        server.serve()
        return EXIT_OK
    except (Failure, VramdError, OSError, _Stop, KeyboardInterrupt) as e:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # a second one must not cut the removal short
            signal.signal(sig, signal.SIG_IGN)
        server.abandon()
        _report(e)
        return EXIT_FAILURE
    finally:
        reg.close()
        signal.set_wakeup_fd(old)
        os.close(wake)
        os.close(woken)
