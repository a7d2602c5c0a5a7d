"""What the client machine asks of its adapter (events), and where each of its sessions stands (phases).

`ClientMachine.next_event()` returns one event at a time.  Each but `Done`
and `Failed` is answered by exactly one call before the next `next_event()`:

| event            | the adapter                                        | answers with                  |
|------------------|----------------------------------------------------|-------------------------------|
| `Send`           | sends the packet, receives one packet              | `receive` / `receive_response`|
| `OpenManifest`   | opens manifest.vrdm of image k                     | `provide_fd`                  |
| `OpenDataFile`   | opens data file NAME of image k (+ O_DIRECT twin)  | `provide_file`                |
| `BeginDump`      | learns the dump's image id (it names the files)    | `acknowledge`                 |
| `CreateDataFile` | creates GPU g's data file, stripe s (NAME.tmp)     | `provide_file`                |
| `DropDataFiles`  | removes those data files (the daemon has none)     | `acknowledge`                 |
| `CreateManifest` | creates the dump's manifest temporary              | `provide_fd`                  |
| `Commit`         | renames the dump's files into place, fsyncs        | `acknowledge`                 |
| `ReleaseFiles`   | closes the session's files (an uncommitted dump's: removed) | `acknowledge`        |
| `Done`, `Failed` | the operation's result: returns it / raises it     | (nothing: the machine is idle)|

An adapter whose step fails answers `fail(exc)` instead: the machine cleans
up (removes what it must, ends a session it cannot hand over) and then ends
the operation with `Failed(exc)`; a `Send` that did not go answers `not_sent(exc)` (the kernel refused the
packet whole: the connection is still in step) or `lost(exc)` (the transport failed: the connection is
CLOSED).  Every fd handed to the machine stays the adapter's: the machine never opens, closes or names a
file.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from ..pb import rpc_pb2 as rpc
from .client import Outgoing


class SessionPhase(enum.Enum):
    """Where a session this machine opened stands, on the client's side (`ClientMachine.phase`)."""

    OPENING = "opening"        # OpenSession answered; the files the daemon asked for being attached
    OPEN = "open"              # taking BOs (a dump: each GPU's data files are made before its first BO)
    STARTED = "started"        # Start answered: progress, wait
    COMMITTING = "committing"  # a dump's Wait answered DONE: the adapter puts its files in place


@dataclass(frozen=True)
class Send:
    """Send `packet` (its fds attached), then receive one packet and hand it to `receive`."""

    packet: Outgoing


@dataclass(frozen=True)
class OpenManifest:
    """Open manifest.vrdm of image `image` (0: the session's; k: its k-th parent) for OpenSession."""

    image: int


@dataclass(frozen=True)
class OpenDataFile:
    """Open data file `name` of image `image` (read-only) that the daemon asked for; `direct`: with its
    O_DIRECT twin where the file system allows (else the machine attaches no twin)."""

    token: str
    image: int
    name: str
    direct: bool


@dataclass(frozen=True)
class BeginDump:
    """The daemon named the dump's image: `image_id` names its files; it takes `data_files_per_gpu` per GPU."""

    token: str
    image_id: bytes
    data_files_per_gpu: int


@dataclass(frozen=True)
class CreateDataFile:
    """Create the dump's data file `stripe` of GPU `gpu_id` (as its name + ".tmp"), with its O_DIRECT twin
    where `direct` and the file system allows."""

    token: str
    gpu_id: int
    stripe: int
    direct: bool


@dataclass(frozen=True)
class DropDataFiles:
    """Remove these (gpu_id, stripe) data files the dump created: the daemon took none of them (their
    AttachFiles was refused, or never sent), so the next add_bos makes them again."""

    token: str
    files: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class CreateManifest:
    """Create the dump's manifest temporary (.manifest.vrdm.<id>.tmp), handed over with Start."""

    token: str


@dataclass(frozen=True)
class Commit:
    """The dump is DONE (its files written and fsynced): put them in place (the client's commit)."""

    token: str


@dataclass(frozen=True)
class ReleaseFiles:
    """The machine is done with the session: close its files (an uncommitted dump's are removed)."""

    token: str


@dataclass(frozen=True)
class Done:
    """The operation succeeded: `response` is its (last) response."""

    response: rpc.Response


@dataclass(frozen=True)
class Failed:
    """The operation failed with `error` (the daemon's typed error, or the adapter's, after cleanup)."""

    error: BaseException


Event = (Send | OpenManifest | OpenDataFile | BeginDump | CreateDataFile | DropDataFiles | CreateManifest | Commit
         | ReleaseFiles | Done | Failed)
