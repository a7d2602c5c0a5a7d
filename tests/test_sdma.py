"""The SDMA backend, verified against the software model of libdrm_amdgpu + SDMA (native/model/).

There is no AMD GPU here: every SDMA copy in these tests is executed by the
model, which parses the real packets, keeps a per-device VA map, and turns
any access outside a mapping into a VM fault that fails the submission.
"""
from __future__ import annotations

import os

import pytest
from helpers import memfd, run

from vramd import inproc
from vramd.backends import BoRef
from vramd.backends.sdma import backend as sdma_mod
from vramd.backends.sdma.binding import MODEL_PATH
from vramd.backends.sdma.packets import copy_linear_packets, max_copy_bytes
from vramd.errors import BackendError, TargetTooSmallError

AI = 141
MiB = 1 << 20

def dmabuf(data: bytes = b"", size: int | None = None) -> int:
    """A memfd standing for a dmabuf: real dmabufs are whole pages, and the model insists."""
    n = len(data) if size is None else size
    return memfd(data, -(-max(n, 1) // 4096) * 4096)


needs_model = pytest.mark.skipif(
    not os.path.exists(MODEL_PATH),
    reason="the SDMA model is not built (needs libdrm-dev at install time; ./dev.sh installs it)")


def test_packets_count_field_per_family():
    ib = copy_linear_packets([(0x1000, 0x200000000, 5 * MiB)], AI, AI)
    assert len(ib) % 8 == 0
    # two packets: 4 MiB (the family's limit) and 1 MiB; count = bytes - 1 on AI and later
    assert ib[0] == 0x1 and ib[1] == 4 * MiB - 1 and ib[2] == 0
    assert (ib[3], ib[4], ib[5], ib[6]) == (0x1000, 0, 0, 2)
    assert ib[7] == 0x1 and ib[8] == MiB - 1 and ib[10] == 0x1000 + 4 * MiB
    assert all(d == 0 for d in ib[14:])  # NOP padding
    old = copy_linear_packets([(0, 0, max_copy_bytes(120, AI) + 1)], 120, AI)
    assert old[1] == max_copy_bytes(120, AI) and old[8] == 1  # count = bytes before AI


def test_binding_is_built_when_libdrm_is_installed():
    import shutil
    import subprocess
    if shutil.which("pkg-config") is None or subprocess.run(["pkg-config", "--exists", "libdrm_amdgpu"]).returncode:
        pytest.skip("libdrm-dev not installed")
    from vramd.backends.sdma.binding import load
    ffi, lib, path = load("model")  # this process runs on the model (the system library needs a GPU)
    assert path == MODEL_PATH and hasattr(lib, "amdgpu_cs_submit")
    assert ffi.sizeof("struct amdgpu_cs_request") > 0


def _engine():
    from vramd.engine import Engine, EngineConfig
    return Engine(EngineConfig(staging_budget=64 * MiB, chunk_size=4 * MiB, sdma_library="model"))


def _bo(fd, size, bo_id, gpu):
    from vramd.engine import BoSpec
    return BoSpec(bo_id, size, BoRef("sdma", fd, 0), gpu_id=gpu)


@needs_model
def test_round_trip_on_two_gpus_unaligned_sizes(image_dir):
    from vramd.engine import RestoreTarget
    _, dfd = image_dir
    sizes = [1, 4096, 5000, 3 * MiB + 17, 9 * MiB]
    datas = [os.urandom(n) for n in sizes]
    srcs = [dmabuf(d) for d in datas]
    dsts = [dmabuf(size=n) for n in sizes]

    async def go():
        async with _engine() as e:
            assert "sdma" in e.backends, e.unavailable
            m = await inproc.dump(e, dfd, [_bo(fd, n, i + 1, 1 + i % 2) for i, (fd, n) in enumerate(zip(srcs, sizes))])
            await inproc.restore(e, dfd, [RestoreTarget(i + 1, BoRef("sdma", fd)) for i, fd in enumerate(dsts)])
            return m
    m = run(go())
    assert {b.gpu_id for b in m.bos} == {1, 2}
    for fd, d in zip(dsts, datas):
        assert os.pread(fd, len(d), 0) == d
        if len(d) % 4096:
            assert os.pread(fd, 1, len(d)) == b"\0"  # nothing written past the BO's end
    for fd in srcs + dsts:
        os.close(fd)


@needs_model
def test_copy_log_counts_every_copied_byte_and_the_engines_cpu(image_dir, monkeypatch, tmp_path):
    """VRAMD_SDMA_MODEL_COPY_LOG: each job appends "<pid> <bytes> <ns>"; over a dump and a restore the
    bytes add up to twice the BOs' (each byte copied once each way) and the CPU time is the engine's."""
    from vramd.engine import RestoreTarget
    log = tmp_path / "copies.log"
    monkeypatch.setenv("VRAMD_SDMA_MODEL_COPY_LOG", str(log))
    _, dfd = image_dir
    sizes = [4096, 3 * MiB + 4096, 9 * MiB]
    datas = [os.urandom(n) for n in sizes]
    srcs, dsts = [dmabuf(d) for d in datas], [dmabuf(size=n) for n in sizes]

    async def go():
        async with _engine() as e:
            await inproc.dump(e, dfd, [_bo(fd, n, i + 1, 1) for i, (fd, n) in enumerate(zip(srcs, sizes))])
            await inproc.restore(e, dfd, [RestoreTarget(i + 1, BoRef("sdma", fd)) for i, fd in enumerate(dsts)])
    run(go())
    lines = [tuple(map(int, ln.split())) for ln in log.read_text().splitlines()]
    assert lines and all(pid == os.getpid() and n > 0 and ns > 0 for pid, n, ns in lines)
    assert sum(n for _, n, _ in lines) == 2 * sum(sizes)
    for fd, d in zip(dsts, datas):
        assert os.pread(fd, len(d), 0) == d
    for fd in srcs + dsts:
        os.close(fd)


@needs_model
def test_target_smaller_than_the_bo(image_dir):
    small = dmabuf(size=4096)

    async def go():
        async with _engine() as e:
            await inproc.dump(e, image_dir[1], [_bo(small, 8192, 3, 0)])
    with pytest.raises(TargetTooSmallError) as ei:
        run(go())
    assert ei.value.bo_id == 3
    os.close(small)


@needs_model
@pytest.mark.parametrize("fault", ["criu_count", "bad_opcode"])
def test_model_catches_wrong_packets(image_dir, monkeypatch, fault):
    """CRIU's count encoding (count = bytes on AI) reads one byte past the BO: a VM fault, reported."""
    real = sdma_mod.copy_linear_packets

    def wrong(copies, family, ai):
        ib = real(copies, family, ai)
        for i in range(0, len(ib), 7):
            if ib[i] == 0x1:
                if fault == "criu_count":
                    ib[i + 1] += 1  # count = bytes
                else:
                    ib[i] = 0x7F    # no such opcode
                break
        return ib
    monkeypatch.setattr(sdma_mod, "copy_linear_packets", wrong)
    bo = dmabuf(os.urandom(2 * MiB))

    async def go():
        async with _engine() as e:
            await inproc.dump(e, image_dir[1], [_bo(bo, 2 * MiB, 5, 0)])
    with pytest.raises(BackendError) as ei:
        run(go())
    assert ei.value.bo_id == 5 and "guilty" in ei.value.message and "software model" in ei.value.message
    assert os.listdir(image_dir[0]) == []  # nothing committed
    os.close(bo)


@pytest.mark.slow
@needs_model
def test_bo_larger_than_4_gib(image_dir):
    from vramd.engine import RestoreTarget
    size = (4 << 30) + 3 * MiB
    src = dmabuf(size=size)  # sparse: zeros, plus marks at both ends and across the 4 GiB line
    marks = {0: b"head", (4 << 30) - 2: b"span4G", size - 4: b"tail"}
    for off, data in marks.items():
        os.pwrite(src, data, off)
    dst = dmabuf(size=size)
    os.pwrite(dst, b"garbage!", 0)

    async def go():
        async with _engine() as e:
            m = await inproc.dump(e, image_dir[1], [_bo(src, size, 1, 0)])
            await inproc.restore(e, image_dir[1], [RestoreTarget(1, BoRef("sdma", dst))])
            return m
    m = run(go())
    assert m.totals.bo_bytes == size
    for off, data in marks.items():
        assert os.pread(dst, len(data), off) == data
    assert os.pread(dst, 4, 4) == b"\0" * 4
    os.close(src)
    os.close(dst)


@needs_model
def test_through_the_daemon_on_the_model(run_dir, image_dir):
    from vramd.client import SESSION_DUMP, SESSION_RESTORE, Client, ClientBo
    from vramd.pb import rpc_pb2 as rpc
    from vramd.testing import DaemonProcess
    _, dfd = image_dir
    sizes = [3 * MiB + 5, 4096, 12345, 10 * MiB]
    datas = [os.urandom(n) for n in sizes]
    srcs, dsts = [dmabuf(d) for d in datas], [dmabuf(size=n) for n in sizes]
    cfg = os.path.join(run_dir, "gpus.toml")  # no KFD topology here: the gpu_ids a BO may name are configured
    with open(cfg, "w") as f:
        f.write("gpu_ids = [0x100, 0x101, 0x102]\n")
    with DaemonProcess(run_dir, "--chunk-size", "2M", "--config", cfg, env={"VRAMD_AMDGPU_LIBRARY": "model"}) as d, \
            Client(d.socket) as c:
        sdma = {b.name: b for b in c.hello.backends}["sdma"]
        assert sdma.available and sdma.asynchronous_dma and "MODEL" in sdma.description
        s = c.open_session(SESSION_DUMP, dfd)
        c.add_bos(s.token, [ClientBo(i + 1, fd, size=n, backend="sdma", gpu_id=0x100 + i % 3)
                            for i, (fd, n) in enumerate(zip(srcs, sizes))])
        c.start(s.token)
        assert c.wait(s.token).state == rpc.SESSION_DONE
        r = c.open_session(SESSION_RESTORE, dfd)
        c.add_bos(r.token, [ClientBo(i + 1, fd, backend="sdma") for i, fd in enumerate(dsts)])
        c.start(r.token)
        assert c.wait(r.token).state == rpc.SESSION_DONE
        assert 'vramd_bytes_total{backend="sdma",direction="write"} ' + str(sum(sizes)) in c.status().metrics
    for fd, data in zip(dsts, datas):
        assert os.pread(fd, len(data), 0) == data
    for fd in srcs + dsts:
        os.close(fd)


@needs_model
def test_vramctl_selftest_on_the_model(run_dir):
    import json
    import subprocess
    import sys

    from helpers import ROOT

    from vramd.testing import DaemonProcess
    env = dict(os.environ, VRAMD_AMDGPU_LIBRARY="model")
    with DaemonProcess(run_dir, env={"VRAMD_AMDGPU_LIBRARY": "model"}) as d:
        r = subprocess.run([sys.executable, "-m", "vramd.cli", "--socket", d.socket, "selftest", "--size", "6M",
                            "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    got = {(x["backend"], x["direction"]) for x in out["rows"] if x["ok"]}
    assert got == {(b, dr) for b in ("procmem", "mmap", "sdma") for dr in ("dump", "restore")}
    assert all(x["gb_per_s"] > 0 for x in out["rows"])
    assert any("SOFTWARE MODEL" in n for n in out["notes"])
    assert all(x["note"] == "MODEL" for x in out["rows"] if x["backend"] == "sdma")
