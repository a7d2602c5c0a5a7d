"""`vramd`: the daemon's command line.

    vramd [--config FILE] [--socket PATH] [--socket-mode OCTAL] [--staging-budget SIZE] [--chunk-size SIZE]
          [--compression none|zstd|bplanes|auto[:LEVEL]] [--workers-per-gpu N] [--allow-uid UID ...]
          [--allow-group GROUP ...] [--grace-period S] [--max-hold S] [--drain-timeout S]
          [--metrics-textfile PATH] [--log-level LEVEL] [--check-config]

Listens on the socket passed by systemd (socket activation) if there is
one, else on --socket / the config's socket / $VRAMD_SOCKET /
$XDG_RUNTIME_DIR/vramd/vramd.sock / /tmp/vramd-<uid>/vramd.sock (root:
/run/vramd/vramd.sock, as root's clients never look in /tmp).
SIGTERM or SIGINT drains running sessions (up to --drain-timeout), then
exits 0.  SIGHUP re-reads --config and applies what can change at run time
(config.RELOADABLE); a bad file is logged and the running settings stay.
`--check-config` validates, prints the effective settings as TOML and exits:
0, or 2 with one line naming the bad key.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import resource
import signal
import socket
import stat
import sys
from collections.abc import Callable

import uvloop

from .. import __version__
from ..image.compression import FORMS
from ..paths import SYSTEM_SOCKET, default_socket_path, ensure_private_dir, user_run_dir
from ..units import size_arg
from . import systemd
from .config import LOG_LEVELS, ConfigError, DaemonConfig, load_config, to_toml
from .daemon import Daemon

log = logging.getLogger("vramd")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vramd", description="VRAM checkpoint transfer daemon: moves GPU buffer-object "
                                 "contents between the file descriptors its clients pass and checkpoint images.")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    ap.add_argument("--config", help="TOML configuration file")
    ap.add_argument("--socket", help="unix socket path to listen on (default: $VRAMD_SOCKET, else "
                    "$XDG_RUNTIME_DIR/vramd/vramd.sock, else /tmp/vramd-UID/vramd.sock, for root "
                    "/run/vramd/vramd.sock: where clients look)")
    ap.add_argument("--socket-mode", help="permissions of the socket file (octal, e.g. 0660)")
    ap.add_argument("--staging-budget", type=size_arg, help="host staging memory budget (e.g. 512M)")
    ap.add_argument("--chunk-size", type=size_arg, help="chunk size (e.g. 8M)")
    ap.add_argument("--compression", help=f"default dump compression: {FORMS} (default: auto)")
    ap.add_argument("--workers-per-gpu", type=int, help="chunks in flight per GPU")
    ap.add_argument("--allow-uid", type=int, action="append", dest="allowed_uids", help="uid allowed to connect")
    ap.add_argument("--allow-group", action="append", dest="allowed_groups",
                    help="group (name or gid) allowed to connect")
    ap.add_argument("--grace-period", type=float, help="seconds a session outlives its last connection (not a dump "
                    "whose opener hung up: cancelled at once)")
    ap.add_argument("--max-hold", type=float, help="the most seconds a restore may ask to be kept instead, once no "
                    "connection holds it (the CRIU offload's submit; 0: the grace period for every session)")
    ap.add_argument("--drain-timeout", type=float, help="seconds SIGTERM waits for running sessions")
    ap.add_argument("--metrics-textfile", help="write Prometheus metrics here (atomically)")
    ap.add_argument("--log-level", choices=list(LOG_LEVELS), help="log level (default: the config's log_level, info)")
    ap.add_argument("--check-config", action="store_true",
                    help="validate the configuration, print the effective settings and exit (0, or 2 if invalid)")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def overrides(ns: argparse.Namespace) -> dict[str, object]:
    keys = ("socket", "socket_mode", "staging_budget", "chunk_size", "compression", "workers_per_gpu", "allowed_uids",
            "allowed_groups", "grace_period", "max_hold", "drain_timeout", "metrics_textfile", "log_level")
    out = {k: getattr(ns, k) for k in keys}
    if ns.allowed_groups:
        out["allowed_groups"] = [int(g) if g.isdigit() else g for g in ns.allowed_groups]
    return out


def raise_fd_limit() -> None:
    """Sessions hold one fd per BO source: take the hard limit of open files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


UNIX_PATH_MAX = 108  # sun_path's size, its terminating NUL included


class ListenError(Exception):
    """The daemon cannot listen where it was asked to: one line (what, where, what to do); exit 1."""


def _made_dirs(path: str, parent: str) -> list[str]:
    """Make the socket's directory if it is one of the two documented runtime directories, the user's
    (`user_run_dir`, 0700, ours alone) and root's /run/vramd (0755 whatever the umask: clients refuse a
    group-writable one); any other missing directory is a mistyped path, refused.  Returns what was made."""
    if parent == user_run_dir():
        existed = os.path.isdir(parent)
        ensure_private_dir(parent)
        return [] if existed else [parent]
    if parent == os.path.dirname(SYSTEM_SOCKET) and _is_root():
        old = os.umask(0o022)
        try:
            os.mkdir(parent, 0o755)
        except FileExistsError:
            return []
        finally:
            os.umask(old)
        return [parent]
    if not os.path.isdir(parent):
        why = "is not a directory" if os.path.lexists(parent) else "does not exist"
        raise ListenError(f"cannot listen on {path}: {parent} {why}; vramd "
                          f"makes only {os.path.dirname(SYSTEM_SOCKET)} and {user_run_dir()}: create it first, or "
                          "choose another --socket")
    return []


def _is_root() -> bool:
    return os.geteuid() == 0


def _replace_stale(path: str) -> None:
    """A stale socket file (nobody listens) is removed; a live daemon's, or anything but a socket, is not."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ListenError(f"cannot listen on {path}: it exists and is not a socket: remove it or choose another "
                          "--socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.connect(path)
    except OSError as e:
        if e.errno == errno.EACCES:
            raise ListenError(f"cannot listen on {path}: a socket of uid {st.st_uid} is there, mode "
                              f"{st.st_mode & 0o777:04o}, and this uid ({os.geteuid()}) may neither use nor replace "
                              "it: have its owner remove it, or choose another --socket") from None
        if e.errno != errno.ECONNREFUSED:
            raise
        os.unlink(path)  # stale: nobody listens
    else:
        raise ListenError(f"another daemon is already listening on {path}: stop it or choose another --socket")
    finally:
        probe.close()


def bind_socket(path: str, mode: int) -> socket.socket:
    """Listen on `path`; a stale socket file is replaced, a live daemon is not.  ListenError (one line) where
    that cannot be done, and then nothing this call made is left behind."""
    parent = os.path.dirname(os.path.abspath(path))  # (bound as given: a relative path may fit sun_path)
    made: list[str] = []
    bound = False
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        made = _made_dirs(path, parent)
        _replace_stale(path)
        old = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        bound = True
        os.chmod(path, mode)
        sock.listen(128)
        return sock
    except (OSError, ListenError) as e:
        sock.close()
        if bound:
            with contextlib.suppress(OSError):
                os.unlink(path)
        for d in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(d)
        if isinstance(e, ListenError):
            raise
        what = e.strerror or str(e)
        if e.filename and e.filename != path:
            what = f"{e.filename}: {what}"
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            todo = f"run vramd as a user that may write {parent}, or choose another --socket"
        elif len(os.fsencode(path)) >= UNIX_PATH_MAX:
            todo = f"a unix socket's path has at most {UNIX_PATH_MAX - 1} bytes: choose a shorter --socket"
        else:
            todo = "choose another --socket"
        raise ListenError(f"cannot listen on {path}: {what}; {todo}") from None


async def run(cfg: DaemonConfig, reload: Callable[[], DaemonConfig] | None = None) -> int:
    inherited = systemd.listen_fds()
    if inherited:
        listener, path = inherited[0], None
        for extra in inherited[1:]:
            extra.close()
    else:
        path = cfg.socket or default_socket_path()
        listener = bind_socket(path, cfg.socket_mode)
    daemon = Daemon(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.shutdown)
    loop.add_signal_handler(signal.SIGHUP, reload_config, daemon, reload)
    log.info("listening on %s", path or "the socket passed by systemd")
    try:
        await daemon.serve(listener)
    finally:
        # Drained: a further SIGTERM must not kill the process half-way through its exit.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        listener.close()
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        daemon.engine.close()
    log.info("stopped")
    return 0


def reload_config(daemon: Daemon, reload: Callable[[], DaemonConfig] | None) -> None:
    """SIGHUP: read the configuration again and apply what can change at run time."""
    if reload is None:
        log.warning("SIGHUP: no configuration file (--config) to reload; ignored")
        return
    try:
        new = reload()
    except ConfigError as e:
        log.error("SIGHUP: configuration not reloaded (the running settings stay): %s", e)
        return
    set_log_level(new.log_level)
    for warning in new.warnings():
        log.warning("SIGHUP: %s", warning)
    daemon.reconfigure(new)


def set_log_level(level: str) -> None:
    logging.getLogger().setLevel(level.upper())


def setup_logging(level: str) -> None:
    """Log to stderr; into the journal without timestamps (journald adds them) and with priority prefixes."""
    handler = logging.StreamHandler(sys.stderr)
    if systemd.stderr_is_journal():
        handler.setFormatter(systemd.JournalFormatter("%(levelname)s %(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    set_log_level(level)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    flags = overrides(ns)
    try:
        cfg = load_config(ns.config, flags)
    except ConfigError as e:
        print(f"vramd: bad configuration: {e}", file=sys.stderr)
        return 2
    if ns.check_config:
        for warning in cfg.warnings():
            print(f"vramd: warning: {warning}", file=sys.stderr)
        sys.stdout.write(f"# vramd {__version__}: effective configuration"
                         f"{' from ' + ns.config if ns.config else ''} (defaults, file, flags)\n")
        sys.stdout.write(to_toml(cfg.effective()))
        return 0
    setup_logging(cfg.log_level)
    for warning in cfg.warnings():
        log.warning("%s", warning)
    raise_fd_limit()
    config = ns.config
    try:
        return uvloop.run(run(cfg, (lambda: load_config(config, flags)) if config else None))
    except ListenError as e:  # one line, no traceback; into the journal with its priority
        if systemd.stderr_is_journal():
            log.error("%s", e)
        else:
            print(f"vramd: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
