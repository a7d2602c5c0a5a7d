"""The pipeline over an asynchronous engine (vramd.testing.FakeDmaBackend): completion from another thread,
batches as single submissions, and an injected fault reported with its BO and offset."""
from __future__ import annotations

import os

import pytest
from helpers import memfd, run

from vramd import inproc
from vramd.backends import BoRef
from vramd.engine import BoSpec, Engine, EngineConfig, RestoreTarget
from vramd.errors import BackendError
from vramd.testing import FakeDmaBackend

MiB = 1 << 20


def _engine(fake: FakeDmaBackend) -> Engine:
    return Engine(EngineConfig(staging_budget=16 * MiB, chunk_size=MiB), backends={"fake": fake})


def test_round_trip_through_an_asynchronous_engine(image_dir):
    _, dfd = image_dir
    sizes = [1, 4096, 5000, 3 * MiB + 17, 100]
    datas = [os.urandom(n) for n in sizes]
    srcs = [memfd(d) for d in datas]
    dsts = [memfd(size=n) for n in sizes]
    fake = FakeDmaBackend(delay=0.001)

    async def go():
        async with _engine(fake) as e:
            await inproc.dump(e, dfd, [BoSpec(i + 1, n, BoRef("fake", fd))
                                      for i, (fd, n) in enumerate(zip(srcs, sizes))])
            dumped = fake.submissions
            await inproc.restore(e, dfd, [RestoreTarget(i + 1, BoRef("fake", fd)) for i, fd in enumerate(dsts)])
            return dumped
    dumped = run(go())
    assert [os.pread(fd, n, 0) for fd, n in zip(dsts, sizes)] == datas
    assert dumped < sum(-(-n // MiB) for n in sizes)  # small BOs shared submissions
    for fd in srcs + dsts:
        os.close(fd)


def test_a_fault_names_its_bo_and_offset_and_commits_nothing(image_dir):
    path, dfd = image_dir
    src = memfd(os.urandom(4 * MiB))
    fake = FakeDmaBackend()
    fake.fail_at.add((9, 2 * MiB))

    async def go():
        async with _engine(fake) as e:
            await inproc.dump(e, dfd, [BoSpec(9, 4 * MiB, BoRef("fake", src))])
    with pytest.raises(BackendError) as ei:
        run(go())
    assert (ei.value.bo_id, ei.value.offset) == (9, 2 * MiB)
    assert os.listdir(path) == []
    os.close(src)
