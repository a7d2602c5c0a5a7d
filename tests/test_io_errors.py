"""The fault matrix's I/O errors (issue #12): storage that fails with EIO under a restore or a dump.

The image is served through a FUSE file system (tests/eiofs.py) that fails chosen reads or writes with
EIO, so a real daemon meets a real EIO from the kernel.  Each case ends with one typed IO_ERROR naming
the file (and the BO and offset it cost), no committed image from a failed dump, and the daemon serving
the next client.  Needs root, /dev/fuse, libfuse2 and fusepy; skipped with the reason otherwise.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import engine, memfd, open_dir, run

from vramd import errors, inproc
from vramd.backends import BoRef
from vramd.client import SESSION_DUMP, SESSION_RESTORE, Client, ClientBo
from vramd.engine import BoSpec
from vramd.image.codec import Compression
from vramd.image.manifest import chunk_record
from vramd.image.names import MANIFEST_NAME

CHUNK = 256 << 10
HERE = Path(__file__).parent

why = ("needs root" if os.geteuid() != 0 else "needs /dev/fuse" if not os.path.exists("/dev/fuse")
       else "needs fusepy (the test extra) and libfuse2" if importlib.util.find_spec("fuse") is None else "")
if not why:
    try:
        import fuse  # noqa: F401  (loads libfuse.so.2)
    except OSError:
        why = "needs libfuse2 (Debian: libfuse2)"
pytestmark = pytest.mark.skipif(bool(why), reason=why or "")


@contextmanager
def eio_mount(source: Path, mountpoint: Path, *args: str):
    """`source` served at `mountpoint`, failing what `args` say (tests/eiofs.py), until the block ends."""
    mountpoint.mkdir()
    p = subprocess.Popen([sys.executable, str(HERE / "eiofs.py"), str(source), str(mountpoint), *args],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"  # FUSE's init: the kernel has it mounted
        yield
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)
        p.wait(timeout=30)
        p.stdout.close()


def _dump(dfd, data):
    fds = {i: memfd(d) for i, d in data.items()}

    async def go():
        async with engine(staging_budget=16 << 20, chunk_size=CHUNK) as e:
            return await inproc.dump(e, dfd, [BoSpec(i, len(d), BoRef("mmap", fds[i])) for i, d in data.items()],
                                compression=Compression.parse("none"))
    try:
        return run(go())
    finally:
        for fd in fds.values():
            os.close(fd)


def _restore(client, dfd, sizes):
    targets = {i: memfd(size=n) for i, n in sizes.items()}
    try:
        client.run_session(SESSION_RESTORE, dfd, [ClientBo(i, fd) for i, fd in targets.items()])
        return {i: os.pread(fd, sizes[i], 0) for i, fd in targets.items()}
    finally:
        for fd in targets.values():
            os.close(fd)


def test_eio_under_a_restore_is_io_error_naming_the_file_bo_and_offset(daemon, tmp_path):
    src = tmp_path / "img"
    src.mkdir()
    data = {1: os.urandom(2 * CHUNK), 2: os.urandom(2 * CHUNK)}
    sfd = open_dir(src)
    m = _dump(sfd, data)
    bo2 = next(b for b in m.bos if b.id == 2)
    fi, off, ln, _ = chunk_record(m, bo2, 1)
    name = m.files[fi].name
    with eio_mount(src, tmp_path / "mnt", "--read-eio", f"{name}:{off}:{off + ln}"):
        mfd = open_dir(tmp_path / "mnt")
        try:
            with Client(daemon.socket) as c:
                with pytest.raises(errors.ImageIoError) as ei:
                    _restore(c, mfd, {i: len(d) for i, d in data.items()})
                assert (ei.value.bo_id, ei.value.offset) == (2, CHUNK)
                assert name in str(ei.value)
                assert _restore(c, sfd, {i: len(d) for i, d in data.items()}) == data  # the next one is served
        finally:
            os.close(mfd)
    os.close(sfd)


def test_eio_under_a_dump_is_io_error_and_commits_nothing(daemon, tmp_path):
    target = tmp_path / "img"
    target.mkdir()
    data = os.urandom(4 * CHUNK)
    src = memfd(data)
    with eio_mount(target, tmp_path / "mnt", "--write-eio", f"data-:{CHUNK}"):
        mfd = open_dir(tmp_path / "mnt")
        try:
            with Client(daemon.socket) as c:
                with pytest.raises(errors.ImageIoError) as ei:
                    c.run_session(SESSION_DUMP, mfd, [ClientBo(1, src, size=len(data), backend="mmap")],
                                  compression="none")
                assert ".vrd.tmp" in str(ei.value) and ei.value.bo_id == 1
                assert MANIFEST_NAME not in os.listdir(target)
                assert not [n for n in os.listdir(target) if n.endswith(".tmp")]  # the failed dump cleaned up
                ok = tmp_path / "ok"
                ok.mkdir()
                ofd = open_dir(ok)
                try:  # the next client is served
                    info = c.run_session(SESSION_DUMP, ofd, [ClientBo(1, src, size=len(data), backend="mmap")])
                    assert info.image.bo_count == 1
                finally:
                    os.close(ofd)
        finally:
            os.close(mfd)
    os.close(src)
