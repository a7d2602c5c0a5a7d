"""Daemon configuration: defaults, a TOML file, then command-line flags.

    # /etc/vramd/vramd.toml (contrib/systemd/vramd.toml lists every setting)
    socket = "/run/vramd/vramd.sock"   # ignored under socket activation
    socket_mode = "0660"               # a string of octal digits (a TOML integer is refused)
    staging_budget = "512M"
    chunk_size = "8M"
    compression = "auto"
    inflight_per_gpu = 4               # batches in flight per GPU (0: from the core count)
    copy_threads = 2                   # threads doing CPU copies (0: the core count)
    allowed_uids = [0]                 # the daemon's own uid is always allowed
    allowed_groups = ["vramd"]
    grace_period = 30                  # seconds a session outlives its last connection (not a dump whose opener left)
    max_hold = 3600                    # seconds a restore may ask to be kept instead (the CRIU offload; 0: none)
    drain_timeout = 30                 # seconds SIGTERM waits for running sessions
    metrics_textfile = "/var/lib/prometheus/node-exporter/vramd.prom"
    metrics_interval = 15              # seconds between rewrites of metrics_textfile
    hello_timeout = 5                  # seconds a new connection has to say Hello
    log_level = "info"                 # debug, info, warning, error
    [topology_checks]                  # CRIU's KFD_*_CHECK switches, for every restore (a request may override)
    KFD_FW_VER_CHECK = false

Sizes take the same forms as everywhere in vramd (4096, 0x1000, 8M, 1G).
Validation is strict: every key has a type and a range (`KEYS`), an unknown
key, a wrong type or a value out of range is a `ConfigError` naming the key,
and a file with one never starts a daemon.  On SIGHUP the daemon re-reads its
file and applies the keys in `RELOADABLE` (see docs/protocol.md, Configuration).
"""
from __future__ import annotations

import dataclasses
import difflib
import grp
import math
import os
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..engine.engine import DEFAULT_CHUNK_SIZE, EngineConfig
from ..image.codec import Compression
from ..image.format import MAX_STRIPES
from ..protocol.frames import DEFAULT_MAX_MESSAGE, SCM_MAX_FD
from ..topology import CHECK_ENV, DEFAULT_ROOT
from ..units import PAGE, MiB, parse_size
from .tomltext import show as _show
from .tomltext import to_toml as to_toml  # (--check-config's output; imported from here)
from .usage import dump_fds

DEFAULT_GROUP = "vramd"
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """A setting that cannot be used; str() is one line naming the key."""

    def __init__(self, origin: str, key: str, problem: str) -> None:
        super().__init__(f"{origin}: {key}: {problem}")
        self.origin, self.key, self.problem = origin, key, problem


def _type_name(v: object) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "a table"}.get(type(v), type(v).__name__)


def _int(lo: int, hi: int | None = None) -> Callable[[object], int]:
    def conv(v: object) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"expected an integer, got {_type_name(v)} {_show(v)}")
        if v < lo or (hi is not None and v > hi):
            raise ValueError(f"{v} is out of range ({lo}..{hi if hi is not None else ''})")
        return v
    return conv


def _seconds(lo: float, *, positive: bool = False) -> Callable[[object], float]:
    def conv(v: object) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"expected a number of seconds, got {_type_name(v)} {_show(v)}")
        f = float(v)
        if not math.isfinite(f) or f < lo or (positive and f <= 0):
            raise ValueError(f"{_show(v)} seconds is out of range (must be {'> 0' if positive else f'>= {lo:g}'})")
        return f
    return conv


def _size(lo: int, hi: int | None = None, *, page: bool = False) -> Callable[[object], int]:
    def conv(v: object) -> int:
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise ValueError(f"expected a size (4096, \"0x1000\", \"8M\"), got {_type_name(v)} {_show(v)}")
        n = parse_size(v)  # ValueError on a negative or malformed one
        if n < lo or (hi is not None and n > hi):
            raise ValueError(f"{_show(v)} is out of range ({lo}..{hi if hi is not None else ''} bytes)")
        if page and n % PAGE:
            raise ValueError(f"{_show(v)} is not a multiple of {PAGE} bytes")
        return n
    return conv


def _mode(v: object) -> int:
    # A TOML integer 660 is decimal 660 (0o1224): refused rather than guessed at.
    if not isinstance(v, str):
        raise ValueError(f"expected a string of octal digits such as \"0660\", got {_type_name(v)} {_show(v)}")
    text = v.removeprefix("0o")
    if not text or any(c not in "01234567" for c in text) or int(text, 8) > 0o777:
        raise ValueError(f"{_show(v)} is not an octal mode between \"0000\" and \"0777\"")
    return int(text, 8)


def _str(*, optional: bool = False, nonempty: bool = True) -> Callable[[object], str | None]:
    def conv(v: object) -> str | None:
        if not isinstance(v, str):
            raise ValueError(f"expected a string, got {_type_name(v)} {_show(v)}")
        if nonempty and not v and not optional:
            raise ValueError("must not be empty")
        return v or None if optional else v
    return conv


def _bool(v: object) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false, got {_type_name(v)} {_show(v)}")
    return v


def _compression(v: object) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string such as \"zstd:3\", got {_type_name(v)} {_show(v)}")
    try:
        Compression.parse(v)
    except Exception as e:  # whatever the codec parser says, as one line
        raise ValueError(str(e).splitlines()[0] if str(e) else f"{_show(v)} is not a compression") from None
    return v


def _log_level(v: object) -> str:
    if not isinstance(v, str) or v.lower() not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}, got {_show(v)}")
    return v.lower()


def _list(item: Callable[[object], Any], what: str) -> Callable[[object], list[Any]]:
    def conv(v: object) -> list[Any]:
        if not isinstance(v, list):
            raise ValueError(f"expected an array of {what}, got {_type_name(v)} {_show(v)}")
        out = []
        for x in v:
            try:
                out.append(item(x))
            except ValueError as e:
                raise ValueError(f"element {_show(x)}: {e}") from None
        return out
    return conv


def _group(v: object) -> str | int:
    if isinstance(v, str) and v:
        return int(v) if v.isdigit() else v
    return _int(0, 2**32 - 2)(v)


def _checks(v: object) -> dict[str, bool]:
    if not isinstance(v, dict):
        raise ValueError(f"expected a table of CRIU switch = true/false, got {_type_name(v)} {_show(v)}")
    names = sorted(CHECK_ENV.values())
    for name, on in v.items():
        if name in KEYS:  # appended to a file whose last table is this one
            raise ValueError(f"{name} = {_show(on)}: this key belongs at the top level, above the "
                             "[topology_checks] header (in TOML every key after a [table] header is in that table)")
        if name not in names or not isinstance(on, bool):
            raise ValueError(f"{name} = {_show(on)}: expected one of {', '.join(names)} = true/false"
                             + ("" if name in names else _did_you_mean(name, names)))
    return dict(v)


def _did_you_mean(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


_UID = _int(0, 2**32 - 2)
_COUNT = _int(1, 2**31 - 1)

# key -> converter (type and range); every key of DaemonConfig is here
KEYS: dict[str, Callable[[object], Any]] = {
    "socket": _str(optional=True),
    "socket_mode": _mode,
    "staging_budget": _size(PAGE, page=False),
    "staging_huge_pages": _bool,
    "chunk_size": _size(PAGE, 1 << 30, page=True),
    "compression": _compression,
    "inflight_per_gpu": _int(0, 4096),
    "copy_threads": _int(0, 4096),
    "dump_inflight_per_gpu": _int(0, 4096),
    "device_inflight_per_gpu": _int(0, 4096),
    "data_files_per_gpu": _int(0, MAX_STRIPES),
    "workers_per_gpu": _int(1, 4096),
    "io_threads": _int(1, 4096),
    "allowed_uids": _list(_UID, "uids"),
    "allowed_groups": _list(_group, "group names or gids"),
    "grace_period": _seconds(0),
    "max_hold": _seconds(0),
    "drain_timeout": _seconds(0),
    "max_message_bytes": _size(4096, 1 << 30),
    "max_fds_per_message": _int(2, SCM_MAX_FD),  # a data file and its O_DIRECT twin travel in one AttachFiles
    "max_bos_per_session": _COUNT,
    "max_fds_per_session": _COUNT,
    "max_chunks_per_session": _COUNT,
    "max_sessions_per_uid": _COUNT,
    "max_bos_per_uid": _COUNT,
    "max_fds_per_uid": _COUNT,
    "max_connections": _COUNT,
    "max_connections_per_uid": _COUNT,
    "max_queued_requests": _COUNT,
    "hello_timeout": _seconds(0, positive=True),
    "gpu_ids": _list(_int(0, 2**32 - 1), "gpu_ids"),
    "topology_checks": _checks,
    "metrics_textfile": _str(optional=True),
    "metrics_interval": _seconds(0, positive=True),
    "topology_root": _str(),
    "sdma": _bool,
    "sdma_library": _str(nonempty=False),
    "supply_notes": _bool,
    "log_level": _log_level,
}

# What SIGHUP applies to a running daemon; any other key changed in the file waits for a restart.
RELOADABLE = ("log_level", "allowed_uids", "allowed_groups", "grace_period", "max_hold", "drain_timeout",
              "hello_timeout", "max_connections", "max_connections_per_uid", "metrics_textfile", "metrics_interval")


@dataclass
class DaemonConfig:
    socket: str | None = None          # None: default_socket_path()
    socket_mode: int = 0o660
    staging_budget: int = 512 * MiB
    staging_huge_pages: bool = True    # staging buffers on transparent huge pages where the kernel has them
    chunk_size: int = DEFAULT_CHUNK_SIZE
    compression: str = "auto"
    inflight_per_gpu: int = 0  # 0: chosen from the core count (EngineConfig)
    copy_threads: int = 0      # 0: the core count
    dump_inflight_per_gpu: int = 0  # 0: inflight_per_gpu, at most 4 (EngineConfig)
    device_inflight_per_gpu: int = 0  # 0: 2 (EngineConfig)
    data_files_per_gpu: int = 0  # a dump's data files per GPU; 0: the fewer of copy_threads and dump_inflight_per_gpu
    workers_per_gpu: int | None = None  # the old name of inflight_per_gpu, still accepted
    io_threads: int = 4
    allowed_uids: list[int] = field(default_factory=lambda: sorted({0, os.getuid()}))
    allowed_groups: list[str | int] = field(default_factory=lambda: [DEFAULT_GROUP])
    grace_period: float = 30.0
    max_hold: float = 3600.0               # the most seconds a restore's OpenSession.hold_s is granted
    drain_timeout: float = 30.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE
    max_fds_per_message: int = SCM_MAX_FD
    max_bos_per_session: int = 16_384      # daemon memory and commit time per BO: docs/protocol.md, Limits
    max_fds_per_session: int = 17_408      # one per distinct BO fd, plus the image's files (docs/protocol.md, Limits)
    max_chunks_per_session: int = 1 << 20  # a dump's declared bytes / chunk_size: about 100 bytes each
    max_sessions_per_uid: int = 64
    max_bos_per_uid: int = 65_536          # across the uid's sessions, ended but unclosed ones included
    max_fds_per_uid: int = 65_536          # fds held by the uid's sessions and its requests not yet handled
    max_connections: int = 1024
    max_connections_per_uid: int = 256
    max_queued_requests: int = 16          # per connection, read ahead of the one being handled
    hello_timeout: float = 5.0             # seconds a new connection has to send Hello
    gpu_ids: list[int] = field(default_factory=list)  # with no KFD topology: gpu_ids allowed besides 0
    topology_checks: dict[str, bool] = field(default_factory=dict)  # CRIU's KFD_*_CHECK names -> on/off
    metrics_textfile: str | None = None
    metrics_interval: float = 15.0         # seconds between rewrites of metrics_textfile
    topology_root: str = DEFAULT_ROOT  # KFD topology (a fixture tree in tests)
    sdma: bool = True
    sdma_library: str | None = None  # None: $VRAMD_AMDGPU_LIBRARY; "" the system libdrm_amdgpu; "model"; a path
    log_level: str = "info"
    # notes back over a streamed session's supply socket, said in HelloReply.supply_notes; false: as a daemon
    # built before them (never written to; what a client does against one is tested with it)
    supply_notes: bool = True

    def update(self, values: dict[str, Any], *, origin: str) -> None:
        """Apply `values` (a TOML document or flags), each checked by KEYS; ConfigError names the first bad one."""
        for key, value in values.items():
            key = key.replace("-", "_")
            conv = KEYS.get(key)
            if conv is None:
                raise ConfigError(origin, key, "unknown setting" + _did_you_mean(key, KEYS))
            try:
                setattr(self, key, conv(value))
            except ValueError as e:
                raise ConfigError(origin, key, str(e)) from None

    def check(self, origin: str = "configuration") -> None:
        """What no single key can say: the relations between them.  Every rule the engine and the sessions apply
        to these settings when a dump or restore runs is checked here, by the very code they run
        (`EngineConfig.problems`, `EngineConfig.default_job_problems`, `usage.dump_fds`), so a configuration
        this accepts never makes every dump fail."""
        if self.staging_budget < self.chunk_size:
            raise ConfigError(origin, "staging_budget",
                              f"{self.staging_budget} bytes is less than one chunk (chunk_size = {self.chunk_size})")
        try:
            engine = self.engine_config()
        except ValueError as e:  # the compression: checked by its key already
            raise ConfigError(origin, "compression", str(e)) from None
        for names, problem in (*engine.problems(), *engine.default_job_problems()):
            raise ConfigError(origin, names, problem)
        need = dump_fds(engine.data_files_per_gpu)
        for key in ("max_fds_per_session", "max_fds_per_uid"):
            if getattr(self, key) < need:
                raise ConfigError(origin, key, f"{getattr(self, key)} is less than the {need} fds the smallest "
                                  f"dump holds ({engine.data_files_per_gpu} data file(s) per GPU, one BO's fd and "
                                  "the manifest's; with O_DIRECT, each data file's twin too)")

    def engine_config(self, **extra: Any) -> EngineConfig:
        """The engine's settings from these (`extra`: what the daemon adds, e.g. the render nodes)."""
        return EngineConfig(
            staging_budget=self.staging_budget, staging_huge_pages=self.staging_huge_pages,
            chunk_size=self.chunk_size, workers_per_gpu=self.workers_per_gpu,
            inflight_per_gpu=self.inflight_per_gpu, copy_threads=self.copy_threads,
            dump_inflight_per_gpu=self.dump_inflight_per_gpu, device_inflight_per_gpu=self.device_inflight_per_gpu,
            data_files_per_gpu=self.data_files_per_gpu, compression=Compression.parse(self.compression),
            io_threads=self.io_threads, sdma=self.sdma, sdma_library=self.sdma_library,
            supply_notes=self.supply_notes, **extra)

    def effective(self) -> dict[str, Any]:
        """Every setting as a TOML-ready value (sizes in bytes, socket_mode as an octal string)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = f"{v:04o}" if f.name == "socket_mode" else v
        return out

    def warnings(self) -> list[str]:
        """What is valid but likely a mistake (--check-config prints these; the daemon logs them): a group in
        allowed_groups that does not exist lets nobody in (but the default group, vramd, which the package's
        sysusers file makes: a daemon run by hand without it is the ordinary case); a metrics_textfile whose
        directory is missing is never written."""
        out = []
        for g in self.allowed_groups:
            if isinstance(g, str) and g != DEFAULT_GROUP:
                try:
                    grp.getgrnam(g)
                except KeyError:
                    out.append(f"allowed_groups: no group {_show(g)} on this host: it lets nobody in (create it, "
                               "e.g. with groupadd, or remove it)")
        where = os.path.dirname(self.metrics_textfile or "") or "."
        if self.metrics_textfile and not os.path.isdir(where):
            out.append(f"metrics_textfile: {where} is not a directory here: no metrics will be written (create "
                       "it, or choose another path)")
        return out

    def allowed_gids(self) -> set[int]:
        """Configured groups as gids; a group name that does not exist is skipped."""
        gids: set[int] = set()
        for g in self.allowed_groups:
            if isinstance(g, int):
                gids.add(g)
                continue
            try:
                gids.add(grp.getgrnam(g).gr_gid)
            except KeyError:
                pass
        return gids


def read_file(path: str) -> dict[str, Any]:
    """The TOML document at `path`; ConfigError (one line) if it cannot be read or parsed."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(path, "(file)", e.strerror or str(e)) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(path, "(syntax)", str(e)) from None


def load_config(path: str | None, overrides: dict[str, Any]) -> DaemonConfig:
    cfg = DaemonConfig()
    if path:
        cfg.update(read_file(path), origin=path)
    cfg.update({k: v for k, v in overrides.items() if v is not None}, origin="command line")
    cfg.check(path or "command line")
    return cfg
