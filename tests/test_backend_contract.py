"""Every backend passes one contract suite (vramd.testing.check_backend), and the suite can fail.

SDMA runs on the software model of libdrm_amdgpu + SDMA (no AMD GPU here).
"""
from __future__ import annotations

import os

import pytest

from vramd.backends import MmapBackend
from vramd.backends.sdma.binding import MODEL_PATH
from vramd.errors import BackendError
from vramd.testing import SUBJECTS, Subject, check_backend
from vramd.testing.contract import mmap_subject


@pytest.mark.parametrize("name", sorted(SUBJECTS))
def test_backend_passes_the_contract(name):
    if name == "sdma" and not os.path.exists(MODEL_PATH):
        pytest.skip("the SDMA model is not built (needs libdrm-dev at install time; ./dev.sh installs it)")
    check_backend(SUBJECTS[name])


class _OffByOne(MmapBackend):
    """Copies from one byte past where it was asked: the contract must notice."""

    def endpoint(self, handle, bo_offset, length):
        return super().endpoint(handle, bo_offset + 1 if bo_offset + length < handle.size else bo_offset, length)


class _Untruthful(MmapBackend):
    """Accepts an fd that is closed: the contract must notice."""

    def check(self, fd, direction, *, bo_id, checked=None):
        return os.fstat(0)


class _NoCopier(MmapBackend):
    """Says its copies are CPU copies (not asynchronous DMA) but hands out no CPU copier: the contract must notice."""

    def cpu_copier(self):
        return None


class _AnonymousCopyError(MmapBackend):
    """Its CPU copier's errors name no BO: the contract must notice."""

    def copy_error(self, handle, bo_offset, err):
        return BackendError("a copy failed somewhere")


class _OneIdentity(MmapBackend):
    """Takes every BO of a size for one buffer (the model's inode, trusted alone): the contract must notice."""

    def identity(self, handle):
        return ("one", handle.size)


def _subject_with(cls):
    def make():
        s = mmap_subject()
        s.backend.close()
        return Subject(cls(), s.kind, s.new_bo, s.cleanups)
    return make


@pytest.mark.parametrize("broken", [_OffByOne, _Untruthful, _NoCopier, _AnonymousCopyError, _OneIdentity])
def test_the_contract_catches_a_broken_backend(broken):
    with pytest.raises(AssertionError):
        check_backend(_subject_with(broken))


def test_a_memfd_sealed_to_its_size_is_mapped_and_one_that_may_shrink_is_not():
    """The mmap backend maps only what cannot shrink under it (a dmabuf, a memfd sealed against shrinking): a
    truncation under a mapping would SIGBUS the copy thread.  Any other memfd or file goes through pread/pwrite."""
    from helpers import memfd

    from vramd.backends import BackendOptions, BoRef, Direction
    from vramd.backends.mmapfd import cannot_shrink
    from vramd.hostmem.libc import ffi

    data = os.urandom(3 * 4096 + 100)
    backend = MmapBackend(BackendOptions())
    try:
        for sealed in (False, True):
            fd = memfd(data, sealed=sealed)
            try:
                assert cannot_shrink(fd) is sealed
                h = backend.open(1, BoRef("mmap", fd, 100), len(data) - 100, 0, Direction.READ)
                where_fd, where = backend.endpoint(h, 4096, 200)
                if sealed:  # a mapping: the copy reads at an address, and the owner cannot cut the memfd short
                    assert where_fd == -1
                    assert bytes(ffi.buffer(ffi.cast("char *", where), 200)) == data[4196:4396]
                    with pytest.raises(PermissionError):
                        os.ftruncate(fd, 0)
                else:  # pread at the BO's offset in the fd
                    assert (where_fd, where) == (fd, 4196)
                backend.release(h)
            finally:
                os.close(fd)
    finally:
        backend.close()
