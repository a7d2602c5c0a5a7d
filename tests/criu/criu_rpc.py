"""A CRIU RPC client (`criu swrk <fd>`, as container runtimes drive CRIU through libcriu) for the
incremental dumps through CRIU's own parent link (test_kfd_vramd_criu_parent.py).

The message classes come from $CRIU_SRC/images/rpc.proto, compiled at test time into a scratch
directory (`generate`): nothing of CRIU's is kept in this repository.

Why RPC: on a kernel without memory dirty tracking a CLI `criu dump --prev-images-dir` fails its
pid-reuse check (the parent's inventory has no dump_uptime, written only with --track-mem).  CRIU
skips that check when its pidfd store is set up, which only RPC can do (CriuOpts.pidfd_store_sk:
a unix datagram socket of the client's that CRIU takes with pidfd_getfd, binds and connects to
itself).  The store holds (pid, pidfd) messages that CRIU's pre-dump queues, and a dump with a
parent refuses an empty store; pre-dump needs dirty tracking too.  So this client queues the
pidfd it opened on the dumped task before the first dump: if that task had exited (and its pid been
reused) by a later dump, the pidfd reads as exited and CRIU sees the reuse, as after a pre-dump.
It queues one for each task of the tree (CRIU checks each), all opened before the first dump.

    python criu_rpc.py chain PID IMAGES N   dumps PID's tree into IMAGES/1 .. IMAGES/N, each n > 1 with
        parent_img ../n-1; the last one does not leave the task running.  Before the 2nd, one dump
        into IMAGES/2-empty-store with the store still empty (CRIU's refusal, printed).  After each
        dump that left the task running, $RPC_STEP runs in bash with $1 = n, $2 = PID; $RPC_ENV_<n>
        (NAME=VALUE ...) is added to the environment of the n-th dump's criu.
Prints "key: value" lines (dumpN: 0 or 1, and its error message).  $RPC_PB2_DIR: where
rpc_pb2.py is; $CRIU: the criu binary; plugins from $CRIU_LIBS_DIR, which criu reads itself.
"""
from __future__ import annotations

import importlib
import os
import socket
import struct
import subprocess
import sys
from types import ModuleType


def generate(criu_src: str, out: str) -> str:
    """Compiles CRIU_SRC/images/rpc.proto into out/rpc_pb2.py (grpcio-tools, the test extra's); returns out."""
    from grpc_tools import protoc

    os.makedirs(out, exist_ok=True)
    images = os.path.join(criu_src, "images")
    if protoc.main(["protoc", f"-I{images}", f"--python_out={out}", os.path.join(images, "rpc.proto")]):
        raise RuntimeError(f"protoc failed on {images}/rpc.proto")
    return out


def load(pb2_dir: str) -> ModuleType:
    """The rpc_pb2 module `generate` made in pb2_dir."""
    if pb2_dir not in sys.path:
        sys.path.insert(0, pb2_dir)
    return importlib.import_module("rpc_pb2")


def queue(store: socket.socket, pid: int, pidfd: int) -> None:
    """What CRIU's pre-dump queues in the store: one message, pid as its data and the pidfd as SCM_RIGHTS."""
    socket.send_fds(store, [struct.pack("i", pid)], [pidfd])


def call(rpc: ModuleType, req: object, criu: str | None = None, env: dict[str, str] | None = None) -> object:
    """One request to a fresh `criu swrk` over a SOCK_SEQPACKET pair; CRIU's response."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours:
        p = subprocess.Popen([criu or os.environ["CRIU"], "swrk", str(theirs.fileno())], pass_fds=[theirs.fileno()],
                             env=env)
        theirs.close()
        ours.sendall(req.SerializeToString())  # type: ignore[attr-defined]
        data = ours.recv(1 << 20)
    p.wait()
    resp = rpc.criu_resp()
    if not data:
        raise RuntimeError(f"criu swrk exited {p.returncode} without a response")
    resp.ParseFromString(data)
    return resp


def dump(rpc: ModuleType, pid: int, images: str, store: socket.socket, parent: str | None, leave_running: bool,
         criu: str | None = None, shell_job: bool = True, env: dict[str, str] | None = None):
    """criu_req DUMP of pid into images (made if absent; log dump.log, level 4) with the pidfd store."""
    os.makedirs(images, exist_ok=True)
    dfd = os.open(images, os.O_RDONLY | os.O_DIRECTORY)
    try:
        req = rpc.criu_req(type=rpc.DUMP)
        o = req.opts
        o.images_dir_fd, o.pid, o.shell_job, o.leave_running = dfd, pid, shell_job, leave_running
        o.log_level, o.log_file, o.pidfd_store_sk = 4, "dump.log", store.fileno()
        if parent:
            o.parent_img = parent
        return call(rpc, req, criu, env)
    finally:
        os.close(dfd)


def _report(key: str, resp) -> None:
    print(f"{key}: {0 if resp.success else 1}", flush=True)
    if not resp.success:
        print(f"{key} error: {resp.cr_errmsg.strip()}", flush=True)


def tree(pid: int) -> list[int]:
    """pid and its descendants (each task's children, as /proc lists them)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        for tid in os.listdir(f"/proc/{p}/task"):
            with open(f"/proc/{p}/task/{tid}/children") as f:
                todo += [int(c) for c in f.read().split()]
    return out


def chain(pid: int, root: str, n: int) -> int:
    rpc = load(os.environ["RPC_PB2_DIR"])
    store = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    pidfds = {t: os.pidfd_open(t) for t in tree(pid)}  # before the first dump: the tasks the chain starts from
    print(f"tasks: {len(pidfds)}", flush=True)
    for k in range(1, n + 1):
        parent = f"../{k - 1}" if k > 1 else None
        if k == 2:
            _report("empty-store", dump(rpc, pid, os.path.join(root, "2-empty-store"), store, parent, True))
        for task, pidfd in pidfds.items():  # what CRIU's pre-dump would have queued
            if k > 1:
                queue(store, task, pidfd)
        env = dict(os.environ)
        for kv in os.environ.get(f"RPC_ENV_{k}", "").split():
            key, _, value = kv.partition("=")
            env[key] = value
        resp = dump(rpc, pid, os.path.join(root, str(k)), store, parent, k < n, env=env)
        _report(f"dump{k}", resp)
        if not resp.success:
            return 1
        step = ["bash", "-c", os.environ.get("RPC_STEP", ""), "step", str(k), str(pid)]
        if k < n and subprocess.run(step).returncode:
            return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "chain":
        sys.exit(__doc__)
    sys.exit(chain(int(sys.argv[2]), sys.argv[3], int(sys.argv[4])))
