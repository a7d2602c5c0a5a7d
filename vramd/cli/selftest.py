"""`vramctl selftest`: round-trip known data through every backend the daemon has, per GPU.

For each GPU the daemon reports (or GPU 0 when it runs on the software
model), this allocates two VRAM BOs through libdrm_amdgpu (amdgpu_bo_alloc
in the VRAM domain, CPU-visible, exported as dmabufs), fills the first with
a known pattern through its CPU mapping, then for every available backend
dumps it through the daemon, restores into the second BO, compares the two
byte for byte and reports GB/s per backend and direction.  procmem, which
cannot reach VRAM, round-trips a buffer of this process instead.

On a machine with AMD GPUs this is the first thing to run to confirm the
hardware path.  Where the library is the software model
(VRAMD_AMDGPU_LIBRARY=model), every SDMA number printed is a model number
and says so.
"""
from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from ..backends.sdma.binding import Unavailable, is_model, load
from ..backends.sdma.packets import GPU_PAGE
from ..client import SESSION_DUMP, SESSION_RESTORE, Client, ClientBo
from ..hostmem.libc import ffi as mffi
from ..hostmem.libc import pointer

PATTERN_SEED = 0x5EED


@dataclass
class Row:
    gpu_id: int
    backend: str
    direction: str
    nbytes: int
    seconds: float
    ok: bool
    note: str = ""

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def pattern(size: int, salt: int) -> bytes:
    """Deterministic, incompressible-looking bytes."""
    import hashlib
    out = bytearray()
    block = 0
    while len(out) < size:
        out += hashlib.blake2b(f"{PATTERN_SEED}:{salt}:{block}".encode(), digest_size=64).digest() * 64
        block += 1
    return bytes(out[:size])


class VramBo:
    """A VRAM BO allocated through libdrm_amdgpu and exported as a dmabuf fd."""

    def __init__(self, ffi: Any, lib: Any, dev: Any, size: int) -> None:
        self.ffi, self.lib = ffi, lib
        req = ffi.new("struct amdgpu_bo_alloc_request *")
        req.alloc_size = size
        req.phys_alignment = GPU_PAGE
        req.preferred_heap = lib.AMDGPU_GEM_DOMAIN_VRAM
        req.flags = lib.AMDGPU_GEM_CREATE_CPU_ACCESS_REQUIRED
        bo = ffi.new("amdgpu_bo_handle *")
        rc = lib.amdgpu_bo_alloc(dev, req, bo)
        if rc:
            raise OSError(-rc, f"amdgpu_bo_alloc of {size} bytes of VRAM failed")
        self.bo = bo[0]
        fd = ffi.new("uint32_t *")
        rc = lib.amdgpu_bo_export(self.bo, lib.amdgpu_bo_handle_type_dma_buf_fd, fd)
        if rc:
            lib.amdgpu_bo_free(self.bo)
            raise OSError(-rc, "amdgpu_bo_export as a dmabuf failed")
        self.fd, self.size = fd[0], size

    def write(self, data: bytes) -> None:
        with mmap.mmap(self.fd, self.size) as m:
            m[:len(data)] = data

    def read(self) -> bytes:
        with mmap.mmap(self.fd, self.size, prot=mmap.PROT_READ) as m:
            return m[:]

    def close(self) -> None:
        os.close(self.fd)
        self.lib.amdgpu_bo_free(self.bo)


def _roundtrip(c: Client, backend: str, gpu_id: int, src_fd: int, src_off: int, dst_fd: int, dst_off: int,
               size: int, workdir: str) -> tuple[float, float]:
    img = tempfile.mkdtemp(prefix="selftest-", dir=workdir)
    dfd = os.open(img, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        label = f"selftest {backend} gpu {gpu_id:#x}"
        dump = c.run_session(SESSION_DUMP, dfd, [ClientBo(1, src_fd, offset=src_off, size=size, backend=backend,
                                                         gpu_id=gpu_id)], label=label)
        restore = c.run_session(SESSION_RESTORE, dfd, [ClientBo(1, dst_fd, offset=dst_off, backend=backend,
                                                               gpu_id=gpu_id)], label=label)
        return dump.progress.elapsed_s, restore.progress.elapsed_s
    finally:
        os.close(dfd)
        shutil.rmtree(img, ignore_errors=True)


def run_selftest(c: Client, size: int, workdir: str, library: str | None = None) -> tuple[list[Row], list[str]]:
    """Returns (rows, notes). A row per backend, direction and GPU."""
    rows: list[Row] = []
    notes: list[str] = []
    backends = {b.name: b for b in c.hello.backends}
    data = pattern(size, 1)

    # procmem: a buffer of this process (VRAM is not reachable through /proc/<pid>/mem)
    if backends.get("procmem") and backends["procmem"].available:
        src = mmap.mmap(-1, size)
        dst = mmap.mmap(-1, size)
        src[:] = data
        mem = os.open(f"/proc/{os.getpid()}/mem", os.O_RDWR | os.O_CLOEXEC)
        try:
            a = int(mffi.cast("uintptr_t", pointer(src)))
            b = int(mffi.cast("uintptr_t", pointer(dst, writable=True)))
            d, r = _roundtrip(c, "procmem", 0, mem, a, mem, b, size, workdir)
            ok = dst[:] == data
            rows += [Row(0, "procmem", "dump", size, d, ok, "host memory"),
                     Row(0, "procmem", "restore", size, r, ok, "host memory")]
        finally:
            os.close(mem)

    gpu_backends = [n for n in ("mmap", "sdma") if backends.get(n) and backends[n].available]
    try:
        ffi, lib, path = load(library)
    except Unavailable as e:
        notes.append(f"GPU backends skipped: {e}")
        return rows, notes
    model = is_model(path)
    gpu_ids = list(c.hello.gpu_ids) or ([0] if model else [])
    if not gpu_ids:
        notes.append("the daemon knows no GPU (KFD topology empty): GPU backends skipped")
    if model:
        notes.append("libdrm_amdgpu is vramd's SOFTWARE MODEL: the SDMA rows are model numbers, not hardware")
    for gpu_id in gpu_ids:
        dev_fd = (os.memfd_create(f"model-gpu-{gpu_id:x}", os.MFD_CLOEXEC) if model  # the model's "render node"
                  else os.open(_render_node(gpu_id), os.O_RDWR | os.O_CLOEXEC))
        dev = ffi.new("amdgpu_device_handle *")
        major, minor = ffi.new("uint32_t *"), ffi.new("uint32_t *")
        rc = lib.amdgpu_device_initialize(dev_fd, major, minor, dev)
        if rc:
            os.close(dev_fd)
            notes.append(f"GPU {gpu_id:#x}: amdgpu_device_initialize failed ({rc})")
            continue
        try:
            src_bo, dst_bo = VramBo(ffi, lib, dev[0], size), VramBo(ffi, lib, dev[0], size)
            try:
                src_bo.write(data)
                for name in gpu_backends:
                    dst_bo.write(b"\0" * size)
                    d, r = _roundtrip(c, name, gpu_id, src_bo.fd, 0, dst_bo.fd, 0, size, workdir)
                    ok = dst_bo.read() == data
                    tag = "MODEL" if model and name == "sdma" else ""
                    rows += [Row(gpu_id, name, "dump", size, d, ok, tag),
                             Row(gpu_id, name, "restore", size, r, ok, tag)]
            finally:
                src_bo.close()
                dst_bo.close()
        finally:
            lib.amdgpu_device_deinitialize(dev[0])
            os.close(dev_fd)
    return rows, notes


def _render_node(gpu_id: int) -> str:
    from ..topology import parse_topology, render_node
    topo = parse_topology()
    return render_node(topo.gpu(gpu_id))


def format_rows(rows: list[Row]) -> str:
    lines = [f"{'gpu':>8} {'backend':>8} {'direction':>9} {'size':>10} {'GB/s':>8}  result"]
    for r in rows:
        lines.append(f"{r.gpu_id:>#8x} {r.backend:>8} {r.direction:>9} {r.nbytes >> 20:>8}Mi {r.gbps:>8.2f}  "
                     f"{'OK' if r.ok else 'MISMATCH'}{'  (' + r.note + ')' if r.note else ''}")
    return "\n".join(lines)


