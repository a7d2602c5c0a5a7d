"""End to end through a real daemon process on a real socket."""
from __future__ import annotations

import os
import threading

import pytest
from helpers import memfd, open_dir

from vramd.client import SESSION_DUMP, SESSION_RESTORE, SESSION_VERIFY, Client, ClientBo
from vramd.errors import BadDescriptorError, NotFoundError, TargetTooSmallError, UnmappedRangeError, WaitTimeoutError
from vramd.pb import rpc_pb2 as rpc
from vramd.testing import Workload, blank_spec_like

SPEC = [
    {"size": (3 << 20) + 123, "fill": "random", "seed": 1},
    {"size": 1 << 20, "fill": "zero"},
    {"size": 5000, "fill": "pattern", "seed": 2, "skew": 77},
    {"size": 1, "fill": "random", "seed": 3},
]


def procmem_bos(w: Workload, mem: int) -> list[ClientBo]:
    return [ClientBo(i + 1, mem, offset=r["addr"], size=r["size"], va_addr=r["addr"]) for i, r in enumerate(w.regions)]


def dump(c: Client, dir_fd: int, bos: list[ClientBo], **kw) -> rpc.SessionInfo:
    return c.run_session(SESSION_DUMP, dir_fd, bos, **kw)


def test_dump_restore_with_offload_wait_on_another_connection(daemon, image_dir):
    _, dfd = image_dir
    with Workload(SPEC) as w:
        digests = w.digests()
        mem = w.open_mem()
        with Client(daemon.socket) as c:
            info = dump(c, dfd, procmem_bos(w, mem), compression="zstd")
        os.close(mem)
    assert info.state == rpc.SESSION_DONE
    assert info.image.bo_count == len(SPEC) and info.image.bo_bytes == sum(r["size"] for r in SPEC)
    assert info.progress.bytes_done == info.progress.bytes_total == info.image.bo_bytes

    with Workload(blank_spec_like(w.regions)) as w2:
        assert w2.digests() != digests
        mem2 = w2.open_mem(os.O_RDWR)
        with Client(daemon.socket) as submitter, Client(daemon.socket) as waiter:
            s = submitter.open_session(SESSION_RESTORE, dfd)
            assert s.image.bo_count == len(SPEC)
            submitter.add_bos(s.token, [ClientBo(i + 1, mem2, offset=r["addr"]) for i, r in enumerate(w.regions)])
            submitter.start(s.token)
            submitter.close()  # the restored task goes on with its life; CRIU main waits
            final = waiter.wait(s.token)
            assert final.state == rpc.SESSION_DONE
            assert final.progress.bos_done == len(SPEC)
            waiter.close_session(s.token)
            with pytest.raises(NotFoundError):
                waiter.progress(s.token)
        os.close(mem2)
        assert w2.digests() == digests


def test_verify_session_and_progress_while_running(daemon, image_dir):
    _, dfd = image_dir
    with Workload(SPEC) as w, Client(daemon.socket) as c:
        mem = w.open_mem()
        s = c.open_session(SESSION_DUMP, dfd, label="unsealed")
        c.add_bos(s.token, procmem_bos(w, mem))
        os.close(mem)
        with pytest.raises(WaitTimeoutError):  # not sealed: the barrier cannot pass
            c.wait(s.token, timeout=0.05)
        listed = {i.session_id: i for i in c.sessions()}
        assert listed[s.session_id].label == "unsealed" and listed[s.session_id].state == rpc.SESSION_OPEN
        c.start(s.token)
        assert c.wait(s.token).state == rpc.SESSION_DONE
        v = c.open_session(SESSION_VERIFY, dfd)
        final = c.wait(v.token)
        assert final.state == rpc.SESSION_DONE and final.progress.bos_done == len(SPEC)


def test_four_sessions_at_once(daemon, tmp_path):
    results, errors = {}, []

    def one(n: int) -> None:
        try:
            spec = [{"size": (2 << 20) + n * 4099, "fill": "random", "seed": 10 + n},
                    {"size": 333 * (n + 1), "fill": "pattern", "seed": n}]
            d = tmp_path / f"img{n}"
            d.mkdir()
            dfd = open_dir(d)
            with Workload(spec) as w, Client(daemon.socket) as c:
                mem = w.open_mem()
                s = c.open_session(SESSION_DUMP, dfd, compression="zstd" if n % 2 else "none", label=f"t{n}")
                c.add_bos(s.token, procmem_bos(w, mem))
                c.start(s.token)
                c.wait(s.token)
                os.close(mem)
                with Workload(blank_spec_like(w.regions)) as w2:
                    mem2 = w2.open_mem(os.O_RDWR)
                    r = c.open_session(SESSION_RESTORE, dfd)
                    c.add_bos(r.token, [ClientBo(i + 1, mem2, offset=x["addr"]) for i, x in enumerate(w.regions)])
                    c.start(r.token)
                    c.wait(r.token)
                    os.close(mem2)
                    results[n] = w2.digests() == w.digests()
            os.close(dfd)
        except Exception as e:  # reported below, with the thread's number
            errors.append((n, e))

    threads = [threading.Thread(target=one, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == {0: True, 1: True, 2: True, 3: True}
    with Client(daemon.socket) as c:  # listing works after the rush, and shows only its finished sessions
        for info in c.sessions():       # (not yet reaped: their connections closed within the grace period)
            assert info.label in {"", "t0", "t1", "t2", "t3"} and info.state == rpc.SESSION_DONE, info


def test_typed_errors_name_the_bo_and_daemon_keeps_serving(daemon, image_dir, tmp_path):
    _, dfd = image_dir
    sub = tmp_path / "somedir"
    sub.mkdir()
    with Client(daemon.socket) as c:
        baseline = daemon.fds()  # with this connection's socket in it
        # a directory where a BO fd is expected
        dir_as_bo = open_dir(sub)
        s = c.open_session(SESSION_DUMP, dfd)
        with pytest.raises(BadDescriptorError) as e:
            c.add_bos(s.token, [ClientBo(7, dir_as_bo, size=4096, backend="mmap")])
        assert e.value.bo_id == 7 and "directory" in e.value.message
        with pytest.raises(BadDescriptorError):  # the session keeps its first error
            c.wait(s.token)
        c.close_session(s.token)
        os.close(dir_as_bo)

        # a file smaller than the BO
        small = memfd(b"x" * 100)
        s = c.open_session(SESSION_DUMP, dfd)
        with pytest.raises(TargetTooSmallError) as e:
            c.add_bos(s.token, [ClientBo(8, small, size=1 << 20, backend="mmap")])
        assert e.value.bo_id == 8
        c.close_session(s.token)
        os.close(small)

        # an fd index that names no attached fd (what a client that lost its fd sends)
        s = c.open_session(SESSION_DUMP, dfd)
        resp = c.request(add_bos=rpc.AddBos(token=s.token, bos=[rpc.Bo(id=9, size=10, fd_index=3)]))
        assert resp.error.code == rpc.BAD_DESCRIPTOR and "fd index 3" in resp.error.message
        c.close_session(s.token)

        # an unmapped address in a live process
        with Workload([{"size": 8192, "fill": "random", "seed": 5}]) as w:
            mem = w.open_mem()
            s = c.open_session(SESSION_DUMP, dfd)
            with pytest.raises(UnmappedRangeError) as e:
                c.add_bos(s.token, [ClientBo(10, mem, offset=0x1000, size=4096, backend="procmem")])
            assert e.value.bo_id == 10 and "0x1000" in e.value.message
            c.close_session(s.token)
            os.close(mem)

        # nothing was committed by any of the failed dumps, and the daemon still works
        assert not os.path.exists(os.path.join(image_dir[0], "manifest.vrdm"))
        bo = memfd(os.urandom(10000))
        assert dump(c, dfd, [ClientBo(1, bo, size=10000)]).state == rpc.SESSION_DONE
        os.close(bo)
        assert daemon.fds() == baseline


def test_sigterm_drains_sealed_session_and_exits_cleanly(run_dir, image_dir):
    from vramd.testing import DaemonProcess
    _, dfd = image_dir
    with DaemonProcess(run_dir, "--drain-timeout", "60") as d, Client(d.socket) as c:
        bo = memfd(os.urandom(3 << 20))
        s = c.open_session(SESSION_DUMP, dfd)
        c.add_bos(s.token, [ClientBo(1, bo, size=3 << 20)])
        c.start(s.token)
        d.terminate()
        d.expect_note("STOPPING=1")
        assert c.wait(s.token).state == rpc.SESSION_DONE  # the sealed session finished during the drain
        c.close()
        assert d.stop() == 0
        os.close(bo)
    assert os.path.exists(os.path.join(image_dir[0], "manifest.vrdm"))
    assert not os.path.exists(os.path.join(run_dir, "vramd.sock"))
