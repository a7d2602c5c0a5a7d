"""The names vramd gives the files of an image directory, as pure functions (no I/O): the manifest, the
data files (per GPU and stripe), a dump's temporaries, a child image's marks and the directory's lock.

See docs/image-format.md.  A name that does not match exactly is none of vramd's: a reader never opens, and
a dump, rm or gc never removes, anything else.
"""
from __future__ import annotations

import re

from .format import MAX_STRIPES

MANIFEST_NAME = "manifest.vrdm"


def data_file_name(image_id: bytes, gpu_id: int, stripe: int = 0) -> str:
    """A data file's name: the GPU's first (stripe 0) as every version names it; format v3's further
    stripes of the same GPU with the stripe number after it."""
    if not 0 <= stripe < MAX_STRIPES:
        raise ValueError(f"stripe {stripe} is not below {MAX_STRIPES}")
    tail = f"-{stripe:x}" if stripe else ""
    return f"data-{image_id.hex()[:16]}-{gpu_id:08x}{tail}.vrd"


# The only names a manifest may give a data file: exactly what data_file_name produces.
# A plain name of this format cannot be ".", "..", a path, or any file vramd did not write
# under this pattern, so a reader never opens, and a dump never removes, anything else.
DATA_FILE_NAME = re.compile(r"data-[0-9a-f]{16}-[0-9a-f]{8}(-[1-9a-f])?\.vrd")
# vramd's own temporaries: a dump's data files before commit, and its manifest before the rename.
DATA_FILE_TMP = re.compile(r"data-[0-9a-f]{16}-[0-9a-f]{8}(-[1-9a-f])?\.vrd\.tmp")
MANIFEST_TMP = re.compile(r"\.manifest\.vrdm\.[0-9a-f]{32}\.tmp")


# A child image's mark in each directory of its parent chain (format v2): `.child.<child image id, 32 hex>`.
# An image with marks is needed by incremental images; a dump does not replace it unless told to.
CHILD_MARK = re.compile(r"\.child\.[0-9a-f]{32}")


def child_mark_name(image_id: bytes) -> str:
    return f".child.{image_id.hex()}"


# A mark's content names its child: the child's image id and the child's directory, relative to the directory
# the mark is in and absolute, so that `vramctl rm` of the child removes only its own marks and `vramctl gc` of
# the parent can tell a stale mark (its child gone, or holding another image) from a live one: the relative
# path finds a child moved along with its parent, the absolute one a child whose parent moved alone.  Marks
# made before this content existed are empty: they name no child.
CHILD_MARK_HEAD = b"vramd child mark 1\n"
MAX_CHILD_MARK_BYTES = 16384


def child_mark_content(image_id: bytes, relative: bytes, absolute: bytes) -> bytes:
    """What a mark holds, four lines: its head, `image <32 hex>`, `path <the child's directory, relative to
    the mark's>`, `abs <the child's directory>` (a path holding a newline is not recorded: empty)."""
    rel = b"" if b"\n" in relative else relative
    ab = b"" if b"\n" in absolute else absolute
    return CHILD_MARK_HEAD + b"image " + image_id.hex().encode() + b"\npath " + rel + b"\nabs " + ab + b"\n"


def parse_child_mark(data: bytes) -> tuple[bytes, list[bytes]] | None:
    """A mark's image id and the paths it records for its child (the relative one first; empty ones left
    out), or None where it is not one this format makes (an empty, older mark too)."""
    lines = data.split(b"\n")
    if len(lines) != 5 or lines[0] + b"\n" != CHILD_MARK_HEAD or lines[4] or b"\0" in data:
        return None
    image, rel, ab = lines[1:4]
    if not (image.startswith(b"image ") and rel.startswith(b"path ") and ab.startswith(b"abs ")):
        return None
    hexid = image[6:]
    if not re.fullmatch(rb"[0-9a-f]{32}", hexid):
        return None
    return bytes.fromhex(hexid.decode()), [p for p in (rel[5:], ab[4:]) if p]


# The directory's lock (vramd/imagedir/lock.py, lock_directory): a regular file of the directory's owner, mode 0600,
# that exists while a dump, an rm or a gc holds it (and after a crash: then it is harmless).
LOCK_NAME = ".lock"

# The socket `vramctl pull --serve` listens on in the directory it fills (vramd.oci.serve; CRIU's patch 0007 looks
# for it): there until the image's files are whole; one a killed server left is removed by `vramctl rm`.
SERVE_SOCKET_NAME = ".vramd-supply.sock"


def is_data_file_name(name: str) -> bool:
    return DATA_FILE_NAME.fullmatch(name) is not None


def is_own_temporary(name: str) -> bool:
    """A name only a vramd dump creates, and only until its commit (see vramd/imagedir, sweep_temporaries)."""
    return DATA_FILE_TMP.fullmatch(name) is not None or MANIFEST_TMP.fullmatch(name) is not None


def manifest_tmp_name(image_id: bytes) -> str:
    return f".{MANIFEST_NAME}.{image_id.hex()}.tmp"
