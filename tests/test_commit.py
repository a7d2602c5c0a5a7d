"""An image is committed atomically: a dump that dies or fails never leaves a readable image."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from helpers import Workload, engine, run

from vramd import errors, inproc
from vramd.backends import BoRef
from vramd.engine import BoSpec, RestoreTarget
from vramd.image.names import LOCK_NAME, MANIFEST_NAME

MiB = 1 << 20


def test_failed_dump_keeps_the_previous_image(image_dir):
    path, dfd = image_dir
    good = os.urandom(2 * MiB)
    fd = os.memfd_create("bo")
    os.write(fd, good)
    small = os.memfd_create("small")
    os.ftruncate(small, 10)

    async def go():
        async with engine(staging_budget=8 * MiB, chunk_size=MiB) as e:
            first = await inproc.dump(e, dfd, [BoSpec(1, len(good), BoRef("mmap", fd))])
            before = sorted(os.listdir(path))
            with pytest.raises(errors.TargetTooSmallError):
                await inproc.dump(e, dfd, [BoSpec(1, len(good), BoRef("mmap", fd)),
                                          BoSpec(2, 4096, BoRef("mmap", small))])
            assert sorted(os.listdir(path)) == before
            os.pwrite(fd, b"\0" * len(good), 0)
            await inproc.restore(e, dfd, [RestoreTarget(1, BoRef("mmap", fd))])
            return first
    try:
        run(go())
        assert os.pread(fd, len(good), 0) == good
    finally:
        os.close(fd)
        os.close(small)


def test_redump_replaces_image_and_removes_old_data(image_dir):
    path, dfd = image_dir
    fd = os.memfd_create("bo")
    os.write(fd, os.urandom(MiB))

    async def go():
        async with engine(staging_budget=8 * MiB, chunk_size=MiB) as e:
            a = await inproc.dump(e, dfd, [BoSpec(1, MiB, BoRef("mmap", fd))])
            b = await inproc.dump(e, dfd, [BoSpec(1, MiB, BoRef("mmap", fd))])
            return a, b
    try:
        a, b = run(go())
    finally:
        os.close(fd)
    assert sorted(os.listdir(path)) == sorted([MANIFEST_NAME, *(f.name for f in b.files)])
    assert not {f.name for f in a.files} & {f.name for f in b.files}


def test_one_dump_per_directory(image_dir):
    _, dfd = image_dir

    async def go():
        async with engine(staging_budget=8 * MiB, chunk_size=MiB) as e:
            async with await inproc.start_dump(e, dfd) as s:
                try:
                    with pytest.raises(errors.InvalidRequestError, match="another dump"):
                        await inproc.start_dump(e, dfd)
                finally:
                    await s.cancel()
                    with pytest.raises(errors.JobCancelledError):
                        await s.finish()
            async with await inproc.start_dump(e, dfd) as again:  # the lock was released
                await again.cancel()
                with pytest.raises(errors.JobCancelledError):
                    await again.finish()
    run(go())


KILLED_DUMP = textwrap.dedent("""
    import asyncio, os, sys, uvloop
    from vramd import inproc
    from vramd.engine import Engine, EngineConfig
    from vramd.engine import BoSpec
    from vramd.backends import BoRef
    pid, addr, size, dirpath = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    async def main():
        dfd = os.open(dirpath, os.O_RDONLY | os.O_DIRECTORY)
        mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        async with Engine(EngineConfig(staging_budget=16 << 20, chunk_size=1 << 20)) as e:
            s = await inproc.start_dump(e, dfd)
            await s.add([BoSpec(1, size, BoRef("procmem", mem, addr))])  # its data files made, its copies begun
            print("mid-dump", flush=True)
            sys.stdin.readline()   # blocks the loop here until the test kills us
            await s.finish()
        print("committed", flush=True)
    uvloop.run(main())
""")


def _kill_a_dump_mid_way(path):
    """A process dumping 64 MiB into `path`, SIGKILLed once it is mid-dump."""
    with Workload([{"size": 64 * MiB, "fill": "random"}]) as w:
        r = w.regions[0]
        p = subprocess.Popen([sys.executable, "-c", KILLED_DUMP, str(w.pid), str(r["addr"]), str(r["size"]),
                              str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "mid-dump"
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
        p.stdin.close()


def test_sigkill_mid_dump_leaves_no_image(image_dir):
    path, dfd = image_dir
    _kill_a_dump_mid_way(path)
    left = [n for n in os.listdir(path) if n != LOCK_NAME]  # a dead holder's lock file: harmless
    assert MANIFEST_NAME not in left
    assert left and all(n.endswith(".tmp") for n in left)  # only temporaries, never a final name

    async def go():
        async with engine(staging_budget=8 * MiB) as e:
            await inproc.verify(e, dfd)
    with pytest.raises(errors.ManifestMissingError):
        run(go())


def test_vramctl_gc_removes_a_killed_dumps_temporaries_and_waits_for_a_live_dump(image_dir, tmp_path):
    """A dump killed mid-way leaves only temporaries; `vramctl gc` removes them (vramd's own names only),
    and refuses while a dump holds the directory."""
    from helpers import ROOT

    from vramd.imagedir import lock_directory
    path, dfd = image_dir
    _kill_a_dump_mid_way(path)
    left = sorted(n for n in os.listdir(path) if n != LOCK_NAME)  # a dead holder's lock file: harmless
    assert left and all(n.endswith(".tmp") for n in left)
    (path / "notes.txt.tmp").write_text("not vramd's")

    def gc():
        return subprocess.run([sys.executable, "-m", "vramd.cli", "gc", str(path), "--json"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    held = lock_directory(dfd)  # a dump writing into it: nothing is garbage
    try:
        r = gc()
        assert r.returncode == 1 and "another dump" in r.stderr, r.stderr
    finally:
        held.release()
    r = gc()
    assert r.returncode == 0, r.stderr
    import json
    assert sorted(json.loads(r.stdout)["removed"]) == left
    assert os.listdir(path) == ["notes.txt.tmp"]
