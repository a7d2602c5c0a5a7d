"""Which BOs of a dump are one buffer, through the SDMA backend on the KFD model's dmabufs (no CRIU).

The KFD model (docs/kfd-model.md) exports every BO of a GPU as that GPU's arena file under a name that
states the BO's window, so all its dmabufs share one inode; a kernel gives each exported BO a dma-buf
inode of its own.  The SDMA backend names a BO's buffer by what the device imports
(`Backend.identity`): equal-sized BOs of one GPU are distinct buffers there, each restored with its
own bytes, while one dmabuf given twice, or one BO exported twice, is still stored and copied once.
These tests drive the real KFD model in this process (ctypes: the ioctls CRIU's amdgpu plugin makes)
and a real daemon on the SDMA model over its socket.
"""
from __future__ import annotations

import ctypes
import os
import random
import sys
from pathlib import Path

import pytest
from helpers import image_records, open_dir

from vramd.backends.sdma.binding import MODEL_PATH
from vramd.client import SESSION_DUMP, SESSION_RESTORE, Client, ClientBo
from vramd.testing import DaemonProcess

ROOT = Path(__file__).resolve().parents[1]
PAGE = 4096
GPU_ID, MINOR = 0xA3F0, 128
VRAM, WRITABLE = 1 << 0, 1 << 31
# <linux/kfd_ioctl.h>: _IOW('K', 0x15, 8), _IOWR('K', 0x16, 40), _IOWR('K', 0x22, 56)
ACQUIRE_VM, ALLOC_MEMORY_OF_GPU, CRIU_OP = 0x40084B15, 0xC0284B16, 0xC0384B22
OP_PROCESS_INFO, OP_CHECKPOINT = 0, 1

pytestmark = pytest.mark.skipif(not os.path.exists(MODEL_PATH), reason="the SDMA model is not built (needs libdrm-dev "
                                "at install time; ./dev.sh installs it)")

U32, U64 = ctypes.c_uint32, ctypes.c_uint64


class Gpu(ctypes.Structure):
    _fields_ = [("gpu_id", U32), ("minor", U32), ("vram_size", U64)]


class AcquireVm(ctypes.Structure):
    _fields_ = [("drm_fd", U32), ("gpu_id", U32)]


class Alloc(ctypes.Structure):
    _fields_ = [("va_addr", U64), ("size", U64), ("handle", U64), ("mmap_offset", U64), ("gpu_id", U32),
                ("flags", U32)]


class CriuArgs(ctypes.Structure):
    _fields_ = [("devices", U64), ("bos", U64), ("priv_data", U64), ("priv_data_size", U64), ("num_devices", U32),
                ("num_bos", U32), ("num_objects", U32), ("pid", U32), ("op", U32)]


class BoBucket(ctypes.Structure):
    _fields_ = [("addr", U64), ("size", U64), ("offset", U64), ("restored_offset", U64), ("gpu_id", U32),
                ("alloc_flags", U32), ("dmabuf_fd", U32), ("pad", U32)]


class DeviceBucket(ctypes.Structure):
    _fields_ = [("user_gpu_id", U32), ("actual_gpu_id", U32), ("drm_fd", U32), ("pad", U32)]


assert [ctypes.sizeof(t) for t in (AcquireVm, Alloc, CriuArgs, BoBucket, DeviceBucket)] == [8, 40, 56, 48, 16]


@pytest.fixture(scope="module")
def kfd_lib(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "native" / "model"))
    try:
        import build as model_build
    finally:
        sys.path.pop(0)
    try:
        path = model_build.build_kfd_core_lib(tmp_path_factory.mktemp("kfd-core"))
    except model_build.ModelBuildError as e:
        pytest.skip(f"the KFD model cannot be built here: {e}")
    lib = ctypes.CDLL(path)
    lib.kfdm_create.argtypes = [ctypes.c_char_p, ctypes.POINTER(Gpu), ctypes.c_uint, ctypes.c_uint]
    lib.kfdm_attach.argtypes, lib.kfdm_attach.restype = [ctypes.c_char_p], ctypes.c_void_p
    lib.kfdm_detach.argtypes = [ctypes.c_void_p]
    lib.kfdm_open.argtypes, lib.kfdm_open.restype = [ctypes.c_void_p], ctypes.c_int64
    lib.kfdm_ioctl.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_ulong, ctypes.c_void_p]
    return lib


class KfdProcess:
    """This process as a KFD process of the model with one GPU: BOs allocated, filled through the render
    node (as a ROCm process maps them), exported as dmabufs by CHECKPOINT (as CRIU's plugin has them)."""

    def __init__(self, lib: ctypes.CDLL, state: Path) -> None:
        state.mkdir()
        self.lib, self.fds = lib, []
        gpu = Gpu(GPU_ID, MINOR, 1 << 34)
        assert lib.kfdm_create(str(state).encode(), ctypes.byref(gpu), 1, 14) == 0
        self.m = lib.kfdm_attach(str(state).encode())
        assert self.m
        self.token = lib.kfdm_open(self.m)
        assert self.token > 0
        self.render = os.open(state / f"renderD{MINOR}", os.O_RDWR | os.O_CLOEXEC)
        self._ioctl(ACQUIRE_VM, AcquireVm(self.render, GPU_ID))
        self.bos: list[Alloc] = []

    def _ioctl(self, req: int, arg: ctypes.Structure) -> None:
        rc = self.lib.kfdm_ioctl(self.m, self.token, req, ctypes.byref(arg))
        assert rc == 0, (hex(req), rc)

    def alloc(self, size: int, data: bytes) -> int:
        a = Alloc(0x7F0000000000 + len(self.bos) * (1 << 30), size, 0, 0, GPU_ID, VRAM | WRITABLE)
        self._ioctl(ALLOC_MEMORY_OF_GPU, a)
        os.pwrite(self.render, data, a.mmap_offset)
        self.bos.append(a)
        return len(self.bos) - 1

    def bytes_of(self, i: int) -> bytes:
        return os.pread(self.render, self.bos[i].size, self.bos[i].mmap_offset)

    def clear(self, i: int) -> None:
        os.pwrite(self.render, bytes(self.bos[i].size), self.bos[i].mmap_offset)

    def checkpoint(self) -> list[int]:
        """PROCESS_INFO (the queues paused), then CHECKPOINT: each BO's dmabuf fd, in allocation order."""
        info = CriuArgs(op=OP_PROCESS_INFO)
        self._ioctl(CRIU_OP, info)
        assert info.num_bos == len(self.bos)
        devices, bos = (DeviceBucket * info.num_devices)(), (BoBucket * info.num_bos)()
        priv = ctypes.create_string_buffer(info.priv_data_size)
        a = CriuArgs(ctypes.addressof(devices), ctypes.addressof(bos), ctypes.addressof(priv), info.priv_data_size,
                     info.num_devices, info.num_bos, info.num_objects, 0, OP_CHECKPOINT)
        self._ioctl(CRIU_OP, a)
        by_offset = {b.offset: b.dmabuf_fd for b in bos}
        fds = [by_offset[bo.mmap_offset] for bo in self.bos]
        self.fds += fds
        return fds

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        os.close(self.render)
        self.lib.kfdm_detach(self.m)


def _daemon(run_dir: str, copy_log: Path) -> DaemonProcess:
    return DaemonProcess(run_dir, "--grace-period", "0.3", "--staging-budget", "64M", "--chunk-size", "1M",
                         env={"VRAMD_AMDGPU_LIBRARY": "model", "VRAMD_SDMA_MODEL_COPY_LOG": str(copy_log)})


def _copied(log: Path) -> int:
    """Bytes the SDMA model copied (its copy log: "<pid> <bytes> <ns>" a job)."""
    return sum(int(line.split()[1]) for line in log.read_text().splitlines()) if log.exists() else 0


def test_equal_sized_bos_of_one_gpu_restore_each_its_own_bytes(kfd_lib, run_dir, tmp_path):
    """Eight one-page BOs and two of 64 KiB, all on one GPU: one inode for all their dmabufs on the model, yet
    ten buffers, each stored and copied once, each restored byte-exact (one buffer's bytes for all of a size,
    before the SDMA backend named buffers by their import)."""
    p = KfdProcess(kfd_lib, tmp_path / "kfd")
    rnd = random.Random(34)
    sizes = [PAGE] * 8 + [64 << 10] * 2
    want = [rnd.randbytes(n) for n in sizes]
    try:
        for n, d in zip(sizes, want):
            p.alloc(n, d)
        fds = p.checkpoint()
        assert len({os.fstat(fd).st_ino for fd in fds}) == 1  # the model's limit the identity must see past
        bos = [ClientBo(i + 1, fd, size=n, backend="sdma") for i, (fd, n) in enumerate(zip(fds, sizes))]
        (tmp_path / "img").mkdir()
        dfd = open_dir(tmp_path / "img")
        log = tmp_path / "copies.log"
        with _daemon(run_dir, log) as d, Client(d.socket) as c:
            c.run_session(SESSION_DUMP, dfd, bos)
            assert _copied(log) == sum(sizes)
            m, _ = image_records(tmp_path / "img")
            assert all(b.stored_bytes == b.size for b in m.bos), [(b.id, b.stored_bytes) for b in m.bos]
            for i in range(len(sizes)):
                p.clear(i)
            c.run_session(SESSION_RESTORE, dfd, bos)
        os.close(dfd)
        got = [p.bytes_of(i) for i in range(len(sizes))]
        assert [i + 1 for i, (g, w) in enumerate(zip(got, want)) if g != w] == []
    finally:
        p.close()


def test_one_dmabuf_given_twice_and_one_bo_exported_twice_are_copied_once(kfd_lib, run_dir, tmp_path):
    """BO 3 is BO 1's dmabuf again, BO 4 is BO 1 exported by a second CHECKPOINT (a new fd, the same buffer:
    the device's import finds the one it has): both are BO 1's buffer, copied once and stored once; BO 2,
    equal-sized, is its own."""
    p = KfdProcess(kfd_lib, tmp_path / "kfd")
    rnd = random.Random(35)
    want = [rnd.randbytes(2 * PAGE) for _ in range(2)]
    try:
        for d in want:
            p.alloc(len(d), d)
        first, second = p.checkpoint(), p.checkpoint()
        assert first[0] != second[0]
        n = 2 * PAGE
        bos = [ClientBo(1, first[0], size=n, backend="sdma"), ClientBo(2, first[1], size=n, backend="sdma"),
               ClientBo(3, first[0], size=n, backend="sdma"), ClientBo(4, second[0], size=n, backend="sdma")]
        (tmp_path / "img").mkdir()
        dfd = open_dir(tmp_path / "img")
        log = tmp_path / "copies.log"
        with _daemon(run_dir, log) as d, Client(d.socket) as c:
            c.run_session(SESSION_DUMP, dfd, bos)
            assert _copied(log) == 2 * n  # BOs 1 and 2; 3 and 4 are BO 1's buffer
            m, _ = image_records(tmp_path / "img")
            stored = {b.id: (b.stored_bytes, b.dedup_bytes) for b in m.bos}
            assert stored == {1: (n, 0), 2: (n, 0), 3: (0, n), 4: (0, n)}
            p.clear(0)
            p.clear(1)
            c.run_session(SESSION_RESTORE, dfd, [ClientBo(i, fd, backend="sdma") for i, fd in
                                                  ((1, second[0]), (2, second[1]), (3, first[0]), (4, second[0]))])
        os.close(dfd)
        assert [p.bytes_of(0), p.bytes_of(1)] == want
    finally:
        p.close()
