"""The typed errors vramd reports.

Every error carries a stable machine-readable `code` (also used as the wire
status in the RPC protocol) and, where one is involved, the BO id and byte
offset, so a client can say exactly which buffer failed where.
"""
from __future__ import annotations


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

    def to_dict(self) -> dict:
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


# --- backends --------------------------------------------------------------

class BackendError(VramdError):
    code = "BACKEND_ERROR"


class UnmappedRangeError(BackendError):
    """The target process has nothing mapped at the address."""

    code = "UNMAPPED_RANGE"

    def __init__(self, message: str, *, address: int, **kw):
        self.address = address
        super().__init__(message, **kw)


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


class CancelledError(JobError):
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


def _subclasses(cls: type) -> list[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out += _subclasses(sub)
    return out


def error_class(code: str) -> type[VramdError]:
    """The most specific error class for a wire code (VramdError if unknown)."""
    __import__("vramd.topology")  # its errors subclass VramdError
    for cls in _subclasses(VramdError):
        if cls.code == code and cls is not ServiceError:
            return cls
    return VramdError


def error_from_wire(code: str, message: str, bo_id: int | None = None, offset: int | None = None) -> VramdError:
    """Rebuild the typed error a peer reported."""
    cls = error_class(code)
    exc = cls.__new__(cls)
    if cls is UnmappedRangeError:
        exc.address = None
    VramdError.__init__(exc, message, bo_id=bo_id, offset=offset)
    exc.code = code  # kept even when this side knows no class for it
    return exc
