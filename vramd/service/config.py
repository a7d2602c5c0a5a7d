"""Daemon configuration: defaults, a TOML file, then command-line flags.

    # /etc/vramd/vramd.toml (contrib/systemd/vramd.toml lists every setting)
    socket = "/run/vramd/vramd.sock"   # ignored under socket activation
    staging_budget = "512M"
    chunk_size = "8M"
    compression = "auto"
    inflight_per_gpu = 4               # batches in flight per GPU (0: from the core count)
    copy_threads = 2                   # threads doing CPU copies (0: the core count)
    allowed_uids = [0]                 # the daemon's own uid is always allowed
    allowed_groups = ["vramd"]
    grace_period = 30                  # seconds a session outlives its last connection
    drain_timeout = 30                 # seconds SIGTERM waits for running sessions
    metrics_textfile = "/var/lib/prometheus/node-exporter/vramd.prom"
    hello_timeout = 5                  # seconds a new connection has to say Hello
    [topology_checks]                  # CRIU's KFD_*_CHECK switches, for every restore (a request may override)
    KFD_FW_VER_CHECK = false

Sizes take the same forms as everywhere in vramd (4096, 0x1000, 8M, 1G).
"""
from __future__ import annotations

import dataclasses
import grp
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..image.codec import Compression
from ..protocol.frames import DEFAULT_MAX_MESSAGE, SCM_MAX_FD
from ..topology import CHECK_ENV, DEFAULT_ROOT
from ..units import MiB, parse_size

DEFAULT_GROUP = "vramd"


@dataclass
class DaemonConfig:
    socket: str | None = None          # None: default_socket_path()
    socket_mode: int = 0o660
    staging_budget: int = 512 * MiB
    chunk_size: int = 8 * MiB
    compression: str = "auto"
    inflight_per_gpu: int = 0  # 0: chosen from the core count (EngineConfig)
    copy_threads: int = 0      # 0: the core count
    workers_per_gpu: int | None = None  # the old name of inflight_per_gpu, still accepted
    io_threads: int = 4
    allowed_uids: list[int] = field(default_factory=lambda: sorted({0, os.getuid()}))
    allowed_groups: list[str | int] = field(default_factory=lambda: [DEFAULT_GROUP])
    grace_period: float = 30.0
    drain_timeout: float = 30.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE
    max_fds_per_message: int = SCM_MAX_FD
    max_bos_per_session: int = 16_384      # daemon memory and commit time per BO: docs/protocol.md, Limits
    max_fds_per_session: int = 16_385      # one per BO and the directory
    max_chunks_per_session: int = 1 << 20  # a dump's declared bytes / chunk_size: about 100 bytes each
    max_sessions_per_uid: int = 64
    max_bos_per_uid: int = 65_536          # across the uid's sessions, ended but unclosed ones included
    max_fds_per_uid: int = 65_536          # fds held by the uid's sessions
    max_connections: int = 1024
    max_connections_per_uid: int = 256
    max_queued_requests: int = 16          # per connection, read ahead of the one being handled
    hello_timeout: float = 5.0             # seconds a new connection has to send Hello
    gpu_ids: list[int] = field(default_factory=list)  # with no KFD topology: gpu_ids allowed besides 0
    topology_checks: dict[str, bool] = field(default_factory=dict)  # CRIU's KFD_*_CHECK names -> on/off
    metrics_textfile: str | None = None
    metrics_interval: float = 15.0
    topology_root: str = DEFAULT_ROOT  # KFD topology (a fixture tree in tests)
    sdma: bool = True
    sdma_library: str | None = None  # None: $VRAMD_AMDGPU_LIBRARY; "" the system libdrm_amdgpu; "model"; a path

    SIZE_KEYS: ClassVar[tuple[str, ...]] = ("staging_budget", "chunk_size", "max_message_bytes")

    def update(self, values: dict[str, Any], *, origin: str) -> None:
        names = {f.name for f in dataclasses.fields(self)}
        for key, value in values.items():
            key = key.replace("-", "_")
            if key not in names:
                raise ValueError(f"{origin}: unknown setting {key!r}")
            if key in self.SIZE_KEYS and isinstance(value, str):
                value = parse_size(value)
            if key == "socket_mode" and isinstance(value, str):
                value = int(value, 8)
            setattr(self, key, value)

    def check(self) -> None:
        Compression.parse(self.compression)
        if not 0 < self.max_fds_per_message <= SCM_MAX_FD:
            raise ValueError(f"max_fds_per_message must be 1..{SCM_MAX_FD}")
        if self.max_message_bytes < 4096:
            raise ValueError("max_message_bytes must be at least 4096")
        if self.grace_period < 0 or self.drain_timeout < 0:
            raise ValueError("grace_period and drain_timeout must not be negative")
        if self.hello_timeout <= 0:
            raise ValueError("hello_timeout must be positive")
        for key in ("max_bos_per_session", "max_fds_per_session", "max_chunks_per_session", "max_sessions_per_uid",
                    "max_bos_per_uid", "max_fds_per_uid", "max_connections", "max_connections_per_uid",
                    "max_queued_requests"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be at least 1")
        for name, value in self.topology_checks.items():
            if name not in CHECK_ENV.values() or not isinstance(value, bool):
                raise ValueError(f"topology_checks: {name!r} = {value!r}: expected one of "
                                 f"{', '.join(sorted(CHECK_ENV.values()))} = true/false")

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


def load_config(path: str | None, overrides: dict[str, Any]) -> DaemonConfig:
    cfg = DaemonConfig()
    if path:
        with open(path, "rb") as f:
            cfg.update(tomllib.load(f), origin=path)
    cfg.update({k: v for k, v in overrides.items() if v is not None}, origin="command line")
    cfg.check()
    return cfg
