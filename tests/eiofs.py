"""A FUSE file system that serves a directory and fails chosen I/O with EIO (the fault matrix's I/O errors).

    python tests/eiofs.py SOURCE MOUNTPOINT [--read-eio NAME:START:END] [--write-eio NAME_PREFIX:START]

Every file operation passes through to SOURCE, except:
  --read-eio NAME:START:END    a read of file NAME that touches bytes [START, END) fails with EIO;
  --write-eio PREFIX:START     a write at or past byte START of a file whose name starts with PREFIX fails
                               with EIO (the disk going bad under a dump).
Prints "ready" on stdout once the kernel has mounted it (FUSE's init), then serves until unmounted.
Needs root (libfuse 2 mounts directly), /dev/fuse, libfuse2 and fusepy.
"""
from __future__ import annotations

import argparse
import errno
import os
import sys

from fuse import FUSE, FuseOSError, Operations  # type: ignore[import-not-found]


class EioFs(Operations):  # type: ignore[misc]
    def __init__(self, root: str, read_eio: list[tuple[str, int, int]], write_eio: list[tuple[str, int]]) -> None:
        self.root = root
        self.read_eio = read_eio
        self.write_eio = write_eio

    def _p(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def init(self, path: str) -> None:
        print("ready", flush=True)

    # --- metadata ---------------------------------------------------------
    def getattr(self, path: str, fh: int | None = None) -> dict[str, int]:
        st = os.lstat(self._p(path))
        return {k: getattr(st, k) for k in ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink",
                                            "st_size", "st_uid")}

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._p(path))]

    def access(self, path: str, mode: int) -> None:
        if not os.access(self._p(path), mode):
            raise FuseOSError(errno.EACCES)

    def statfs(self, path: str) -> dict[str, int]:
        st = os.statvfs(self._p(path))
        return {k: getattr(st, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                                            "f_files", "f_flag", "f_frsize", "f_namemax")}

    def rename(self, old: str, new: str) -> None:
        os.rename(self._p(old), self._p(new))

    def unlink(self, path: str) -> None:
        os.unlink(self._p(path))

    def mkdir(self, path: str, mode: int) -> None:
        os.mkdir(self._p(path), mode)

    def rmdir(self, path: str) -> None:
        os.rmdir(self._p(path))

    def chmod(self, path: str, mode: int) -> None:
        os.chmod(self._p(path), mode)

    def utimens(self, path: str, times: tuple[float, float] | None = None) -> None:
        os.utime(self._p(path), times)

    # --- files ------------------------------------------------------------
    def open(self, path: str, flags: int) -> int:
        return os.open(self._p(path), flags & ~(os.O_DIRECT | os.O_NOFOLLOW | os.O_NONBLOCK))

    def create(self, path: str, mode: int, fi: object = None) -> int:
        return os.open(self._p(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        name = path.lstrip("/")
        for n, start, end in self.read_eio:
            if n == name and offset < end and offset + size > start:
                raise FuseOSError(errno.EIO)
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        name = path.lstrip("/")
        for prefix, start in self.write_eio:
            if name.startswith(prefix) and offset + len(data) > start:
                raise FuseOSError(errno.EIO)
        return os.pwrite(fh, data, offset)

    def truncate(self, path: str, length: int, fh: int | None = None) -> None:
        os.truncate(self._p(path), length)

    def flush(self, path: str, fh: int) -> None:
        return None

    def fsync(self, path: str, datasync: int, fh: int) -> None:
        os.fsync(fh)

    def fsyncdir(self, path: str, datasync: int, fh: int) -> None:
        return None

    def release(self, path: str, fh: int) -> None:
        os.close(fh)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("source")
    ap.add_argument("mountpoint")
    ap.add_argument("--read-eio", action="append", default=[])
    ap.add_argument("--write-eio", action="append", default=[])
    ns = ap.parse_args()
    reads = [(n, int(a), int(b)) for n, a, b in (x.rsplit(":", 2) for x in ns.read_eio)]
    writes = [(p, int(a)) for p, a in (x.rsplit(":", 1) for x in ns.write_eio)]
    # direct_io: every read and write reaches us with the caller's own offset and size (no page cache,
    # no readahead), so only the I/O that touches a chosen range fails
    FUSE(EioFs(os.path.abspath(ns.source), reads, writes), ns.mountpoint, foreground=True, nothreads=True,
         default_permissions=True, allow_other=True, direct_io=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
