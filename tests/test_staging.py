"""The staging pool never maps more than its budget and reuses its buffers."""
import asyncio

import pytest
from helpers import run

from vramd.errors import InvalidRequestError
from vramd.hostmem.staging import StagingPool, buffer_unit

MiB = 1 << 20


def test_budget_bounds_concurrent_chunks():
    async def go():
        pool = StagingPool(10 * MiB)
        unit = buffer_unit(MiB)
        fits = pool.max_buffers(MiB)
        live = peak = 0

        async def one(n):
            nonlocal live, peak
            bufs = await pool.acquire(MiB, n)
            live += n
            peak = max(peak, live)
            assert pool.allocated_bytes <= pool.budget
            await asyncio.sleep(0)  # yield so others contend (not synchronisation)
            live -= n
            pool.release(bufs)

        await asyncio.gather(*(one(1 + i % 2) for i in range(200)))
        assert peak <= fits and pool.peak_in_use_bytes <= pool.budget
        assert pool.allocated_bytes == fits * unit  # created once, then reused
        # a different chunk size evicts idle buffers instead of growing past the budget
        big = await pool.acquire(4 * MiB, 2)
        assert pool.allocated_bytes <= pool.budget
        pool.release(big)
        with pytest.raises(InvalidRequestError):
            await pool.acquire(8 * MiB, 2)
        pool.close()
    run(go())


def test_cancelled_waiter_does_not_leak():
    async def go():
        pool = StagingPool(3 * buffer_unit(MiB))
        held = await pool.acquire(MiB, 3)
        waiter = asyncio.create_task(pool.acquire(MiB, 2))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        pool.release(held)
        again = await pool.acquire(MiB, 3)
        assert pool.in_use_bytes == 3 * buffer_unit(MiB)
        pool.release(again)
        assert pool.in_use_bytes == 0
        pool.close()
    run(go())


def _vma_kib(address: int, field: str) -> int:
    """A field (Rss, AnonHugePages, ...) of the mapping of this process that holds `address`, in KiB."""
    found, inside = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == field + ":":
                found = int(line.split()[1])
    assert found is not None, f"no mapping holds {address:#x}"
    return found


def _resident(address: int, length: int) -> int:
    """Bytes of [address, address + length) in memory (mincore), whatever mappings the kernel merged."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-length // 4096)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) * 4096


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


@pytest.mark.parametrize("huge", [True, False])
def test_big_staging_buffers_sit_on_huge_pages_and_never_hold_more_than_their_size(huge):
    """8 MiB chunks take buffers of 8 MiB + 4 KiB: with huge pages, the four whole 2 MiB pieces are huge pages
    and the 4 KiB tail a small page, so a buffer touched end to end holds its size, not 10 MiB; without, none
    is huge (the kernel here makes only advised memory huge)."""
    mode = _thp_mode()
    if mode == "never" or (mode == "always" and not huge):
        pytest.skip(f"transparent huge pages are '{mode}' here")

    async def go():
        pool = StagingPool(64 * MiB, huge_pages=huge)
        bufs = await pool.acquire(8 * MiB, 4)
        unit = buffer_unit(8 * MiB)
        try:
            for b in bufs:
                assert len(b.view) == b.size == unit
                b.view[:] = b"\x5a" * unit  # every byte touched: nothing left to fault in later
                # its size, never a whole huge page more, over all it maps (a whole number of huge pages)
                assert _resident(b.address, len(b.mm)) == unit
                if huge:
                    assert b.address % (2 * MiB) == 0
                    assert _vma_kib(b.address, "AnonHugePages") >= 6 * 1024  # most of it; compaction may miss one
                else:
                    assert _vma_kib(b.address, "AnonHugePages") == 0
        finally:
            pool.release(bufs)
            pool.close()
    run(go())


def test_a_buffer_the_pool_cannot_have_fails_its_acquire_and_costs_the_pool_nothing():
    """A buffer refused when it is mapped (here by an on_alloc hook, as an SDMA backend's registration of it
    may be): that acquire fails with the hook's error and nothing stays counted, in use or mapped.  A waiter
    that a release would have served gets the error, not the releaser, and is not left waiting; the pool
    then serves as before."""
    from vramd.errors import BackendError

    def refuse(buf):
        raise BackendError(f"cannot register {buf.size} bytes of staging")

    async def go():
        unit = buffer_unit(MiB)
        pool = StagingPool(3 * unit)
        pool.on_alloc.append(refuse)
        with pytest.raises(BackendError, match="cannot register"):
            await pool.acquire(MiB, 2)
        assert pool.in_use_bytes == 0 and pool.allocated_bytes == 0
        pool.on_alloc.clear()
        held = await pool.acquire(MiB, 3)  # the whole budget
        waiter = asyncio.create_task(pool.acquire(2 * MiB, 1))  # a size no idle buffer has: mapped when served
        await asyncio.sleep(0)  # it queues (not synchronisation: asserted next)
        assert not waiter.done() and pool._waiters
        pool.on_alloc.append(refuse)
        pool.release(held)  # serves the waiter, whose buffer is refused
        with pytest.raises(BackendError, match="cannot register"):
            await waiter
        assert pool.in_use_bytes == 0 and not pool._waiters
        assert pool.allocated_bytes <= pool.budget
        pool.on_alloc.clear()
        again = await pool.acquire(2 * MiB, 1)
        assert pool.in_use_bytes == buffer_unit(2 * MiB)
        pool.release(again)
        pool.close()
    run(go())


def test_staging_the_host_cannot_map_is_a_job_error():
    """Where the host cannot map a staging buffer (here its address space is limited: RLIMIT_AS, in a child
    process), acquire fails with JobError naming staging memory, not a bare OSError (INTERNAL), and nothing
    stays counted in use."""
    import subprocess
    import sys
    import textwrap

    from helpers import ROOT
    code = textwrap.dedent("""
        import asyncio, resource
        from vramd.errors import JobError
        from vramd.hostmem.staging import StagingPool
        MiB = 1 << 20
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + 16 * MiB, resource.getrlimit(resource.RLIMIT_AS)[1]))
        async def main():
            pool = StagingPool(256 * MiB)
            try:
                await pool.acquire(64 * MiB, 2)
            except JobError as e:
                print("JobError:", e, pool.in_use_bytes)
        asyncio.run(main())
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("JobError: cannot map ")
    assert "bytes of staging memory: Cannot allocate memory" in r.stdout
    assert r.stdout.split()[-1] == "0"
