"""Shared test plumbing: child workloads, image directories, running the engine."""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import uvloop

from vramd.backends import BoRef
from vramd.engine import BoSpec, Engine, EngineConfig, RestoreTarget
from vramd.image.format import decode_record_head
from vramd.image.manifest import chunk_record, decode_manifest
from vramd.imagedir import DumpDirectory
from vramd.pb import image_pb2 as pb
from vramd.testing import Workload, blank_spec_like, seal_size  # noqa: F401  (re-exported for tests)

ROOT = str(Path(__file__).resolve().parent.parent)  # the repository


def vramctl(*args: str, socket: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`vramctl ARGS` (with --socket SOCKET) as a subprocess of this Python, output captured; the timeout only
    detects a vramctl that hangs (it fails the test), nothing waits on it."""
    pre = ["--socket", socket] if socket else []
    return subprocess.run([sys.executable, "-m", "vramd.cli", *pre, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def vramctl_peak(tmp_path: Path, *args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess[str], int]:
    """vramctl ARGS run to its end, and its own peak resident set in KiB: VmHWM of its process, read as it
    exits (a child's ru_maxrss would start from the parent's peak, since exec keeps the larger of the old and
    the new address space's high-water marks)."""
    peak = tmp_path / "peak"
    wrapper = ("import atexit, runpy, sys\n"
               "def peak():\n"
               "    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]\n"
               f"    open({str(peak)!r}, 'w').write(hwm)\n"
               "atexit.register(peak)\n"
               "sys.argv = ['vramctl'] + sys.argv[1:]\n"
               "runpy.run_module('vramd.cli', run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", wrapper, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    return r, int(peak.read_text()) if peak.exists() else -1


def run(coro):
    return uvloop.run(coro)


def procmem_bos(w: Workload, mem_fd: int, gpu_of=lambda i: 0) -> list[BoSpec]:
    return [BoSpec(i + 1, r["size"], BoRef("procmem", mem_fd, r["addr"]), gpu_id=gpu_of(i), va_addr=r["addr"])
            for i, r in enumerate(w.regions)]


def procmem_targets(w: Workload, mem_fd: int) -> list[RestoreTarget]:
    return [RestoreTarget(i + 1, BoRef("procmem", mem_fd, r["addr"])) for i, r in enumerate(w.regions)]


def engine(**kw) -> Engine:
    return Engine(EngineConfig(**kw))


@contextlib.asynccontextmanager
async def dump_job(e: Engine, dir_fd: int, *, gpus=(0,), **kw):
    """A DumpJob as a session of the daemon makes one (Engine.start_dump), for tests of the job itself: the data
    files of `gpus` and the manifest's file created in `dir_fd` by the client's side (vramd.imagedir) and
    attached, as a client's AttachFiles and Start attach them.  The job's `finish` writes the image; the image
    is never committed, and every file is removed when the block ends."""
    with DumpDirectory(dir_fd) as out:
        out.begin(os.urandom(16), e.config.data_files_per_gpu)
        job = e.start_dump(out.image_id, **kw)
        for g in gpus:
            for k in range(out.stripes):
                f = out.data_file(g, k)
                job.writer.attach(g, f.fd, f.direct_fd, k)
        job.writer.manifest_fd = out.manifest_file()
        yield job


def memfd(data: bytes = b"", size: int | None = None, *, sealed: bool = False) -> int:
    """A memfd holding `data`, `size` bytes long (default len(data)): a BO for the mmap backend, which reads and
    writes it with pread/pwrite; `sealed`: its size sealed, so the backend maps it, as it maps a dmabuf."""
    fd = os.memfd_create("bo", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealed else 0))
    os.ftruncate(fd, len(data) if size is None else size)
    if data:
        os.pwrite(fd, data, 0)
    if sealed:
        seal_size(fd)
    return fd


def bf16_like(n: int, seed: int) -> bytes:
    """Bytes shaped like bf16 weights: random mantissas, a narrow band of exponents."""
    rnd = random.Random(seed)
    out = bytearray(n)
    for i in range(0, n, 2):
        out[i] = rnd.getrandbits(8)
        out[i + 1] = 0x3C + rnd.getrandbits(2)
    return bytes(out)


def open_dir(path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


V1_IMAGE = Path(__file__).parent / "fixtures" / "image-v1"


def v1_contents() -> dict[int, bytes]:
    """The BOs of tests/fixtures/image-v1: an image written by the format v1 writer (before format v2), kept
    to prove v1 images stay readable.  Chunk size 64 KiB, zstd:3; BO 1 compresses, BO 2 is a hole and a raw
    chunk, BO 3 is empty, BO 4 is raw with a short last chunk; BOs 1 and 3 on GPU 0x1001, 2 and 4 on 0x1000."""
    rnd = random.Random(20261123)
    text = (b"the quick brown fox %d " * 20000)[:200 * 1024]
    return {1: text, 2: bytes(64 * 1024) + rnd.randbytes(64 * 1024), 3: b"", 4: rnd.randbytes(4096 + 17)}


def v1_image(tmp_path: Path) -> tuple[Path, int]:
    """A copy of the v1 fixture image in `tmp_path` (tests damage their copy), and its directory fd."""
    dst = tmp_path / "image-v1"
    shutil.copytree(V1_IMAGE, dst)
    return dst, open_dir(dst)


def image_records(path: Path) -> tuple[pb.Manifest, list[tuple[int, int, int, int, int, int, int]]]:
    """A committed image's manifest and its own records in BO and chunk order: (BO, chunk index, file index,
    offset, length, codec, chunk table ref)."""
    m = decode_manifest((path / "manifest.vrdm").read_bytes())
    out = []
    files = [(path / f.name).read_bytes() for f in m.files]
    for bo in m.bos:
        for i, ref in enumerate(bo.chunk_refs):
            r = chunk_record(m, bo, i)
            if r is None:
                continue
            fi, off, ln, _ = r
            blob = files[fi][off:off + ln]
            head = decode_record_head(blob, bo_id=bo.id, offset=i * m.chunk_size, where="test",
                                      content_hash=m.chunks.hashes[(ref - 1) * 32:ref * 32])[0]
            out.append((bo.id, i, fi, off, ln, head.codec, ref))
    return m, out


def o_direct_here(path) -> bool:
    """Whether the file system of directory `path` takes O_DIRECT (a probe file, removed again)."""
    probe = os.path.join(path, "o_direct_probe")
    with open(probe, "wb"):
        pass
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        os.unlink(probe)
