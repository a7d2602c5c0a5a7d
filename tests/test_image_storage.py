"""The storage under an image: full, read-only, failing, and what a crashed dump left behind.

Every OSError of image I/O reaches the client as a typed error naming the file
(NO_SPACE, READ_ONLY_FS, IO_ERROR, NOT_WRITABLE), never as INTERNAL; a failed dump
leaves nothing; the next dump into a directory removes a crashed dump's temporaries.
"""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from helpers import Workload, engine, memfd, open_dir, run

from vramd import errors, inproc
from vramd.backends import BoRef
from vramd.engine import BoSpec
from vramd.image.manifest import chunk_record
from vramd.image.names import MANIFEST_NAME
from vramd.testing.seams import intercept_copies, python_copier

MiB = 1 << 20


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs (needs root and mount rights): (path, mount options) -> mounted dir."""
    mounted = []

    def mount(options: str):
        d = tmp_path / f"fs{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "none", str(d)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or 'mount refused'})")
        mounted.append(d)
        return d
    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def _dump(dfd, size, chunk=MiB):
    fd = memfd(os.urandom(size))

    async def go():
        async with engine(staging_budget=16 * MiB, chunk_size=chunk) as e:
            return await inproc.dump(e, dfd, [BoSpec(1, size, BoRef("mmap", fd))])
    try:
        return run(go())
    finally:
        os.close(fd)


def test_a_full_filesystem_is_no_space_naming_the_file(small_fs):
    d = small_fs("size=2m")
    dfd = open_dir(d)
    try:
        with pytest.raises(errors.NoSpaceError) as ei:
            _dump(dfd, 4 * MiB)  # random bytes: 4 MiB cannot fit in 2
    finally:
        os.close(dfd)
    assert ".vrd.tmp" in str(ei.value) and "No space left" in str(ei.value)
    assert os.listdir(d) == []  # no partial image, no temporaries


def test_no_space_reaches_a_client_of_the_daemon_as_its_code(small_fs, daemon):
    from vramd.client import SESSION_DUMP, Client, ClientBo
    d = small_fs("size=2m")
    dfd = open_dir(d)
    fd = memfd(os.urandom(4 * MiB))
    try:
        with Client(daemon.socket, timeout=60) as c, pytest.raises(errors.VramdError) as ei:
            c.run_session(SESSION_DUMP, dfd, [ClientBo(1, fd, size=4 * MiB, backend="mmap")])
    finally:
        os.close(fd)
        os.close(dfd)
    assert ei.value.code == "NO_SPACE" and ".vrd.tmp" in ei.value.message
    assert os.listdir(d) == []


def test_a_read_only_filesystem_is_read_only_fs(small_fs):
    d = small_fs("size=2m,ro")
    dfd = open_dir(d)
    try:
        with pytest.raises(errors.ReadOnlyFsError) as ei:
            _dump(dfd, MiB)
    finally:
        os.close(dfd)
    assert ".lock" in str(ei.value)  # the first file a dump creates: its lock


def _failing(monkeypatch, name: str, err: int, when=lambda *a: True):
    real = getattr(os, name)

    def fail(*a, **kw):
        if when(*a):
            raise OSError(err, os.strerror(err))
        return real(*a, **kw)
    monkeypatch.setattr(os, name, fail)


def test_an_io_error_writing_is_io_error_naming_the_file(image_dir, monkeypatch):
    path, dfd = image_dir
    _failing(monkeypatch, "pwritev", errno.EIO, lambda fd, iov, off: off > 0)  # the records, not the header
    with pytest.raises(errors.ImageIoError) as ei:
        _dump(dfd, 2 * MiB)
    assert ".vrd.tmp" in str(ei.value) and ei.value.bo_id == 1
    assert os.listdir(path) == []


class _SyncFileRange:
    """vramd.image.writer's libc, with sync_file_range counted (and failing with `err`, where given)."""

    def __init__(self, err: int = 0) -> None:
        from vramd.hostmem.libc import libc
        self.real, self.err, self.calls = libc, err, 0

    def sync_file_range(self, fd, offset, nbytes, flags):
        from vramd.hostmem.libc import SYNC_FILE_RANGE_WRITE, ffi
        assert flags == SYNC_FILE_RANGE_WRITE  # start writing back; never wait in a copy thread
        self.calls += 1
        if self.err:
            ffi.errno = self.err
            return -1
        return self.real.sync_file_range(fd, offset, nbytes, flags)


@pytest.mark.parametrize("err", [0, errno.EINVAL, errno.EIO])
def test_a_dump_starts_writing_its_data_back_as_it_goes(image_dir, monkeypatch, err):
    """Every WRITEBACK_EVERY bytes through the page cache, the data file's writeback is started, so the
    commit's fsync finds little left to write.  A file system without it (EINVAL) is not asked again; an
    error it reports (EIO) is the dump's, naming the file: the fsync may never see that error again."""
    from vramd.image import writer
    spy = _SyncFileRange(err)
    monkeypatch.setattr(writer, "libc", spy)
    if err == errno.EIO:
        with pytest.raises(errors.ImageIoError) as ei:
            _dump(image_dir[1], 8 * MiB, chunk=128 << 10)  # pieces below DIRECT_MIN: written buffered
        assert ".vrd.tmp" in str(ei.value) and ei.value.bo_id == 1
        return
    m = _dump(image_dir[1], 8 * MiB, chunk=128 << 10)
    assert m.totals.stored_bytes == 8 * MiB
    assert spy.calls == 1 if err else spy.calls >= (8 * MiB) // writer.WRITEBACK_EVERY - 1


@pytest.mark.parametrize("flavour", ["python", "native"])
def test_an_io_error_reading_is_io_error_naming_file_bo_and_offset(image_dir, monkeypatch, flavour):
    """Both read paths: the three stages and the Python batch copier read with os.preadv (failed here);
    the C batch copier's pread cannot be patched, so its errno is injected into the outcome of its first
    batch of record reads."""
    from vramd.hostmem import batchcopy
    from vramd.hostmem.batchcopy import RECORD
    _path, dfd = image_dir
    m = _dump(dfd, 3 * MiB)
    if flavour == "python":
        seam = python_copier()
        # the records, not the header (the cache probe passes preadv flags)
        _failing(monkeypatch, "preadv", errno.EIO, lambda fd, views, off, *flags: off >= 32)
    else:
        if not batchcopy.NATIVE:
            pytest.skip("vramd.hostmem._copy is not built (needs <xxhash.h>: libxxhash-dev)")

        def eio(copies, flags, run):
            outcomes, failed = run(copies, flags)
            if not flags & RECORD:
                return outcomes, failed
            outcomes[0] = outcomes[0]._replace(err=errno.EIO, done=0)
            return outcomes, 0
        seam = intercept_copies(eio)

    async def go():
        async with engine(staging_budget=16 * MiB) as e:
            await inproc.verify(e, dfd)
    with pytest.raises(errors.ImageIoError) as ei, seam:
        run(go())
    assert ei.value.bo_id == 1 and ei.value.offset is not None
    fi, *_ = chunk_record(m, m.bos[0], ei.value.offset // m.chunk_size)
    assert m.files[fi].name in str(ei.value)  # the data file holding that chunk's record (of the GPU's stripes)


def test_a_directory_that_may_not_be_written_is_not_writable(image_dir, monkeypatch):
    path, dfd = image_dir
    real = os.open

    def deny(name, flags, *a, **kw):
        if isinstance(name, str) and name.endswith(".tmp") and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return real(name, flags, *a, **kw)
    monkeypatch.setattr(os, "open", deny)
    with pytest.raises(errors.NotWritableError) as ei:
        _dump(dfd, MiB)
    assert ".vrd.tmp" in str(ei.value)
    assert os.listdir(path) == []


# --- temporaries of a crashed dump --------------------------------------------------------

KILLED_DUMP = textwrap.dedent("""
    import os, sys, uvloop
    from vramd import inproc
    from vramd.engine import Engine, EngineConfig, BoSpec
    from vramd.backends import BoRef
    pid, addr, size, dirpath = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    async def main():
        dfd = os.open(dirpath, os.O_RDONLY | os.O_DIRECTORY)
        mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        async with Engine(EngineConfig(staging_budget=16 << 20, chunk_size=1 << 20)) as e:
            s = await inproc.start_dump(e, dfd, gpu_ids=(0, 1))
            await s.add([BoSpec(1 + g, size, BoRef("procmem", mem, addr), gpu_id=g) for g in (0, 1)])
            print("mid-dump", flush=True)  # its data files made, its copies begun
            sys.stdin.readline()   # blocks the loop here until the test kills us
    uvloop.run(main())
""")


def test_the_next_dump_removes_a_killed_dumps_temporaries_and_nothing_else(image_dir, tmp_path):
    path, dfd = image_dir
    with Workload([{"size": 16 * MiB, "fill": "random"}]) as w:
        r = w.regions[0]
        p = subprocess.Popen([sys.executable, "-c", KILLED_DUMP, str(w.pid), str(r["addr"]), str(r["size"]),
                              str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "mid-dump"
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
            p.stdout.close()
            p.stdin.close()
    stale = sorted(n for n in os.listdir(path) if n != ".lock")  # .lock: the killed dump's, harmless
    assert stale and all(n.startswith("data-") and n.endswith(".vrd.tmp") for n in stale), stale
    # What is not a temporary of vramd's own naming, or not a regular file, stays.
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep me")
    keep = ["notes.tmp", "data-0123456789abcdef-00000000.vrd.tmp.bak", ".manifest.vrdm.x.tmp"]
    for n in keep:
        (path / n).write_bytes(b"user file")
    link = "data-00000000000000ff-00000000.vrd.tmp"
    os.symlink(outside, path / link)
    subdir = "data-00000000000000fe-00000000.vrd.tmp"
    os.mkdir(path / subdir)
    m = _dump(dfd, MiB)
    left = set(os.listdir(path))
    assert left == {MANIFEST_NAME, *(f.name for f in m.files), *keep, link, subdir}
    assert outside.read_bytes() == b"keep me"
