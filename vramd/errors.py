"""The typed errors vramd reports.

Every error carries a stable machine-readable `code` (also used as the wire
status in the RPC protocol) and, where one is involved, the BO id and byte
offset, so a client can say exactly which buffer failed where.
"""
from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any


class VramdError(Exception):
    """Root of every error vramd raises on purpose."""

    code = "VRAMD_ERROR"

    def __init__(self, message: str, *, bo_id: int | None = None, offset: int | None = None):
        self.message = message
        self.bo_id = bo_id
        self.offset = offset
        super().__init__(self.describe())

    def describe(self) -> str:
        where = []
        if self.bo_id is not None:
            where.append(f"bo {self.bo_id}")
        if self.offset is not None:
            where.append(f"offset {self.offset:#x}")
        return f"{self.message} ({', '.join(where)})" if where else self.message

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "bo_id": self.bo_id, "offset": self.offset}


# --- image format ----------------------------------------------------------

class ImageError(VramdError):
    code = "IMAGE_ERROR"


class ManifestMissingError(ImageError):
    """No committed manifest: the directory holds no image, or a dump never committed."""

    code = "MANIFEST_MISSING"


class UnsupportedVersionError(ImageError):
    code = "UNSUPPORTED_VERSION"


class CorruptManifestError(ImageError):
    code = "CORRUPT_MANIFEST"


class CorruptChunkError(ImageError):
    """A chunk record failed its checksum, magic, or consistency checks."""

    code = "CORRUPT_CHUNK"


class TruncatedDataError(ImageError):
    code = "TRUNCATED_DATA"


class ForeignDataFileError(ImageError):
    """A data file that belongs to another image (or is not a data file at all)."""

    code = "FOREIGN_DATA_FILE"


class NoSpaceError(ImageError):
    """The image's filesystem is full, or the writer's quota is (ENOSPC, EDQUOT)."""

    code = "NO_SPACE"


class ReadOnlyFsError(ImageError):
    """The image directory is on a read-only filesystem (EROFS)."""

    code = "READ_ONLY_FS"


class ImageIoError(ImageError):
    """The storage under the image reported an I/O error (EIO)."""

    code = "IO_ERROR"


class NotWritableError(ImageError):
    """The image directory or a file in it may not be written (EACCES, EPERM)."""

    code = "NOT_WRITABLE"


class ParentMissingError(ImageError):
    """An incremental image's parent (or an ancestor) was not given; the message names it."""

    code = "PARENT_MISSING"


class ParentMismatchError(ImageError):
    """A directory given as a parent is not the image the child recorded (another image, or altered)."""

    code = "PARENT_MISMATCH"


# --- backends --------------------------------------------------------------

class BackendError(VramdError):
    code = "BACKEND_ERROR"


class UnmappedRangeError(BackendError):
    """The target process has nothing mapped at the address."""

    code = "UNMAPPED_RANGE"

    address: int | None = None  # None when rebuilt from the wire

    def __init__(self, message: str, *, address: int, bo_id: int | None = None, offset: int | None = None):
        self.address = address
        super().__init__(message, bo_id=bo_id, offset=offset)


class TargetTooSmallError(BackendError):
    code = "TARGET_TOO_SMALL"


class BadDescriptorError(BackendError):
    """An fd that is closed, of the wrong kind, or opened with the wrong access mode."""

    code = "BAD_DESCRIPTOR"


class BackendUnavailableError(BackendError):
    code = "BACKEND_UNAVAILABLE"


# --- jobs ------------------------------------------------------------------

class JobError(VramdError):
    code = "JOB_ERROR"


class InvalidRequestError(JobError):
    code = "INVALID_REQUEST"


class JobCancelledError(JobError):
    """The job was cancelled (by a client, a reaped session, or shutdown).

    Named apart from asyncio.CancelledError on purpose: this one is a result
    reported to a client, that one unwinds a task."""

    code = "CANCELLED"


class IncompleteRestoreError(JobError):
    """A restore finished without a target for every BO in the image."""

    code = "INCOMPLETE_RESTORE"


# --- service (the daemon and its protocol) ---------------------------------

class ServiceError(VramdError):
    code = "VRAMD_ERROR"


class ProtocolError(ServiceError):
    """A malformed frame or message; the daemon closes that connection."""

    code = "PROTOCOL_ERROR"


class UnsupportedProtocolError(ServiceError):
    code = "UNSUPPORTED_PROTOCOL"


class PermissionDeniedError(ServiceError):
    code = "PERMISSION_DENIED"


class NotFoundError(ServiceError):
    """No such session (the daemon); on the client's side also a registry reference whose manifest the registry
    does not have (a tag, a digest or a repository: vramd.oci.registry)."""

    code = "NOT_FOUND"


class LimitExceededError(ServiceError):
    code = "LIMIT_EXCEEDED"


class ShuttingDownError(ServiceError):
    code = "SHUTTING_DOWN"


class WaitTimeoutError(ServiceError):
    """Wait's timeout expired; the session goes on."""

    code = "TIMEOUT"


class InternalError(ServiceError):
    code = "INTERNAL"


# --- GPUs ------------------------------------------------------------------

class TopologyError(VramdError):
    """The KFD topology could not be read, or a saved one is malformed."""

    code = "TOPOLOGY_ERROR"


class TopologyMismatchError(TopologyError):
    """The checkpoint's GPUs cannot be mapped onto the GPUs present; the message says why.

    `unplaced` maps each checkpoint gpu_id that could not be placed to {candidate gpu_id:
    [reasons]} (empty where the failure is not about single GPUs, e.g. unequal counts).
    """

    code = "TOPOLOGY_MISMATCH"
    unplaced: Mapping[int, Mapping[int, list[str]]] = MappingProxyType({})

    def __init__(self, message: str, *, unplaced: Mapping[int, Mapping[int, list[str]]] | None = None,
                 bo_id: int | None = None, offset: int | None = None):
        if unplaced is not None:
            self.unplaced = unplaced
        super().__init__(message, bo_id=bo_id, offset=offset)


# --- registries: the client's network side (vramd.oci), never on the daemon's wire --------

class RegistryError(VramdError):
    """A registry refused or failed a request; the message names the registry and what was asked."""

    code = "REGISTRY_ERROR"
    status: int | None = None  # the HTTP status of the registry's refusal, where it answered one


class AuthFailedError(RegistryError):
    """The registry or its token server refused the credentials: one line naming the registry and where the
    credentials came from (a file, a credential helper, the command line), never a secret."""

    code = "AUTH_FAILED"


class CredentialsError(RegistryError):
    """Credentials that could not be read: a malformed auth file, a credential helper that failed."""

    code = "CREDENTIALS_ERROR"


class TlsError(RegistryError):
    """No trusted TLS to a registry: a certificate that does not verify (the message names the host and the
    CAs trusted), or plain HTTP where it was not asked for (an http token realm)."""

    code = "TLS_ERROR"


class DigestMismatchError(RegistryError):
    """A blob or manifest whose bytes are not the digest asked for (damaged in the registry or in transit);
    for a chunk's payload the message names the BO and offset that needed it."""

    code = "DIGEST_MISMATCH"


class RegistryFullError(RegistryError):
    """The registry could not store a blob: it is out of space or over a quota."""

    code = "REGISTRY_FULL"


# --- the wire registry ------------------------------------------------------

# Every code a peer may report, with the class that stands for it on this side.
# Explicit, so that adding an error class is a conscious change of the wire
# contract (tests/test_errors.py checks it against rpc.proto's Code enum).
WIRE_ERRORS: dict[str, type[VramdError]] = {cls.code: cls for cls in (
    ProtocolError, PermissionDeniedError, NotFoundError, LimitExceededError, ShuttingDownError,
    WaitTimeoutError, InternalError, UnsupportedProtocolError,
    JobError, InvalidRequestError, JobCancelledError, IncompleteRestoreError,
    BackendError, UnmappedRangeError, TargetTooSmallError, BadDescriptorError, BackendUnavailableError,
    ImageError, ManifestMissingError, UnsupportedVersionError, CorruptManifestError, CorruptChunkError,
    TruncatedDataError, ForeignDataFileError, NoSpaceError, ReadOnlyFsError, ImageIoError, NotWritableError,
    ParentMissingError, ParentMismatchError,
    TopologyError, TopologyMismatchError,
    VramdError,
)}


# Raised on the client's side only: the network belongs to the client (vramctl, libvramd's helpers), the
# daemon never speaks to a registry, so these are not wire codes.
CLIENT_ERRORS: dict[str, type[VramdError]] = {cls.code: cls for cls in (
    RegistryError, AuthFailedError, CredentialsError, TlsError, DigestMismatchError, RegistryFullError,
)}


def error_class(code: str) -> type[VramdError]:
    """The class for a wire code (VramdError if this side knows none)."""
    return WIRE_ERRORS.get(code, VramdError)


def from_os_error(e: OSError, what: str, cls: type[VramdError] = VramdError, *, bo_id: int | None = None,
                  offset: int | None = None) -> VramdError:
    """The one translation of an OSError: `cls` with "<what>: <the system's reason>", naming the BO if any.

    `what` names the file, directory or fd involved, as the caller knows it."""
    return cls(f"{what}: {e.strerror or e}", bo_id=bo_id, offset=offset)


def error_from_wire(code: str, message: str, bo_id: int | None = None, offset: int | None = None) -> VramdError:
    """Rebuild the typed error a peer reported (its own constructor is not run: only the wire fields exist)."""
    cls = error_class(code)
    exc = cls.__new__(cls)
    VramdError.__init__(exc, message, bo_id=bo_id, offset=offset)
    exc.code = code  # kept even when this side knows no class for it
    return exc

