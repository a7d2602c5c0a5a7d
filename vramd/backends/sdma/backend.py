"""SDMA backend: BO <-> staging copies by the GPU's SDMA engines, through libdrm_amdgpu.

What it does differently from CRIU's amdgpu plugin loop (docs/sdma.md):
- one device handle per GPU (render node), opened once and reused;
- each BO's dmabuf imported once per job, for a dump before the job takes
  it (its identity: the imported buffer, `identity`), and VA-mapped before
  its first copy; open() only checks the fd and its size (no libdrm call on
  the loop);
- every libdrm call but the fence wait in one submit thread per GPU (device
  setup, import, VA mapping, userptr registration, submission, release);
- a batch that finds every IB slot of its ring in flight waits for one;
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
import concurrent.futures
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Self, TypeVar

from ...errors import BackendError, BackendUnavailableError, from_os_error
from ...hostmem.staging import StagingBuffer, StagingPool
from ..base import Backend, BackendOptions, BoHandle, BoRef, Capabilities, CopyItem, Direction, FdMemo, fd_size
from ..kind import BackendKind
from .binding import Unavailable, is_model, load, resolve
from .device import GpuDevice, Handle, Ring, SdmaBo, check_fits
from .driver import Driver
from .packets import IB_SLOT_BYTES, IB_SLOTS_PER_RING, TIMEOUT_INFINITE, copy_linear_packets

if TYPE_CHECKING:
    from ._amdgpu import _FFI, _Lib


class SdmaBackend(Backend):
    """Backend over libdrm_amdgpu (real, or the software model)."""

    name = BackendKind.SDMA

    @classmethod
    def create(cls, options: BackendOptions) -> Self:
        return cls(options.workers_per_gpu, library=options.sdma_library, render_nodes=dict(options.render_nodes),
                   recommended_mask=dict(options.recommended_mask))

    def __init__(self, workers_per_gpu: int = 4, *, library: str | None = None,
                 render_nodes: dict[int, str] | None = None, recommended_mask: dict[int, int] | None = None) -> None:
        self.model = is_model(resolve(library))
        self.render_nodes = render_nodes or {}
        if not self.model and not self.render_nodes:  # checked before loading anything
            raise BackendUnavailableError("no AMD GPU found in the KFD topology (VRAMD_AMDGPU_LIBRARY=model "
                                          "selects the software model)")
        try:
            ffi, lib, _ = load(library)
        except Unavailable as e:
            raise BackendUnavailableError(str(e)) from None
        self.driver = Driver(ffi, lib, model=self.model)  # the libdrm calls of the backend and its GPUs
        self.recommended_mask = recommended_mask or {}
        self.workers_per_gpu = workers_per_gpu
        self.pool: StagingPool | None = None
        self._gpus: dict[int, GpuDevice] = {}
        # One submit thread per GPU: device setup, BO import and VA mapping, userptr
        # registration and submission, so a slow ioctl never stalls the event loop.
        self._submitters: dict[int, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    # --- plumbing --------------------------------------------------------------

    @property
    def ffi(self) -> _FFI:
        return self.driver.ffi

    @property
    def lib(self) -> _Lib:
        """The library every libdrm call of the backend and its GPUs goes to (replaceable, e.g. by a spy)."""
        return self.driver.lib

    @lib.setter
    def lib(self, lib: _Lib) -> None:
        self.driver.lib = lib

    def _submitter(self, gpu_id: int) -> ThreadPoolExecutor:
        with self._lock:
            ex = self._submitters.get(gpu_id)
            if ex is None:
                ex = self._submitters[gpu_id] = ThreadPoolExecutor(
                    1, thread_name_prefix=f"vramd-sdma-{gpu_id:x}-submit")
            return ex

    def _gpu(self, gpu_id: int) -> GpuDevice:
        """The GPU's device, set up on first use (in its submit thread: amdgpu_device_initialize and friends)."""
        with self._lock:
            g = self._gpus.get(gpu_id)
            if g is None:
                g = self._gpus[gpu_id] = GpuDevice(self.driver, gpu_id, self._device_fd(gpu_id),
                                                     self.recommended_mask.get(gpu_id))
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
            raise from_os_error(e, f"cannot open {path} for GPU {gpu_id:#x}", BackendUnavailableError) from None

    # --- the Backend interface -----------------------------------------------

    def capabilities(self) -> Capabilities:
        return Capabilities(
            name=self.name, can_read=True, can_write=True, preferred_chunk=8 << 20, max_inflight=IB_SLOTS_PER_RING,
            asynchronous_dma=True,
            description="GPU SDMA engines via libdrm_amdgpu"
                        + (" (SOFTWARE MODEL, not hardware)" if self.model else ""))

    def attach(self, pool: StagingPool) -> None:
        if self.pool is None:
            self.pool = pool
            pool.on_free.append(self._forget_buffer)

    def _forget_buffer(self, buf: StagingBuffer) -> None:
        for g in list(self._gpus.values()):
            g.forget(buf)

    def open(self, bo_id: int, ref: BoRef, size: int, gpu_id: int, direction: Direction,
             checked: FdMemo | None = None) -> SdmaBo:
        """Validate the dmabuf fd and that it holds the BO; no libdrm call here, on the event loop (the import
        and VA mapping: in its GPU's submit thread, `prepare_identity` or before its first copy)."""
        st = self.check(ref.fd, direction, bo_id=bo_id, checked=checked)
        have = fd_size(ref.fd, st)
        if have is not None:
            check_fits(ref, size, have, bo_id)
        return SdmaBo(bo_id, ref, size, gpu_id, direction)

    # --- identity: the buffer the device imports ---------------------------

    prepares_identity = True

    def identity(self, handle: BoHandle) -> tuple[str, int, int, int, int] | None:
        """The buffer as the GPU's device imported it (amdgpu_bo_import gives one handle per buffer while
        one is held, as the kernel's prime lookup finds one GEM object per dma-buf), the offset and the size;
        None before `prepare_identity`.  A dmabuf given for two GPUs is two imports: copied for each."""
        assert isinstance(handle, SdmaBo)
        if not handle.imported:
            return None
        return (self.name, handle.gpu_id, handle.imported, handle.ref.offset, handle.size)

    def prepare_identity(self, handles: Sequence[BoHandle]) -> None:
        """Import each BO's dmabuf in its GPU's submit thread (what its first copy would do), waiting here."""
        by_gpu: dict[int, list[SdmaBo]] = {}
        for h in handles:
            assert isinstance(h, SdmaBo)
            by_gpu.setdefault(h.gpu_id, []).append(h)
        futs = [self._submitter(gpu).submit(self._import_all, gpu, hs) for gpu, hs in by_gpu.items()]
        concurrent.futures.wait(futs)  # every GPU's imports done, also when one failed
        for f in futs:
            f.result()

    def _import_all(self, gpu_id: int, handles: list[SdmaBo]) -> None:
        g = self._gpu(gpu_id)
        for h in handles:
            if h.bo is None:
                g.import_bo(h)

    def release(self, handle: BoHandle) -> None:
        """Unmap and free the BO in its GPU's submit thread (after every submission queued before)."""
        assert isinstance(handle, SdmaBo)
        with self._lock:
            ex = self._submitters.get(handle.gpu_id)
        if ex is not None:
            try:
                ex.submit(self._release, handle)
            except RuntimeError:  # the backend is closing: do it here
                self._release(handle)

    def _release(self, handle: SdmaBo) -> None:
        if handle.bo is None:
            return
        g = self._gpus.get(handle.gpu_id)
        if g is not None and handle.va_handle is not None:
            g.unmap_va(handle.bo, handle.map_size, handle.va, handle.va_handle, f"BO {handle.bo_id}")
            handle.va_handle = None
        self.driver.cleanup(self.lib.amdgpu_bo_free(handle.bo), "amdgpu_bo_free (BO)")
        if g is not None:
            g.freed(handle.bo)
        handle.bo, handle.imported = None, 0

    def submit(self, handle: BoHandle, bo_offset: int, buf: StagingBuffer, buf_offset: int,
               length: int) -> asyncio.Future[None]:
        return self.submit_many([(handle, bo_offset, buf, buf_offset, length)])

    def submit_many(self, items: Sequence[CopyItem]) -> asyncio.Future[None]:
        """One IB with a COPY_LINEAR run per item, one submission, one fence.

        On the event loop only the IB slot is taken (waiting for one when the ring has
        none free); the libdrm calls run in the GPU's submit thread and the fence wait in
        the ring's waiter thread.  The future completes when the copies have landed (or
        failed); cancelling it leaves nothing in flight behind it.
        """
        return asyncio.ensure_future(self._submit_many(list(items)))

    async def _submit_many(self, items: list[CopyItem]) -> None:
        loop = asyncio.get_running_loop()
        first = items[0][0]
        assert isinstance(first, SdmaBo)
        submitter = self._submitter(first.gpu_id)
        g = await loop.run_in_executor(submitter, self._gpu, first.gpu_id)
        ring = g.ring_for(first.direction)
        slot = await self._slot(ring)
        submitted = loop.run_in_executor(submitter, self._prepare_and_submit, g, ring, slot, items)
        cancelled = False
        try:
            seq = await _landed(submitted)
        except asyncio.CancelledError:
            if submitted.cancelled() or submitted.exception() is not None:
                self._free(ring, slot)
                raise
            seq, cancelled = submitted.result(), True  # in flight: wait for its fence all the same
        except BaseException:
            self._free(ring, slot)
            raise
        fence = loop.run_in_executor(ring.waiter, self._wait, g, ring, seq, first, items[0][1], len(items))
        try:
            await _landed(fence)
        finally:
            self._free(ring, slot)  # the GPU is done with the slot's IB
        if cancelled:
            raise asyncio.CancelledError()

    async def _slot(self, ring: Ring) -> int:
        """A free IB slot of the ring (on the event loop): waits, without blocking the loop, while all are in flight."""
        while not ring.free_slots:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            ring.slot_waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake(ring)  # we were handed a slot's wake-up: pass it on
                else:
                    try:
                        ring.slot_waiters.remove(waiter)
                    except ValueError:
                        pass
                raise
        return ring.free_slots.pop()

    def _free(self, ring: Ring, slot: int) -> None:
        ring.free_slots.append(slot)
        self._wake(ring)

    @staticmethod
    def _wake(ring: Ring) -> None:
        while ring.slot_waiters:
            w = ring.slot_waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    def _prepare_and_submit(self, g: GpuDevice, ring: Ring, slot: int, items: list[CopyItem]) -> int:
        """In the GPU's submit thread: import BOs and register staging on first use, build the IB, submit."""
        copies = []
        for h, bo_off, buf, buf_off, n in items:
            assert isinstance(h, SdmaBo)
            if h.bo is None:
                g.import_bo(h)
            if h.va_handle is None:
                g.map_bo(h)
            bo_va = h.va + h.ref.offset + bo_off
            st_va = g.userptr_va(buf) + buf_off
            copies.append((bo_va, st_va, n) if h.direction is Direction.READ else (st_va, bo_va, n))
        ib = copy_linear_packets(copies, g.family, self.lib.AMDGPU_FAMILY_AI)
        first = items[0][0]
        bo_list = self._bo_list(g, ring, items)
        try:
            return self._submit(ring, slot, ib, first, items[0][1], bo_list)
        finally:  # the kernel looked the list up at submit
            self.driver.cleanup(self.lib.amdgpu_bo_list_destroy(bo_list), "amdgpu_bo_list_destroy")

    def _bo_list(self, g: GpuDevice, ring: Ring, items: Sequence[CopyItem]) -> Handle:
        """The BOs a submission touches (BOs, staging userptrs, the IB): the kernel makes them resident."""
        ffi, lib = self.ffi, self.lib
        handles = {id(ring.ib_bo): ring.ib_bo}
        key = (BackendKind.SDMA, g.gpu_id)
        for h, _, buf, _, _ in items:
            assert isinstance(h, SdmaBo)
            handles[id(h.bo)] = h.bo
            ub = buf.backend_state[key][0]
            handles[id(ub)] = ub
        arr = ffi.new("amdgpu_bo_handle[]", list(handles.values()))
        out = ffi.new("amdgpu_bo_list_handle *")
        self.driver.rc(lib.amdgpu_bo_list_create(g.dev, len(handles), arr, ffi.NULL, out), "amdgpu_bo_list_create",
                 bo_id=items[0][0].bo_id, offset=items[0][1])
        return out[0]

    def _submit(self, ring: Ring, slot: int, ib: array.array[int], h: BoHandle, offset: int,
                bo_list: Handle) -> int:
        ffi, lib = self.ffi, self.lib
        nbytes = len(ib) * 4
        if nbytes > IB_SLOT_BYTES:
            raise BackendError(f"a batch needs an IB of {nbytes} bytes (slot: {IB_SLOT_BYTES})", bo_id=h.bo_id,
                               offset=offset)
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
        self.driver.rc(lib.amdgpu_cs_submit(ring.ctx, 0, req, 1),
                 f"amdgpu_cs_submit (ring {ring.index})", bo_id=h.bo_id, offset=offset)
        seq: int = req.seq_no
        return seq

    def _wait(self, g: GpuDevice, ring: Ring, seq: int, h: BoHandle, offset: int, ncopies: int) -> None:
        """In the ring's waiter thread: wait for the fence, then ask whether the job faulted."""
        ffi, lib = self.ffi, self.lib
        fence = ffi.new("struct amdgpu_cs_fence *")
        fence.context = ring.ctx
        fence.ip_type = lib.AMDGPU_HW_IP_DMA
        fence.ring = ring.index
        fence.fence = seq
        expired = ffi.new("uint32_t *")
        self.driver.rc(lib.amdgpu_cs_query_fence_status(fence, TIMEOUT_INFINITE, 0, expired),
                   "amdgpu_cs_query_fence_status", bo_id=h.bo_id, offset=offset)
        if not expired[0]:
            raise BackendError("SDMA fence did not signal", bo_id=h.bo_id, offset=offset)
        flags = ffi.new("uint64_t *")
        self.driver.rc(lib.amdgpu_cs_query_reset_state2(ring.ctx, flags), "amdgpu_cs_query_reset_state2",
                   bo_id=h.bo_id, offset=offset)
        if flags[0] & (lib.AMDGPU_CTX_QUERY2_FLAGS_GUILTY | lib.AMDGPU_CTX_QUERY2_FLAGS_VRAMLOST):
            self._renew_context(g, ring)
            raise BackendError(
                f"SDMA job of {ncopies} copies failed on ring {ring.index}: the GPU marked the context guilty "
                f"(VM fault or invalid packet){' [software model]' if self.model else ''}",
                bo_id=h.bo_id, offset=offset)

    def _renew_context(self, g: GpuDevice, ring: Ring) -> None:
        """A guilty context refuses further work: replace it (jobs queued on it fail with it)."""
        ctx = self.ffi.new("amdgpu_context_handle *")
        if self.lib.amdgpu_cs_ctx_create(g.dev, ctx) == 0:
            # the old one is freed at close: fences still being waited for refer to it
            g.retired.append(ring.ctx)
            ring.ctx = ctx[0]

    def close(self) -> None:
        with self._lock:
            submitters = list(self._submitters.values())
            self._submitters.clear()
        for ex in submitters:  # queued releases run first
            ex.shutdown(wait=True)
        for g in self._gpus.values():
            g.close()
        self._gpus.clear()


T = TypeVar("T")


async def _landed(fut: asyncio.Future[T]) -> T:
    """Await work already handed to a thread (or the GPU) that cannot be called back: if the awaiting
    task is cancelled, wait for it to finish all the same, then re-raise the cancellation."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            try:
                await asyncio.wait([fut])
            except asyncio.CancelledError:
                pass
        raise
