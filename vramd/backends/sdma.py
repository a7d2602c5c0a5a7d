"""SDMA backend: BO <-> staging copies by the GPU's SDMA engines, through libdrm_amdgpu.

What it does differently from CRIU's amdgpu plugin loop (docs/sdma.md):
- one device handle per GPU (render node), opened once and reused;
- each BO's dmabuf imported and VA-mapped once per job, at open();
- each staging buffer registered once as a userptr BO per GPU, for its whole
  life in the pool (unregistered when the pool frees it);
- one context and one IB buffer (with slots) per ring, reused for every
  submission; a batch of copies is one IB, one submission;
- COPY_LINEAR packets sized to the family's limit, the count field encoded
  per family (bytes - 1 from AMDGPU_FAMILY_AI on, bytes before);
- completion waited in one waiter thread per ring (fences signal in order),
  never on the event loop; many submissions in flight, so DMA overlaps the
  checksum/compression and file I/O stages;
- both DMA ring slots a context has (the kernel spreads them over the
  engines amdgpu_query_hw_ip_info reports), dump and restore placed on
  different slots (the topology's recommended engine mask cannot be applied
  through amdgpu_cs: the kernel picks the engine; docs/sdma.md);
- every libdrm error is a typed error naming the call, the BO and the
  offset; cleanup logs its own failures and never replaces the first error.

On machines without an AMD GPU it runs against the software model in
native/model/ (VRAMD_AMDGPU_LIBRARY=model); numbers measured so are model
numbers.
"""
from __future__ import annotations

import array
import asyncio
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..amdgpu import Unavailable, is_model, load, resolve
from ..errors import BackendError, BackendUnavailableError, TargetTooSmallError
from .base import Backend, BoHandle, BoRef, Capabilities, CopyItem, Direction

log = logging.getLogger(__name__)

PAGE = 4096
SDMA_OP_NOP = 0
SDMA_OP_COPY = 1
SDMA_SUBOP_COPY_LINEAR = 0
COPY_LINEAR_DWORDS = 7
IB_ALIGN_DWORDS = 8
IB_SLOT_BYTES = 64 << 10   # one submission's IB: up to 2,340 COPY_LINEAR packets
IB_SLOTS_PER_RING = 64
TIMEOUT_INFINITE = 0xFFFFFFFFFFFFFFFF
KERNEL_DMA_RINGS = 2  # DMA ring slots per context (amdgpu_ctx_num_entities[AMDGPU_HW_IP_DMA])


def family_is_ai_or_later(family: int, ai: int) -> bool:
    return family >= ai


def max_copy_bytes(family: int, ai: int) -> int:
    """Bytes one COPY_LINEAR packet may move (the kernel's copy_max_bytes per SDMA generation).

    SDMA v4 and later (AMDGPU_FAMILY_AI on): 4 MiB.  Before AI the limit differs inside a
    family (CIK and Iceland 0x1fffff, Tonga/Fiji/Polaris 0x3fffe0) and the family id cannot
    tell them apart, so the smallest, valid on all of them, is used.
    """
    return 0x400000 if family_is_ai_or_later(family, ai) else 0x1FFFFF


def copy_linear_packets(copies, family: int, ai: int) -> array.array:
    """An IB of COPY_LINEAR packets for (src_va, dst_va, nbytes) copies, NOP-padded to 8 dwords."""
    limit = max_copy_bytes(family, ai)
    minus_one = 1 if family_is_ai_or_later(family, ai) else 0
    header = (SDMA_SUBOP_COPY_LINEAR << 8) | SDMA_OP_COPY
    ib = array.array("I")
    for src, dst, n in copies:
        done = 0
        while done < n:
            step = min(limit, n - done)
            s, d = src + done, dst + done
            ib.extend((header, step - minus_one, 0, s & 0xFFFFFFFF, s >> 32, d & 0xFFFFFFFF, d >> 32))
            done += step
    while len(ib) % IB_ALIGN_DWORDS:
        ib.append(SDMA_OP_NOP)
    return ib


def _round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


@dataclass(eq=False)
class _SdmaBo(BoHandle):
    bo: object = None
    va: int = 0
    va_handle: object = None
    map_size: int = 0


@dataclass(eq=False)
class _Ring:
    index: int
    ctx: object
    ib_bo: object
    ib_cpu: object
    ib_va: int
    ib_va_handle: object
    waiter: ThreadPoolExecutor
    free_slots: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    submitted: int = 0


class _Gpu:
    """One GPU: device handle, rings, and the staging buffers registered with it."""

    def __init__(self, backend: "SdmaBackend", gpu_id: int, fd: int):
        self.b, self.gpu_id, self.fd = backend, gpu_id, fd
        self.dev = None
        self.rings: list[_Ring] = []
        self.retired: list = []   # guilty contexts replaced, freed at close
        self.userptrs: list = []  # staging buffers registered here
        ffi, lib = backend.ffi, backend.lib
        try:  # from here on, close() releases whatever was set up, the fd included
            major, minor, dev = ffi.new("uint32_t *"), ffi.new("uint32_t *"), ffi.new("amdgpu_device_handle *")
            backend._rc(lib.amdgpu_device_initialize(fd, major, minor, dev), "amdgpu_device_initialize")
            self.dev = dev[0]
            info = ffi.new("struct amdgpu_gpu_info *")
            backend._rc(lib.amdgpu_query_gpu_info(self.dev, info), "amdgpu_query_gpu_info")
            self.family = info.family_id
            ip = ffi.new("struct drm_amdgpu_info_hw_ip *")
            backend._rc(lib.amdgpu_query_hw_ip_info(self.dev, lib.AMDGPU_HW_IP_DMA, 0, ip), "amdgpu_query_hw_ip_info")
            engines = [i for i in range(32) if ip.available_rings >> i & 1]
            # A context has KERNEL_DMA_RINGS DMA ring slots whatever the engine count (the kernel's
            # amdgpu_ctx_num_entities), and the kernel's scheduler places each slot on an idle
            # engine itself: through amdgpu_cs no engine can be chosen, so the topology's
            # recommended_sdma_engine_id_mask (which KFD honours for user-mode SDMA queues)
            # cannot be applied here; it is logged for the record.
            rings = list(range(min(len(engines), KERNEL_DMA_RINGS)))
            self.recommended_mask = backend.recommended_mask.get(gpu_id)
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
                 " (software model)" if backend.model else "")

    def _make_ring(self, index: int) -> _Ring:
        b, ffi, lib = self.b, self.b.ffi, self.b.lib
        ctx = ffi.new("amdgpu_context_handle *")
        b._rc(lib.amdgpu_cs_ctx_create(self.dev, ctx), "amdgpu_cs_ctx_create")
        req = ffi.new("struct amdgpu_bo_alloc_request *")
        req.alloc_size = IB_SLOT_BYTES * IB_SLOTS_PER_RING
        req.phys_alignment = PAGE
        req.preferred_heap = lib.AMDGPU_GEM_DOMAIN_GTT
        bo = ffi.new("amdgpu_bo_handle *")
        b._rc(lib.amdgpu_bo_alloc(self.dev, req, bo), "amdgpu_bo_alloc (IB)")
        cpu = ffi.new("void **")
        b._rc(lib.amdgpu_bo_cpu_map(bo[0], cpu), "amdgpu_bo_cpu_map (IB)")
        va, vah = self.map_va(bo[0], req.alloc_size, "IB")
        return _Ring(index, ctx[0], bo[0], cpu[0], va, vah,
                     ThreadPoolExecutor(1, thread_name_prefix=f"vramd-sdma-{self.gpu_id:x}-r{index}"),
                     free_slots=list(range(IB_SLOTS_PER_RING)))

    def map_va(self, bo, size: int, what: str, *, bo_id=None):
        b, ffi, lib = self.b, self.b.ffi, self.b.lib
        va = ffi.new("uint64_t *")
        vah = ffi.new("amdgpu_va_handle *")
        b._rc(lib.amdgpu_va_range_alloc(self.dev, lib.amdgpu_gpu_va_range_general, size, PAGE, 0, va, vah, 0),
                f"amdgpu_va_range_alloc ({what})", bo_id=bo_id)
        rc = lib.amdgpu_bo_va_op(bo, 0, size, va[0], 0, lib.AMDGPU_VA_OP_MAP)
        if rc:
            lib.amdgpu_va_range_free(vah[0])
            b._rc(rc, f"amdgpu_bo_va_op MAP ({what})", bo_id=bo_id)
        return va[0], vah[0]

    def unmap_va(self, bo, size: int, va: int, vah, what: str) -> None:
        lib = self.b.lib
        self.b.cleanup(lib.amdgpu_bo_va_op(bo, 0, size, va, 0, lib.AMDGPU_VA_OP_UNMAP), f"UNMAP {what}")
        self.b.cleanup(lib.amdgpu_va_range_free(vah), f"amdgpu_va_range_free {what}")

    def ring_for(self, direction: Direction) -> _Ring:
        """Dump and restore on different rings when there are several; round-robin within a direction."""
        rings = self.rings
        if len(rings) >= 2:
            half = rings[0::2] if direction is Direction.READ else rings[1::2]
        else:
            half = rings
        i = self._next[direction]
        self._next[direction] = i + 1
        return half[i % len(half)]

    def userptr_va(self, buf) -> int:
        """The GPU VA of a staging buffer, registering it as a userptr BO on first use."""
        key = ("sdma", self.gpu_id)
        entry = buf.backend_state.get(key)
        if entry is None:
            ffi, lib = self.b.ffi, self.b.lib
            size = len(buf.mm)
            bo = ffi.new("amdgpu_bo_handle *")
            self.b._rc(lib.amdgpu_create_bo_from_user_mem(self.dev, ffi.cast("void *", buf.address), size, bo),
                         "amdgpu_create_bo_from_user_mem (staging)")
            try:
                va, vah = self.map_va(bo[0], size, "staging")
            except BaseException:
                lib.amdgpu_bo_free(bo[0])
                raise
            entry = buf.backend_state[key] = (bo[0], va, vah, size)
            self.userptrs.append(buf)
        return entry[1]

    def forget(self, buf) -> None:
        entry = buf.backend_state.pop(("sdma", self.gpu_id), None)
        if entry is not None:
            bo, va, vah, size = entry
            self.unmap_va(bo, size, va, vah, "staging")
            self.b.cleanup(self.b.lib.amdgpu_bo_free(bo), "amdgpu_bo_free (staging)")
            if buf in self.userptrs:
                self.userptrs.remove(buf)

    def close(self) -> None:
        lib = self.b.lib
        for ring in self.rings:
            ring.waiter.shutdown(wait=True)
            self.unmap_va(ring.ib_bo, IB_SLOT_BYTES * IB_SLOTS_PER_RING, ring.ib_va, ring.ib_va_handle, "IB")
            self.b.cleanup(lib.amdgpu_bo_cpu_unmap(ring.ib_bo), "amdgpu_bo_cpu_unmap (IB)")
            self.b.cleanup(lib.amdgpu_bo_free(ring.ib_bo), "amdgpu_bo_free (IB)")
            self.b.cleanup(lib.amdgpu_cs_ctx_free(ring.ctx), "amdgpu_cs_ctx_free")
        self.rings = []
        for ctx in self.retired:
            self.b.cleanup(lib.amdgpu_cs_ctx_free(ctx), "amdgpu_cs_ctx_free (retired)")
        self.retired = []
        for buf in list(self.userptrs):
            self.forget(buf)
        if self.dev is not None:
            self.b.cleanup(lib.amdgpu_device_deinitialize(self.dev), "amdgpu_device_deinitialize")
            self.dev = None
        os.close(self.fd)


class SdmaBackend(Backend):
    """Backend over libdrm_amdgpu (real, or the software model)."""

    name = "sdma"

    def __init__(self, workers_per_gpu: int = 4, *, library: str | None = None,
                 render_nodes: dict[int, str] | None = None, recommended_mask: dict[int, int] | None = None):
        self.model = is_model(resolve(library))
        self.render_nodes = render_nodes or {}
        if not self.model and not self.render_nodes:  # checked before loading anything
            raise BackendUnavailableError("no AMD GPU found in the KFD topology (VRAMD_AMDGPU_LIBRARY=model "
                                          "selects the software model)")
        try:
            self.ffi, self.lib, path = load(library)
        except Unavailable as e:
            raise BackendUnavailableError(str(e)) from None
        self.recommended_mask = recommended_mask or {}
        self.workers_per_gpu = workers_per_gpu
        self.pool = None
        self._gpus: dict[int, _Gpu] = {}
        self._lock = threading.Lock()

    # --- plumbing --------------------------------------------------------------

    def _rc(self, rc: int, call: str, *, bo_id: int | None = None, offset: int | None = None) -> None:
        if rc:
            raise BackendError(f"{call} failed: {os.strerror(-rc) if rc < 0 else rc} ({rc})"
                               f"{' [software model]' if self.model else ''}", bo_id=bo_id, offset=offset)

    @staticmethod
    def cleanup(rc: int, call: str) -> None:
        """A failing teardown call is logged, never raised: it must not replace the error that got us here."""
        if rc:
            log.warning("sdma cleanup: %s failed (%d)", call, rc)

    def _gpu(self, gpu_id: int) -> _Gpu:
        with self._lock:
            g = self._gpus.get(gpu_id)
            if g is None:
                g = self._gpus[gpu_id] = _Gpu(self, gpu_id, self._device_fd(gpu_id))
            return g

    def _device_fd(self, gpu_id: int) -> int:
        """The daemon's own render-node fd for a GPU (from the KFD topology; the model takes any fd)."""
        path = self.render_nodes.get(gpu_id)
        if path is None:
            if not self.model:
                raise BackendUnavailableError(f"no render node known for GPU {gpu_id:#x} (is it in the KFD topology?)")
            # the model's device: any file stands for a render node, one file per GPU
            # (libdrm shares one device handle per file)
            return os.memfd_create(f"vramd-model-gpu-{gpu_id:x}", os.MFD_CLOEXEC)
        try:
            return os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise BackendUnavailableError(f"cannot open {path} for GPU {gpu_id:#x}: {e.strerror}") from None

    # --- the Backend interface -----------------------------------------------

    def capabilities(self) -> Capabilities:
        return Capabilities(
            name=self.name, can_read=True, can_write=True, preferred_chunk=8 << 20, max_inflight=IB_SLOTS_PER_RING,
            asynchronous_dma=True,
            description="GPU SDMA engines via libdrm_amdgpu" + (" (SOFTWARE MODEL, not hardware)" if self.model else ""))

    def attach(self, pool) -> None:
        if self.pool is None:
            self.pool = pool
            pool.on_free.append(self._forget_buffer)

    def _forget_buffer(self, buf) -> None:
        for g in list(self._gpus.values()):
            g.forget(buf)

    def open(self, bo_id, ref: BoRef, size, gpu_id, direction, checked=None) -> _SdmaBo:
        self.check(ref.fd, direction, bo_id=bo_id, checked=checked)
        g = self._gpu(gpu_id)
        ffi, lib = self.ffi, self.lib
        res = ffi.new("struct amdgpu_bo_import_result *")
        self._rc(lib.amdgpu_bo_import(g.dev, lib.amdgpu_bo_handle_type_dma_buf_fd, ref.fd, res),
                   f"amdgpu_bo_import (dmabuf fd {ref.fd})", bo_id=bo_id)
        bo = res.buf_handle
        have = res.alloc_size
        if ref.offset + size > have:
            self.cleanup(lib.amdgpu_bo_free(bo), "amdgpu_bo_free")
            raise TargetTooSmallError(f"dmabuf fd {ref.fd} holds {have} bytes; the BO needs {size} bytes at offset "
                                      f"{ref.offset:#x}", bo_id=bo_id, offset=max(0, have - ref.offset))
        map_size = _round_up(max(have, 1))
        try:
            va, vah = g.map_va(bo, map_size, f"BO {bo_id}", bo_id=bo_id)
        except BaseException:
            self.cleanup(lib.amdgpu_bo_free(bo), "amdgpu_bo_free")
            raise
        return _SdmaBo(bo_id, ref, size, gpu_id, direction, bo=bo, va=va, va_handle=vah, map_size=map_size)

    def release(self, handle: _SdmaBo) -> None:
        if handle.bo is None:
            return
        g = self._gpus.get(handle.gpu_id)
        if g is not None:
            g.unmap_va(handle.bo, handle.map_size, handle.va, handle.va_handle, f"BO {handle.bo_id}")
        self.cleanup(self.lib.amdgpu_bo_free(handle.bo), "amdgpu_bo_free (BO)")
        handle.bo = None

    def submit(self, handle, bo_offset, buf, buf_offset, length) -> asyncio.Future:
        return self.submit_many([(handle, bo_offset, buf, buf_offset, length)])

    def submit_many(self, items: list[CopyItem]) -> asyncio.Future:
        """One IB with a COPY_LINEAR run per item, one submission, one fence."""
        loop = asyncio.get_running_loop()
        first = items[0][0]
        try:
            g = self._gpus.get(first.gpu_id) or self._gpu(first.gpu_id)
            copies = []
            for h, bo_off, buf, buf_off, n in items:
                bo_va = h.va + h.ref.offset + bo_off
                st_va = g.userptr_va(buf) + buf_off
                copies.append((bo_va, st_va, n) if h.direction is Direction.READ else (st_va, bo_va, n))
            ib = copy_linear_packets(copies, g.family, self.lib.AMDGPU_FAMILY_AI)
            ring = g.ring_for(first.direction)
            bo_list = self._bo_list(g, ring, items)
            try:
                seq, slot = self._submit(g, ring, ib, first, items[0][1], bo_list)
            finally:  # the kernel looked the list up at submit
                self.cleanup(self.lib.amdgpu_bo_list_destroy(bo_list), "amdgpu_bo_list_destroy")
        except BaseException as e:
            fut = loop.create_future()
            fut.set_exception(e)
            return fut
        return loop.run_in_executor(ring.waiter, self._wait, g, ring, seq, slot, first, items[0][1], len(copies))

    def _bo_list(self, g: _Gpu, ring: _Ring, items):
        """The BOs a submission touches (BOs, staging userptrs, the IB): the kernel makes them resident."""
        ffi, lib = self.ffi, self.lib
        handles = {id(ring.ib_bo): ring.ib_bo}
        key = ("sdma", g.gpu_id)
        for h, _, buf, _, _ in items:
            handles[id(h.bo)] = h.bo
            ub = buf.backend_state[key][0]
            handles[id(ub)] = ub
        arr = ffi.new("amdgpu_bo_handle[]", list(handles.values()))
        out = ffi.new("amdgpu_bo_list_handle *")
        self._rc(lib.amdgpu_bo_list_create(g.dev, len(handles), arr, ffi.NULL, out), "amdgpu_bo_list_create",
                 bo_id=items[0][0].bo_id, offset=items[0][1])
        return out[0]

    def _submit(self, g: _Gpu, ring: _Ring, ib: array.array, h, offset: int, bo_list) -> tuple[int, int]:
        ffi, lib = self.ffi, self.lib
        nbytes = len(ib) * 4
        if nbytes > IB_SLOT_BYTES:
            raise BackendError(f"a batch needs an IB of {nbytes} bytes (slot: {IB_SLOT_BYTES})", bo_id=h.bo_id,
                               offset=offset)
        with ring.lock:
            if not ring.free_slots:
                raise BackendError("all IB slots of the ring are in flight", bo_id=h.bo_id, offset=offset)
            slot = ring.free_slots.pop()
        try:
            ffi.memmove(ffi.cast("char *", ring.ib_cpu) + slot * IB_SLOT_BYTES, ib.tobytes(), nbytes)
            info = ffi.new("struct amdgpu_cs_ib_info *")
            info.ib_mc_address = ring.ib_va + slot * IB_SLOT_BYTES
            info.size = len(ib)
            req = ffi.new("struct amdgpu_cs_request *")
            req.ip_type = lib.AMDGPU_HW_IP_DMA
            req.ring = ring.index
            req.number_of_ibs = 1
            req.ibs = info
            req.resources = bo_list
            self._rc(lib.amdgpu_cs_submit(ring.ctx, 0, req, 1),
                       f"amdgpu_cs_submit (ring {ring.index})", bo_id=h.bo_id, offset=offset)
        except BaseException:
            with ring.lock:
                ring.free_slots.append(slot)
            raise
        ring.submitted += 1
        return req.seq_no, slot

    def _wait(self, g: _Gpu, ring: _Ring, seq: int, slot: int, h, offset: int, ncopies: int) -> None:
        """In the ring's waiter thread: wait for the fence, then ask whether the job faulted."""
        ffi, lib = self.ffi, self.lib
        try:
            fence = ffi.new("struct amdgpu_cs_fence *")
            fence.context = ring.ctx
            fence.ip_type = lib.AMDGPU_HW_IP_DMA
            fence.ring = ring.index
            fence.fence = seq
            expired = ffi.new("uint32_t *")
            self._rc(lib.amdgpu_cs_query_fence_status(fence, TIMEOUT_INFINITE, 0, expired),
                       "amdgpu_cs_query_fence_status", bo_id=h.bo_id, offset=offset)
            if not expired[0]:
                raise BackendError("SDMA fence did not signal", bo_id=h.bo_id, offset=offset)
            flags = ffi.new("uint64_t *")
            self._rc(lib.amdgpu_cs_query_reset_state2(ring.ctx, flags), "amdgpu_cs_query_reset_state2",
                       bo_id=h.bo_id, offset=offset)
            if flags[0] & (lib.AMDGPU_CTX_QUERY2_FLAGS_GUILTY | lib.AMDGPU_CTX_QUERY2_FLAGS_VRAMLOST):
                self._renew_context(g, ring)
                raise BackendError(
                    f"SDMA job of {ncopies} copies failed on ring {ring.index}: the GPU marked the context guilty "
                    f"(VM fault or invalid packet){' [software model]' if self.model else ''}",
                    bo_id=h.bo_id, offset=offset)
        finally:
            with ring.lock:
                ring.free_slots.append(slot)

    def _renew_context(self, g: _Gpu, ring: _Ring) -> None:
        """A guilty context refuses further work: replace it (jobs queued on it fail with it)."""
        ctx = self.ffi.new("amdgpu_context_handle *")
        if self.lib.amdgpu_cs_ctx_create(g.dev, ctx) == 0:
            # the old one is freed at close: fences still being waited for refer to it
            g.retired.append(ring.ctx)
            ring.ctx = ctx[0]

    def close(self) -> None:
        for g in self._gpus.values():
            g.close()
        self._gpus.clear()


