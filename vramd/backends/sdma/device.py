"""One GPU as the SDMA backend drives it: device handle, rings (context + IB buffer), registered staging."""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ...errors import BackendUnavailableError, TargetTooSmallError
from ...hostmem.staging import StagingBuffer
from ...units import round_up
from ..base import BoHandle, BoRef, Direction
from ..kind import BackendKind
from .driver import Driver
from .packets import GPU_PAGE, IB_SLOT_BYTES, IB_SLOTS_PER_RING, KERNEL_DMA_RINGS

log = logging.getLogger("vramd.backends.sdma")

# libdrm handles are opaque cdata pointers
Handle = Any


def check_fits(ref: BoRef, size: int, have: int, bo_id: int) -> None:
    if ref.offset + size > have:
        raise TargetTooSmallError(f"the dmabuf of BO {bo_id} holds {have} bytes; the BO needs {size} bytes at "
                                  f"its offset {ref.offset:#x}", bo_id=bo_id, offset=max(0, have - ref.offset))


@dataclass(eq=False)
class SdmaBo(BoHandle):
    bo: Handle = None
    va: int = 0
    va_handle: Handle = None
    map_size: int = 0
    imported: int = 0  # the import's number on its GPU (GpuDevice.imported), from its import to its release


@dataclass(eq=False)
class Ring:
    index: int
    ctx: Handle
    ib_bo: Handle
    ib_cpu: Handle
    ib_va: int
    ib_va_handle: Handle
    waiter: ThreadPoolExecutor
    # IB slots: taken and given back on the event loop only (SdmaBackend._slot / _free);
    # a submission that finds none waits in `slot_waiters`, never fails for want of one.
    free_slots: list[int] = field(default_factory=list)
    slot_waiters: collections.deque[asyncio.Future[None]] = field(default_factory=collections.deque)
    lock: threading.Lock = field(default_factory=threading.Lock)


class GpuDevice:
    """One GPU: device handle, rings, and the staging buffers registered with it."""

    def __init__(self, driver: Driver, gpu_id: int, fd: int, recommended_mask: int | None = None) -> None:
        """`recommended_mask`: the topology's SDMA engines for host copies (logged only: see below)."""
        self.driver, self.gpu_id, self.fd = driver, gpu_id, fd
        self.dev: Handle = None
        self.rings: list[Ring] = []
        self.retired: list[Handle] = []   # guilty contexts replaced, freed at close
        self.userptrs: list[StagingBuffer] = []  # staging buffers registered here
        # the buffers imported here and not yet freed: handle address -> [its number, references]
        # (libdrm hands out one handle per buffer while one is held: the kernel's prime lookup)
        self.imports: dict[int, list[int]] = {}
        self._numbers = itertools.count(1)
        ffi, lib = driver.ffi, driver.lib
        try:  # from here on, close() releases whatever was set up, the fd included
            major, minor, dev = ffi.new("uint32_t *"), ffi.new("uint32_t *"), ffi.new("amdgpu_device_handle *")
            driver.rc(lib.amdgpu_device_initialize(fd, major, minor, dev), "amdgpu_device_initialize")
            self.dev = dev[0]
            info = ffi.new("struct amdgpu_gpu_info *")
            driver.rc(lib.amdgpu_query_gpu_info(self.dev, info), "amdgpu_query_gpu_info")
            self.family = info.family_id
            ip = ffi.new("struct drm_amdgpu_info_hw_ip *")
            driver.rc(lib.amdgpu_query_hw_ip_info(self.dev, lib.AMDGPU_HW_IP_DMA, 0, ip), "amdgpu_query_hw_ip_info")
            engines = [i for i in range(32) if ip.available_rings >> i & 1]
            # A context has KERNEL_DMA_RINGS DMA ring slots whatever the engine count (the kernel's
            # amdgpu_ctx_num_entities), and the kernel's scheduler places each slot on an idle
            # engine itself: through amdgpu_cs no engine can be chosen, so the topology's
            # recommended_sdma_engine_id_mask (which KFD honours for user-mode SDMA queues)
            # cannot be applied here; it is logged for the record.
            rings = list(range(min(len(engines), KERNEL_DMA_RINGS)))
            self.recommended_mask = recommended_mask
            if not rings:
                raise BackendUnavailableError(f"GPU {gpu_id:#x} reports no SDMA ring")
            for r in rings:
                self.rings.append(self._make_ring(r))
        except BaseException:
            self.close()
            raise
        self._next = {Direction.READ: 0, Direction.WRITE: 0}
        log.info("sdma: GPU %#x family %d, %d engine(s), ring slots %s, recommended engine mask %s%s", gpu_id,
                 self.family, len(engines), [r.index for r in self.rings],
                 hex(self.recommended_mask) if self.recommended_mask else "none",
                 " (software model)" if driver.model else "")

    def _make_ring(self, index: int) -> Ring:
        b, ffi, lib = self.driver, self.driver.ffi, self.driver.lib
        ctx = ffi.new("amdgpu_context_handle *")
        b.rc(lib.amdgpu_cs_ctx_create(self.dev, ctx), "amdgpu_cs_ctx_create")
        req = ffi.new("struct amdgpu_bo_alloc_request *")
        req.alloc_size = IB_SLOT_BYTES * IB_SLOTS_PER_RING
        req.phys_alignment = GPU_PAGE
        req.preferred_heap = lib.AMDGPU_GEM_DOMAIN_GTT
        bo = ffi.new("amdgpu_bo_handle *")
        b.rc(lib.amdgpu_bo_alloc(self.dev, req, bo), "amdgpu_bo_alloc (IB)")
        cpu = ffi.new("void **")
        b.rc(lib.amdgpu_bo_cpu_map(bo[0], cpu), "amdgpu_bo_cpu_map (IB)")
        va, vah = self.map_va(bo[0], req.alloc_size, "IB")
        return Ring(index, ctx[0], bo[0], cpu[0], va, vah,
                     ThreadPoolExecutor(1, thread_name_prefix=f"vramd-sdma-{self.gpu_id:x}-r{index}"),
                     free_slots=list(range(IB_SLOTS_PER_RING)))

    def map_va(self, bo: Handle, size: int, what: str, *, bo_id: int | None = None) -> tuple[int, Handle]:
        b, ffi, lib = self.driver, self.driver.ffi, self.driver.lib
        va = ffi.new("uint64_t *")
        vah = ffi.new("amdgpu_va_handle *")
        b.rc(lib.amdgpu_va_range_alloc(self.dev, lib.amdgpu_gpu_va_range_general, size, GPU_PAGE, 0, va, vah, 0),
                f"amdgpu_va_range_alloc ({what})", bo_id=bo_id)
        rc = lib.amdgpu_bo_va_op(bo, 0, size, va[0], 0, lib.AMDGPU_VA_OP_MAP)
        if rc:
            lib.amdgpu_va_range_free(vah[0])
            b.rc(rc, f"amdgpu_bo_va_op MAP ({what})", bo_id=bo_id)
        return va[0], vah[0]

    def import_bo(self, h: SdmaBo) -> None:
        """In the submit thread: import the BO's dmabuf (once per BO and job; its VA mapping: `map_bo`)."""
        ffi, lib = self.driver.ffi, self.driver.lib
        res = ffi.new("struct amdgpu_bo_import_result *")
        self.driver.rc(lib.amdgpu_bo_import(self.dev, lib.amdgpu_bo_handle_type_dma_buf_fd, h.ref.fd, res),
                       f"amdgpu_bo_import (the dmabuf of BO {h.bo_id}, gpu {h.gpu_id:#x})", bo_id=h.bo_id)
        bo, have = res.buf_handle, res.alloc_size
        number = self.imported(bo)
        try:
            check_fits(h.ref, h.size, have, h.bo_id)
        except BaseException:
            self.driver.cleanup(lib.amdgpu_bo_free(bo), "amdgpu_bo_free")
            self.freed(bo)
            raise
        h.bo, h.map_size, h.imported = bo, round_up(max(have, 1), GPU_PAGE), number

    def map_bo(self, h: SdmaBo) -> None:
        """In the submit thread, before an imported BO's first copy: map it into the GPU's VM."""
        h.va, h.va_handle = self.map_va(h.bo, h.map_size, f"BO {h.bo_id}", bo_id=h.bo_id)

    def imported(self, bo: Handle) -> int:
        """In the submit thread, after amdgpu_bo_import gave `bo`: the buffer's number, the same for every
        handle of it held at once (the device's identity of a buffer), never reused by another."""
        key = int(self.driver.ffi.cast("uintptr_t", bo))
        entry = self.imports.get(key)
        if entry is None:
            entry = self.imports[key] = [next(self._numbers), 0]
        entry[1] += 1
        return entry[0]

    def freed(self, bo: Handle) -> None:
        """In the submit thread, after amdgpu_bo_free of an imported `bo`: one reference fewer."""
        key = int(self.driver.ffi.cast("uintptr_t", bo))
        entry = self.imports.get(key)
        if entry is not None:
            entry[1] -= 1
            if not entry[1]:
                del self.imports[key]

    def unmap_va(self, bo: Handle, size: int, va: int, vah: Handle, what: str) -> None:
        lib = self.driver.lib
        self.driver.cleanup(lib.amdgpu_bo_va_op(bo, 0, size, va, 0, lib.AMDGPU_VA_OP_UNMAP), f"UNMAP {what}")
        self.driver.cleanup(lib.amdgpu_va_range_free(vah), f"amdgpu_va_range_free {what}")

    def ring_for(self, direction: Direction) -> Ring:
        """Dump and restore on different rings when there are several; round-robin within a direction."""
        rings = self.rings
        if len(rings) >= 2:
            half = rings[0::2] if direction is Direction.READ else rings[1::2]
        else:
            half = rings
        i = self._next[direction]
        self._next[direction] = i + 1
        return half[i % len(half)]

    def userptr_va(self, buf: StagingBuffer) -> int:
        """The GPU VA of a staging buffer, registering it as a userptr BO on first use."""
        key = (BackendKind.SDMA, self.gpu_id)
        entry = buf.backend_state.get(key)
        if entry is None:
            ffi, lib = self.driver.ffi, self.driver.lib
            size = buf.size  # its usable bytes: a buffer on huge pages maps more (hostmem.staging), never touched
            bo = ffi.new("amdgpu_bo_handle *")
            self.driver.rc(lib.amdgpu_create_bo_from_user_mem(self.dev, ffi.cast("void *", buf.address), size, bo),
                         "amdgpu_create_bo_from_user_mem (staging)")
            try:
                va, vah = self.map_va(bo[0], size, "staging")
            except BaseException:
                lib.amdgpu_bo_free(bo[0])
                raise
            entry = buf.backend_state[key] = (bo[0], va, vah, size)
            self.userptrs.append(buf)
        va_out: int = entry[1]
        return va_out

    def forget(self, buf: StagingBuffer) -> None:
        entry = buf.backend_state.pop((BackendKind.SDMA, self.gpu_id), None)
        if entry is not None:
            bo, va, vah, size = entry
            self.unmap_va(bo, size, va, vah, "staging")
            self.driver.cleanup(self.driver.lib.amdgpu_bo_free(bo), "amdgpu_bo_free (staging)")
            if buf in self.userptrs:
                self.userptrs.remove(buf)

    def close(self) -> None:
        lib = self.driver.lib
        for ring in self.rings:
            ring.waiter.shutdown(wait=True)
            self.unmap_va(ring.ib_bo, IB_SLOT_BYTES * IB_SLOTS_PER_RING, ring.ib_va, ring.ib_va_handle, "IB")
            self.driver.cleanup(lib.amdgpu_bo_cpu_unmap(ring.ib_bo), "amdgpu_bo_cpu_unmap (IB)")
            self.driver.cleanup(lib.amdgpu_bo_free(ring.ib_bo), "amdgpu_bo_free (IB)")
            self.driver.cleanup(lib.amdgpu_cs_ctx_free(ring.ctx), "amdgpu_cs_ctx_free")
        self.rings = []
        for ctx in self.retired:
            self.driver.cleanup(lib.amdgpu_cs_ctx_free(ctx), "amdgpu_cs_ctx_free (retired)")
        self.retired = []
        for buf in list(self.userptrs):
            self.forget(buf)
        if self.dev is not None:
            self.driver.cleanup(lib.amdgpu_device_deinitialize(self.dev), "amdgpu_device_deinitialize")
            self.dev = None
        os.close(self.fd)
