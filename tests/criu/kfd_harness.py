"""The KFD model inside a real CRIU: state directories, the private mount namespace, the
emulated GPU process (native/model/kfd_workload.c) and the stock amdgpu plugin.

THIS RUNS ON A MODEL, NOT A GPU (docs/kfd-model.md).
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path

from vramd.topology import parse_topology

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
# native/model/build.py by path: `import build` may find PyPA's build
_spec = importlib.util.spec_from_file_location("vramd_model_build", REPO / "native" / "model" / "build.py")
assert _spec and _spec.loader
model_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(model_build)

FIXTURES = REPO / "tests" / "fixtures" / "topology"
KFD_OPS = ("open", "get_version", "acquire_vm", "alloc", "free", "process_info", "checkpoint", "unpause",
           "restore", "resume", "queue")


class KfdGpu(ctypes.Structure):
    _fields_ = [("gpu_id", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("vram_size", ctypes.c_uint64)]


class Model:
    """The built pieces: the SDMA model (as libdrm_amdgpu.so.1), the KFD model + shim, the workload."""

    def __init__(self, out: str):
        self.out = out
        model_build.build_test(out)                      # also makes model-test-lib/libdrm_amdgpu.so.1
        self.libdrm_dir = os.path.join(out, "model-test-lib")
        self.kfd_lib = model_build.build_kfd_lib(out)
        self.workload = model_build.build_kfd_workload(out)
        self._lib = ctypes.CDLL(self.kfd_lib)
        self._lib.kfdm_attach.restype = ctypes.c_void_p
        self._lib.kfdm_attach.argtypes = [ctypes.c_char_p]
        self._lib.kfdm_detach.argtypes = [ctypes.c_void_p]
        self._lib.kfdm_inject.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_uint,
                                          ctypes.c_uint]
        self._lib.kfdm_paused.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self._lib.kfdm_counters.argtypes = [ctypes.c_void_p] + [ctypes.POINTER(ctypes.c_uint64)] * 3

    def create_state(self, state: str, topology: str, kfd_minor: int = 11) -> None:
        """A fresh state directory whose GPUs are the fixture's (gpu_id, render minor, VRAM)."""
        topo = parse_topology(os.path.join(topology, "nodes"))
        gpus = (KfdGpu * len(topo.gpus))(*[KfdGpu(g.gpu_id, g.render_minor, g.vram_bytes) for g in topo.gpus])
        os.makedirs(state, exist_ok=True)
        r = self._lib.kfdm_create(state.encode(), gpus, len(topo.gpus), kfd_minor)
        if r:
            raise OSError(-r, f"kfdm_create({state})")

    def inject(self, state: str, op: str, errno_value: int, skip: int = 0, count: int = 1) -> None:
        m = self._lib.kfdm_attach(state.encode())
        if not m:
            raise OSError(ctypes.get_errno(), f"kfdm_attach({state})")
        try:
            if self._lib.kfdm_inject(m, KFD_OPS.index(op), errno_value, skip, count):
                raise ValueError(op)
        finally:
            self._lib.kfdm_detach(m)

    def counters(self, state: str) -> dict[str, dict[str, int]]:
        m = self._lib.kfdm_attach(state.encode())
        if not m:
            raise OSError(ctypes.get_errno(), f"kfdm_attach({state})")
        calls, fails, stats = (ctypes.c_uint64 * 16)(), (ctypes.c_uint64 * 16)(), (ctypes.c_uint64 * 16)()
        try:
            self._lib.kfdm_counters(m, calls, fails, stats)
        finally:
            self._lib.kfdm_detach(m)
        names = ("dmabufs", "paused_refused", "bos_live", "bytes_live", "procs_live")
        return {"calls": dict(zip(KFD_OPS, calls)), "fails": dict(zip(KFD_OPS, fails)),
                "stats": dict(zip(names, stats))}

    def paused(self, state: str, pid: int) -> int:
        """1: the KFD process of pid has its queues paused, 0: running, -ESRCH: none."""
        m = self._lib.kfdm_attach(state.encode())
        if not m:
            raise OSError(ctypes.get_errno(), f"kfdm_attach({state})")
        try:
            return int(self._lib.kfdm_paused(m, pid))
        finally:
            self._lib.kfdm_detach(m)

    def env(self, state: str) -> dict[str, str]:
        """What criu and the workload need in their environment."""
        return {"VRAMD_KFD_STATE": state, "LD_PRELOAD": self.kfd_lib, "LD_LIBRARY_PATH": self.libdrm_dir}


def ns_command(state: str, topology: str, scratch: str, cmd: list[str]) -> list[str]:
    os.makedirs(scratch, exist_ok=True)
    return [shutil.which("unshare") or "unshare", "-m", "--propagation", "private",
            str(HERE / "kfd_ns.sh"), state, topology, scratch, *cmd]


_reaper_started = False
_spared: set[int] = set()     # run_in_ns's own children: subprocess reaps them
_ns_groups: set[int] = set()  # the process groups run_in_ns made (the tasks CRIU restores with --shell-job join them)


def _reap_orphans() -> None:
    """As child subreaper, reap the tasks CRIU kills whose parent died first (this machine's init
    leaves them as zombies, and a zombie keeps the pid a restore needs): only zombies of the process
    groups run_in_ns made.  Every other child of this process (a daemon, vramctl, a plain
    subprocess.run) is its owner's to reap: taken here, its exit status would be lost (its owner's
    wait finds no child and reports 0)."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            threading.Event().wait(0.05)   # no child at all right now
            continue
        if info is None:
            threading.Event().wait(0.05)
            continue
        try:
            group = os.getpgid(info.si_pid)  # a zombie still has its process group
        except ProcessLookupError:
            continue                         # its owner reaped it meanwhile
        if info.si_pid in _spared or group not in _ns_groups:
            threading.Event().wait(0.05)     # someone else's child: its owner reaps it
            continue
        try:
            os.waitpid(info.si_pid, 0)
        except ChildProcessError:
            pass


def start_reaper() -> None:
    """Make this process the child subreaper of the tasks CRIU restores, and reap them (`_reap_orphans`)."""
    global _reaper_started
    if _reaper_started:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0):          # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    threading.Thread(target=_reap_orphans, daemon=True).start()
    _reaper_started = True


def run_in_ns(state: str, topology: str, scratch: str, script: str, env: dict[str, str],
              timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs a bash script inside the namespace (criu and the workload must share it)."""
    start_reaper()
    # its own process group: a run cut short (timeout, ^C, SIGTERM) takes the workload with it,
    # which would otherwise run on holding the state's arenas
    p = subprocess.Popen(ns_command(state, topology, scratch, ["bash", "-c", script]), env={**os.environ, **env},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0)
    _spared.add(p.pid)
    _ns_groups.add(p.pid)  # process_group=0: its own group, whose id is its pid
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise
    finally:
        _spared.discard(p.pid)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)
