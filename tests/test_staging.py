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
