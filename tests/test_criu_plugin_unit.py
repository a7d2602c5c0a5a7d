"""The patched amdgpu plugin's own file, amdgpu_plugin_vramd.c, without CRIU.

contrib/criu/series creates plugins/amdgpu/amdgpu_plugin_vramd.{c,h} (0001) and changes them (0002-0006).
Here the series is applied, in order, to an empty git tree with only those two files included; the .c is
compiled with -Wall -Werror against libvramd (build/libvramd) and our stub headers (tests/criu_stubs, written
from what the file uses; nothing of CRIU's), with and without HAVE_VRAMD, into a shared object this test
drives through ctypes as CRIU's hooks do: DUMP_EXT_FILE (amdgpu_vramd_dump, its BO buckets from the KFD model's
CHECKPOINT: real dmabuf fds), DUMP_DEVICES_LATE (amdgpu_vramd_dump_finish), RESTORE_INIT, the restored task's
hook (amdgpu_vramd_restore) and RESUME_DEVICES_LATE (amdgpu_vramd_resume, the barrier), against a real daemon
on the SDMA model.  THIS RUNS ON MODELS (KFD, libdrm_amdgpu+SDMA), NOT A GPU.
"""
from __future__ import annotations

import ctypes
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import image_records, open_dir
from test_sdma_identity import GPU_ID, BoBucket, Gpu, KfdProcess

from vramd.backends.sdma.binding import MODEL_PATH
from vramd.testing import DaemonProcess

ROOT = Path(__file__).resolve().parents[1]
SERIES = ROOT / "contrib" / "criu"
STUBS = ROOT / "tests" / "criu_stubs"
LIBVRAMD = ROOT / "build" / "libvramd"
OWN = "plugins/amdgpu/amdgpu_plugin_vramd"
STAGE_DUMP, STAGE_RESTORE = 0, 2  # tests/criu_stubs/criu-plugin.h
DOORBELL = 1 << 3  # KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL: no contents to move
ECONNREFUSED, EEXIST, ENOENT = 111, 17, 2

pytestmark = pytest.mark.skipif(not os.path.exists(MODEL_PATH), reason="the SDMA model is not built (needs libdrm-dev "
                                "at install time; ./dev.sh installs it)")


def _model_build():
    sys.path.insert(0, str(ROOT / "native" / "model"))
    try:
        import build as model_build
    finally:
        sys.path.pop(0)
    return model_build


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}:\n{r.stdout}\n{r.stderr}"


@pytest.fixture(scope="module")
def plugin_so(tmp_path_factory) -> tuple[Path, Path]:
    """(the HAVE_VRAMD build, the build without libvramd) of the series' amdgpu_plugin_vramd.c."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or shutil.which("git") is None:
        pytest.skip("no C compiler or git")
    if not (LIBVRAMD / "libvramd.so").exists():
        pytest.skip("libvramd is not built (build/libvramd: tests/test_libvramd.py builds it)")
    out = tmp_path_factory.mktemp("plugin-unit")
    tree = out / "tree"
    tree.mkdir()
    _run(["git", "init", "-q"], cwd=tree)
    patches = [ln for ln in (SERIES / "series").read_text().splitlines() if ln and not ln.startswith("#")]
    assert len(patches) >= 5
    for p in patches:
        _run(["git", "apply", f"--include={OWN}.*", str(SERIES / p)], cwd=tree)
    src = tree / f"{OWN}.c"
    assert src.is_file() and (tree / f"{OWN}.h").is_file()
    assert sorted(str(f.relative_to(tree)) for f in tree.rglob("*") if f.is_file() and ".git" not in f.parts) == [
        f"{OWN}.c", f"{OWN}.h"]
    flags = ["-std=gnu11", "-Wall", "-Werror", "-fPIC", "-shared", "-Wl,--no-undefined",
             f"-I{STUBS}", *_model_build().kfd_cflags(out)]
    with_vramd, without = out / "plugin_vramd.so", out / "plugin_stock.so"
    _run([cc, *flags, "-DHAVE_VRAMD", f"-I{ROOT / 'native' / 'client' / 'include'}", "-o", str(with_vramd),
          str(src), str(STUBS / "stubs.c"), f"-L{LIBVRAMD}", "-lvramd", f"-Wl,-rpath,{LIBVRAMD}"])
    _run([cc, *flags, "-o", str(without), str(src), str(STUBS / "stubs.c")])
    return with_vramd, without


def _load(so: Path, tmp_path: Path, img: int) -> ctypes.CDLL:
    """A fresh copy of the plugin (its statics are per dlopen'ed file), its images directory the fd img."""
    copy = tmp_path / f"fresh-{len(list(tmp_path.glob('fresh-*')))}-{so.name}"  # a new file: never one mapped
    shutil.copy(so, copy)
    lib = ctypes.CDLL(str(copy))
    buckets = ctypes.POINTER(BoBucket)
    for name in ("amdgpu_vramd_dump", "amdgpu_vramd_restore"):
        getattr(lib, name).argtypes = [ctypes.c_int, buckets, ctypes.c_int]
    lib.stub_set_image_dir(img)
    return lib


def _fds_into(pid: int, where: Path) -> list[str]:
    """The fds of process pid open on files under where (the KFD model's arena, the images)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith(str(where)):
            out.append(target)
    return out


def _sdma_daemon(run_dir: str) -> DaemonProcess:
    """A real daemon, its SDMA backend on the SDMA model, told the KFD model's GPU id (not the host's topology)."""
    cfg = os.path.join(run_dir, "gpus.toml")
    with open(cfg, "w") as f:
        f.write(f'topology_root = "{run_dir}/no-topology"\ngpu_ids = [{GPU_ID:#x}]\n')
    return DaemonProcess(run_dir, "--grace-period", "0.3", "--config", cfg, env={"VRAMD_AMDGPU_LIBRARY": "model"})


@pytest.fixture
def kfd(tmp_path):
    try:
        path = _model_build().build_kfd_core_lib(tmp_path / "kfd-core")
    except _model_build().ModelBuildError as e:
        pytest.skip(f"the KFD model cannot be built here: {e}")
    lib = ctypes.CDLL(path)
    lib.kfdm_create.argtypes = [ctypes.c_char_p, ctypes.POINTER(Gpu), ctypes.c_uint, ctypes.c_uint]
    lib.kfdm_attach.argtypes, lib.kfdm_attach.restype = [ctypes.c_char_p], ctypes.c_void_p
    lib.kfdm_detach.argtypes = [ctypes.c_void_p]
    lib.kfdm_open.argtypes, lib.kfdm_open.restype = [ctypes.c_void_p], ctypes.c_int64
    lib.kfdm_ioctl.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_ulong, ctypes.c_void_p]
    p = KfdProcess(lib, tmp_path / "kfd")
    yield p
    p.close()


def _buckets(p: KfdProcess, fds: list[int]) -> ctypes.Array[BoBucket]:
    """The BO buckets CHECKPOINT gave, as the plugin has them, and a doorbell BO (no contents) third."""
    out = [BoBucket(a.va_addr, a.size, a.mmap_offset, 0, GPU_ID, a.flags, fd, 0) for a, fd in zip(p.bos, fds)]
    out.insert(2, BoBucket(0x7E0000000000, 8192, 0, 0, GPU_ID, DOORBELL, 0xFFFFFFFF, 0))
    return (BoBucket * len(out))(*out)


@pytest.fixture
def env(monkeypatch):
    for k in ("KFD_VRAMD", "KFD_VRAMD_BACKEND", "KFD_VRAMD_PARENT", "KFD_VRAMD_MAX_CHAIN"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_dump_and_restore_through_the_patched_functions(plugin_so, kfd, env, run_dir, tmp_path, capfd):
    """Three VRAM BOs of the KFD model (two equal-sized) and a doorbell: dump -> dump_finish commits
    amdgpu-vramd-7/ with the three (bucket indexes 0, 1, 3); the BOs cleared; restore_init, restore in a forked
    task (as CRIU's restored task), then resume in this one (CRIU main's barrier, by the task's ticket) bring
    back each BO's bytes exactly, and the target task lives on."""
    rnd = random.Random(3401)
    sizes = [64 << 10, 4096, 4096]
    want = [rnd.randbytes(n) for n in sizes]
    for n, d in zip(sizes, want):
        kfd.alloc(n, d)
    buckets = _buckets(kfd, kfd.checkpoint())
    (tmp_path / "img").mkdir()
    img = open_dir(tmp_path / "img")
    target = subprocess.Popen(["cat"], stdin=subprocess.PIPE)
    try:
        with _sdma_daemon(run_dir) as d:
            env.setenv("VRAMD_SOCKET", d.socket)
            lib = _load(plugin_so[0], tmp_path, img)
            lib.amdgpu_vramd_init(STAGE_DUMP)
            assert lib.amdgpu_vramd_dump(7, buckets, len(buckets)) == 0
            assert lib.amdgpu_vramd_dump_finish() == 0
            m, _ = image_records(tmp_path / "img" / "amdgpu-vramd-7")
            assert sorted((b.id, b.size) for b in m.bos) == [(0, sizes[0]), (1, sizes[1]), (3, sizes[2])]
            assert not (tmp_path / "img" / "amdgpu-vramd-7" / "parent").exists()
            for i in range(len(sizes)):
                kfd.clear(i)
            assert [kfd.bytes_of(i) == want[i] for i in range(len(sizes))] == [False] * 3

            lib = _load(plugin_so[0], tmp_path, img)  # CRIU restore: a fresh process
            lib.amdgpu_vramd_init(STAGE_RESTORE)
            assert lib.amdgpu_vramd_restore_init() == 0
            task = os.fork()  # the restored task submits (its ticket into the shared table) and ends
            if task == 0:
                os._exit(min(abs(lib.amdgpu_vramd_restore(7, buckets, len(buckets))), 120))
            assert os.waitstatus_to_exitcode(os.waitpid(task, 0)[1]) == 0
            assert lib.amdgpu_vramd_restore(8, buckets, len(buckets)) == 1  # no amdgpu-vramd-8/: stock path
            capfd.readouterr()
            assert lib.amdgpu_vramd_resume(target.pid) == 0  # CRIU main: the barrier, on the task's ticket
            assert f"I: vramd: restore of task {task} done" in capfd.readouterr().err
            assert target.poll() is None
            got = [kfd.bytes_of(i) for i in range(len(sizes))]
            assert [i for i in range(len(sizes)) if got[i] != want[i]] == []
            assert lib.stub_unpause_calls() == 0 and lib.stub_unpause_all_calls() == 0
            assert _fds_into(d.pid, tmp_path) == []  # every session closed: no BO or image fd kept
    finally:
        target.kill()
        target.wait()
        os.close(img)


def test_no_daemon_takes_the_stock_path_with_one_line(plugin_so, kfd, env, run_dir, tmp_path, capfd):
    """No daemon at VRAMD_SOCKET: dump returns 1 (amdgpu-pages files), logs one line naming the socket and
    leaves no amdgpu-vramd-<id>/; KFD_VRAMD=1 fails the dump instead (-ECONNREFUSED); an earlier dump's
    amdgpu-vramd-<id>/ left there fails it too (-EEXIST), as does the build without libvramd."""
    kfd.alloc(4096, b"x" * 4096)
    buckets = _buckets(kfd, kfd.checkpoint())
    (tmp_path / "img").mkdir()
    img = open_dir(tmp_path / "img")
    sock = os.path.join(run_dir, "nobody.sock")
    env.setenv("VRAMD_SOCKET", sock)
    try:
        lib = _load(plugin_so[0], tmp_path, img)
        lib.amdgpu_vramd_init(STAGE_DUMP)
        capfd.readouterr()
        assert lib.amdgpu_vramd_dump(7, buckets, len(buckets)) == 1
        lines = capfd.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"W: vramd: no daemon at {sock} "), lines
        assert lines[0].endswith("dumping the BO contents to amdgpu-pages files"), lines
        assert os.listdir(tmp_path / "img") == []
        assert lib.amdgpu_vramd_dump_finish() == 0
        lib.amdgpu_vramd_fini(STAGE_DUMP, -1)  # no daemon took a BO: nothing to unpause
        assert lib.stub_unpause_all_calls() == 0

        env.setenv("KFD_VRAMD", "1")
        lib = _load(plugin_so[0], tmp_path, img)
        lib.amdgpu_vramd_init(STAGE_DUMP)
        capfd.readouterr()
        assert lib.amdgpu_vramd_dump(7, buckets, len(buckets)) == -ECONNREFUSED
        err = capfd.readouterr().err
        assert f"E: vramd: KFD_VRAMD=1 but no daemon at {sock}" in err, err
        assert os.listdir(tmp_path / "img") == []

        env.delenv("KFD_VRAMD")
        (tmp_path / "img" / "amdgpu-vramd-7").mkdir()
        lib = _load(plugin_so[0], tmp_path, img)
        lib.amdgpu_vramd_init(STAGE_DUMP)
        assert lib.amdgpu_vramd_dump(7, buckets, len(buckets)) == -EEXIST
        stock = _load(plugin_so[1], tmp_path, img)
        assert stock.amdgpu_vramd_dump(7, buckets, len(buckets)) == -EEXIST
        assert stock.amdgpu_vramd_dump(9, buckets, len(buckets)) == 1
        capfd.readouterr()
        stock.amdgpu_vramd_unpause(42)
        assert (stock.stub_unpause_calls(), stock.stub_unpause_kfd_fd()) == (1, 42)
        assert "I: vramd: process unpaused after the failed dump" in capfd.readouterr().err
    finally:
        os.close(img)


def test_failed_dump_drops_the_started_copy_and_unpauses(plugin_so, kfd, env, run_dir, tmp_path):
    """A dump that CRIU fails after DUMP_EXT_FILE started the copy: fini drops it (no image, no directory left)
    and unpauses the processes dumped before the failure; the daemon keeps no fd of the BOs."""
    kfd.alloc(1 << 20, random.Random(3402).randbytes(1 << 20))
    buckets = _buckets(kfd, kfd.checkpoint())
    (tmp_path / "img").mkdir()
    img = open_dir(tmp_path / "img")
    try:
        with _sdma_daemon(run_dir) as d:
            env.setenv("VRAMD_SOCKET", d.socket)
            lib = _load(plugin_so[0], tmp_path, img)
            lib.amdgpu_vramd_init(STAGE_DUMP)
            assert lib.amdgpu_vramd_dump(7, buckets, len(buckets)) == 0
            assert (tmp_path / "img" / "amdgpu-vramd-7").is_dir()
            assert _fds_into(d.pid, tmp_path / "kfd") != []  # the started session holds the BO's dmabuf
            lib.amdgpu_vramd_fini(STAGE_DUMP, -1)
            assert lib.stub_unpause_all_calls() == 1
            assert os.listdir(tmp_path / "img") == []
            assert _fds_into(d.pid, tmp_path) == []
    finally:
        os.close(img)


def test_incremental_dump_refers_to_the_previous_checkpoint(plugin_so, kfd, env, run_dir, tmp_path):
    """Patch 0002: the second checkpoint's images directory has CRIU's link "parent" to the first; its
    amdgpu-vramd-7/ gets a link "parent" to the first's and stores only the BO that changed; the restore from
    the second goes through the chain and brings back the new bytes of every BO."""
    rnd = random.Random(3403)
    sizes = [64 << 10, 4096]
    want = [rnd.randbytes(n) for n in sizes]
    for n, d in zip(sizes, want):
        kfd.alloc(n, d)
    buckets = _buckets(kfd, kfd.checkpoint())
    first, second = tmp_path / "ck1", tmp_path / "ck2"
    first.mkdir()
    second.mkdir()
    (second / "parent").symlink_to("../ck1")  # what --prev-images-dir=../ck1 makes
    fds = [open_dir(first), open_dir(second)]
    target = subprocess.Popen(["cat"], stdin=subprocess.PIPE)
    try:
        with _sdma_daemon(run_dir) as d:
            env.setenv("VRAMD_SOCKET", d.socket)
            for fd in fds:
                if fd == fds[1]:
                    want[1] = rnd.randbytes(sizes[1])
                    os.pwrite(kfd.render, want[1], kfd.bos[1].mmap_offset)
                lib = _load(plugin_so[0], tmp_path, fd)
                lib.amdgpu_vramd_init(STAGE_DUMP)
                assert lib.amdgpu_vramd_dump(7, buckets, len(buckets)) == 0
                assert lib.amdgpu_vramd_dump_finish() == 0
            assert os.readlink(second / "amdgpu-vramd-7" / "parent") == "../parent/amdgpu-vramd-7"
            assert not (first / "amdgpu-vramd-7" / "parent").exists()
            full, _ = image_records(first / "amdgpu-vramd-7")
            inc, _ = image_records(second / "amdgpu-vramd-7")
            assert sorted((b.id, b.stored_bytes) for b in full.bos) == [(0, sizes[0]), (1, sizes[1])]
            assert sorted((b.id, b.stored_bytes) for b in inc.bos) == [(0, 0), (1, sizes[1])]
            for i in range(len(sizes)):
                kfd.clear(i)
            lib = _load(plugin_so[0], tmp_path, fds[1])
            lib.amdgpu_vramd_init(STAGE_RESTORE)
            assert lib.amdgpu_vramd_restore_init() == 0
            assert lib.amdgpu_vramd_restore(7, buckets, len(buckets)) == 0
            assert lib.amdgpu_vramd_resume(target.pid) == 0
            assert [kfd.bytes_of(i) == want[i] for i in range(len(sizes))] == [True, True]
            assert target.poll() is None
    finally:
        target.kill()
        target.wait()
        for fd in fds:
            os.close(fd)


def test_failed_restore_cancels_the_submitted_copy(plugin_so, kfd, env, run_dir, tmp_path, capfd):
    """Patch 0005: a restore that fails after the restored task submitted: fini cancels that copy at once (the
    daemon keeps none of its fds), and the barrier then has no ticket left to wait for."""
    kfd.alloc(1 << 20, random.Random(3404).randbytes(1 << 20))
    buckets = _buckets(kfd, kfd.checkpoint())
    (tmp_path / "img").mkdir()
    img = open_dir(tmp_path / "img")
    target = subprocess.Popen(["cat"], stdin=subprocess.PIPE)
    try:
        with _sdma_daemon(run_dir) as d:
            env.setenv("VRAMD_SOCKET", d.socket)
            lib = _load(plugin_so[0], tmp_path, img)
            lib.amdgpu_vramd_init(STAGE_DUMP)
            assert lib.amdgpu_vramd_dump(7, buckets, len(buckets)) == 0
            assert lib.amdgpu_vramd_dump_finish() == 0
            lib = _load(plugin_so[0], tmp_path, img)
            lib.amdgpu_vramd_init(STAGE_RESTORE)
            assert lib.amdgpu_vramd_restore_init() == 0
            assert lib.amdgpu_vramd_restore(7, buckets, len(buckets)) == 0
            assert _fds_into(d.pid, tmp_path / "kfd") != []  # the submitted session holds the BO's dmabuf
            capfd.readouterr()
            lib.amdgpu_vramd_fini(STAGE_RESTORE, -1)
            err = capfd.readouterr().err
            assert f"I: vramd: the restore failed: the copy task {os.getpid()} submitted is cancelled" in err, err
            assert _fds_into(d.pid, tmp_path) == []
            assert lib.amdgpu_vramd_resume(target.pid) == 0  # nothing left to wait for: no kill
            assert target.poll() is None
            assert lib.stub_unpause_all_calls() == 0
    finally:
        target.kill()
        target.wait()
        os.close(img)


def test_kfd_vramd_1_fails_a_restore_that_finds_no_bo_contents(plugin_so, env, tmp_path, capfd):
    """Patch 0006: with KFD_VRAMD=1 the restored task's hook fails (-ENOENT, one line naming the directory it
    expected) where the images directory holds neither amdgpu-vramd-<id>/ nor amdgpu-pages-<id>-* files (a vramd
    image not pulled into place); with pages files there, or without the setting, it leaves the KFD file to the
    stock path (1) as before.  The plugin built without libvramd does the same."""
    (tmp_path / "img").mkdir()
    img = open_dir(tmp_path / "img")
    buckets = (BoBucket * 1)(BoBucket(0x7F0000000000, 4096, 0, 0, GPU_ID, 0, 0xFFFFFFFF, 0))
    try:
        env.setenv("KFD_VRAMD", "1")
        lib = _load(plugin_so[0], tmp_path, img)
        lib.amdgpu_vramd_init(STAGE_RESTORE)
        capfd.readouterr()
        assert lib.amdgpu_vramd_restore(7, buckets, 1) == -ENOENT
        lines = capfd.readouterr().err.splitlines()
        assert lines == ["E: vramd: KFD_VRAMD=1 but the BO contents of amdgpu-kfd-7.img are neither a vramd image "
                         "(amdgpu-vramd-7/) nor amdgpu-pages files: put the vramd image in place first (e.g. vramctl "
                         "pull REF amdgpu-vramd-7)"], lines
        (tmp_path / "img" / "amdgpu-pages-70-5d21.img").write_bytes(b"")  # another KFD file's
        assert lib.amdgpu_vramd_restore(7, buckets, 1) == -ENOENT
        (tmp_path / "img" / "amdgpu-pages-7-5d21.img").write_bytes(b"")
        assert lib.amdgpu_vramd_restore(7, buckets, 1) == 1
        os.unlink(tmp_path / "img" / "amdgpu-pages-7-5d21.img")
        env.delenv("KFD_VRAMD")
        lib = _load(plugin_so[0], tmp_path, img)
        lib.amdgpu_vramd_init(STAGE_RESTORE)
        capfd.readouterr()
        assert lib.amdgpu_vramd_restore(7, buckets, 1) == 1
        assert capfd.readouterr().err == ""
        # the plugin built without libvramd: the same rule (KFD_VRAMD=1 still means the BO contents must be found)
        stock = _load(plugin_so[1], tmp_path, img)
        assert stock.amdgpu_vramd_restore(7, buckets, 1) == 1
        env.setenv("KFD_VRAMD", "1")
        capfd.readouterr()
        assert stock.amdgpu_vramd_restore(7, buckets, 1) == -ENOENT
        assert capfd.readouterr().err.splitlines() == lines
        (tmp_path / "img" / "amdgpu-pages-7-5d21.img").write_bytes(b"")
        assert stock.amdgpu_vramd_restore(7, buckets, 1) == 1
    finally:
        os.close(img)
