"""Run inside a Debian 12 chroot where the vramd packages were just installed with apt (tests/test_debian_package.py
copies it in and runs it as root with the system's python3.11; only the standard library).

What it does: with systemd as PID 1 (the container booted, test_debian_package.py), the first client starts the
service through the enabled socket unit; without (a plain chroot), the way systemd would with the installed units:
  - reads /lib/systemd/system/vramd.socket and vramd.service: the socket's path, owner and mode; the
    service's ExecStart, User and Group;
  - binds that socket as root, gives it the unit's owner and mode, and starts the unit's ExecStart as the
    unit's user (setpriv: the user's groups from the group database, no capabilities, no new privileges),
    passing the socket as systemd does (fd 3, LISTEN_FDS, LISTEN_PID) and a notify socket it waits on for
    READY=1;
  - dumps a workload's memory through that socket with the package's vramctl (the default socket path),
    verifies the image, overwrites the memory, restores it and compares it byte for byte (sha256);
  - builds a small C program against libvramd with `pkg-config vramd` and runs it against the daemon;
  - connects as a member of group vramd (allowed) and as another user (refused);
  - stops the daemon with SIGTERM (exit 0).
It prints one JSON object (the facts the test asserts) as its last line.
"""
from __future__ import annotations

import grp
import json
import os
import pwd
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable

SIZE = 32 << 20
WORKLOAD = r"""
import ctypes, hashlib, mmap, os, sys
n = int(sys.argv[1])
m = mmap.mmap(-1, n)
m.write(os.urandom(n - (8 << 20)))  # the last 8 MiB stay zero: the dump's zero-chunk path too
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
print(addr, hashlib.sha256(m).hexdigest(), flush=True)
for line in sys.stdin:
    if line.strip() == "scribble":
        m.seek(0)
        m.write(b"\xa5" * n)
    print(hashlib.sha256(m).hexdigest(), flush=True)
"""
C_PROGRAM = r"""
#include <stdio.h>
#include <vramd/client.h>
int main(void) {
    char path[256];
    struct vramd_conn *conn;
    struct vramd_error err;
    struct vramd_options opts;
    vramd_options_init(&opts);
    opts.client_name = "debian-package-test";
    if (vramd_socket_path(path, sizeof path) < 0) return 2;
    int r = vramd_connect(&conn, &opts, &err);
    if (r < 0) { fprintf(stderr, "%s: %s\n", path, vramd_strerror(r)); return 1; }
    printf("%s %s %u\n", path, vramd_conn_server(conn), (unsigned)vramd_conn_version(conn));
    vramd_close(conn);
    return 0;
}
"""


def unit(path: str) -> dict[str, str]:
    """The unit file's Key=Value lines (the last one of a key wins; ExecStart= is set once in ours)."""
    out: dict[str, str] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith(("#", "[")) and "=" in line:
                k, v = line.split("=", 1)
                out[k] = v
    return out


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def run(*cmd: str, **kw: object) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)  # type: ignore[call-overload]
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stdout}{r.stderr}")
    return r


def listening_inode(path: str) -> str:
    """"socket:[INODE]" of the socket listening on `path` (/proc/net/unix)."""
    with open("/proc/net/unix") as f:
        for line in f:
            fields = line.split()
            if len(fields) == 8 and fields[7] == path:
                return f"socket:[{fields[6]}]"
    sys.exit(f"nothing listens on {path}")


def by_systemd() -> tuple[int, Callable[[], int]]:
    """The socket unit is enabled and listening; the first client starts the service (Type=notify: active
    once vramd said READY=1)."""
    facts_status = json.loads(run("vramctl", "status", "--json").stdout)
    assert facts_status["server"].startswith("vramd"), facts_status
    show = dict(line.split("=", 1) for line in run("systemctl", "show", "-p", "MainPID", "-p", "ActiveState",
                                                     "vramd.service").stdout.split())
    if show["ActiveState"] != "active":
        sys.exit(f"vramd.service is {show['ActiveState']}")

    def stop() -> int:
        run("systemctl", "stop", "vramd.service")  # SIGTERM: drains, exits 0
        out = dict(line.split("=", 1) for line in run("systemctl", "show", "-p", "ExecMainStatus", "-p", "Result",
                                                        "vramd.service").stdout.split())
        return int(out["ExecMainStatus"]) if out["Result"] == "success" else -1

    return int(show["MainPID"]), stop


def as_the_unit_would(service: dict[str, str], sock_unit: dict[str, str]) -> tuple[int, Callable[[], int]]:
    """No systemd as PID 1: the socket bound as vramd.socket says, the service's ExecStart run as its
    User=/Group= with the user's groups, no capabilities, the socket as fd 3 (LISTEN_FDS, LISTEN_PID) and a
    notify socket waited on for READY=1."""
    path = sock_unit["ListenSequentialPacket"]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    os.chown(path, pwd.getpwnam(sock_unit["SocketUser"]).pw_uid, grp.getgrnam(sock_unit["SocketGroup"]).gr_gid)
    os.chmod(path, int(sock_unit["SocketMode"], 8))
    listener.listen(64)
    notify_path = "/run/vramd-test-notify"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    os.chmod(notify_path, 0o777)  # the daemon's user sends to it
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "NOTIFY_SOCKET": notify_path,
           "LISTEN_FDS": "1", "LISTEN_FDNAMES": sock_unit["FileDescriptorName"], "LFD": str(listener.fileno())}
    log = "/var/log/vramd-test.log"
    daemon = subprocess.Popen(
        ["/bin/sh", "-c", 'exec 3<&"$LFD"; g=$1; shift; LISTEN_PID=$$ exec setpriv --reuid="$0" --regid="$g" '
         '--init-groups --no-new-privs --inh-caps=-all --bounding-set=-all "$@"',
         service["User"], service["Group"], *service["ExecStart"].split()],
        env=env, pass_fds=(listener.fileno(),), stderr=os.open(log, os.O_WRONLY | os.O_CREAT, 0o644))
    notes: list[str] = []
    while not any(n.startswith("READY=1") for n in notes):
        ready, _, _ = select.select([notify], [], [], 60)
        if not ready or daemon.poll() is not None:
            sys.exit(f"vramd did not say READY=1 (exit {daemon.poll()}): {read(log)}")
        notes.extend(notify.recv(4096).decode().split("\n"))
    listener.close()

    def stop() -> int:
        daemon.send_signal(signal.SIGTERM)
        return daemon.wait(timeout=120)

    return daemon.pid, stop


def main() -> None:
    facts: dict[str, object] = {}
    service = unit("/lib/systemd/system/vramd.service")
    sock_unit = unit("/lib/systemd/system/vramd.socket")
    doc = service["Documentation"].removeprefix("file://")
    facts["documentation"] = doc
    facts["documentation_exists"] = os.path.isfile(doc)
    facts["socket_enabled"] = os.path.islink("/etc/systemd/system/sockets.target.wants/vramd.socket")

    # what sysusers.d and tmpfiles.d made at install time
    user = pwd.getpwnam(service["User"])
    facts["user"] = {"name": user.pw_name, "uid": user.pw_uid, "home": user.pw_dir, "shell": user.pw_shell}
    facts["member_of"] = sorted(g.gr_name for g in grp.getgrall() if user.pw_name in g.gr_mem)
    st = os.stat("/run/vramd")
    facts["run_dir"] = [oct(stat.S_IMODE(st.st_mode)), pwd.getpwuid(st.st_uid).pw_name, grp.getgrgid(st.st_gid).gr_name]

    path = sock_unit["ListenSequentialPacket"]
    under_systemd = read("/proc/1/comm").strip() == "systemd"
    facts["pid1"] = read("/proc/1/comm").strip()
    started = time.monotonic()
    if under_systemd:
        pid, stop = by_systemd()
    else:
        pid, stop = as_the_unit_would(service, sock_unit)
    facts["ready_s"] = round(time.monotonic() - started, 2)
    st = os.stat(path)
    facts["socket"] = [path, oct(stat.S_IMODE(st.st_mode)), pwd.getpwuid(st.st_uid).pw_name,
                       grp.getgrgid(st.st_gid).gr_name]
    facts["daemon_holds_the_socket"] = listening_inode(path) in {
        os.readlink(f"/proc/{pid}/fd/{n}") for n in os.listdir(f"/proc/{pid}/fd")}
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    facts["daemon"] = {"exe": os.readlink(f"/proc/{pid}/exe"),
                       "cmdline": read(f"/proc/{pid}/cmdline").split("\0")[:-1],
                       "uid": int(status["Uid"].split()[0]),
                       "group": grp.getgrgid(int(status["Gid"].split()[0])).gr_name,
                       "groups": sorted(grp.getgrgid(int(g)).gr_name for g in status["Groups"].split()),
                       "cap_eff": status["CapEff"], "no_new_privs": status["NoNewPrivs"]}

    # a workload dumped, verified and restored through the installed socket with the package's vramctl
    work = subprocess.Popen([sys.executable, "-c", WORKLOAD, str(SIZE)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert work.stdin is not None and work.stdout is not None
    addr, before = work.stdout.readline().split()
    image = "/var/tmp/vramd-image"
    t = time.monotonic()
    dump = run("vramctl", "dump", "--pid", str(work.pid), "--range", f"{int(addr):#x}:{SIZE}", "--image", image,
               "--json")
    facts["dump"] = {"s": round(time.monotonic() - t, 2), "report": json.loads(dump.stdout)}
    facts["verify"] = json.loads(run("vramctl", "verify", image, "--json").stdout)
    work.stdin.write("scribble\n")
    work.stdin.flush()
    scribbled = work.stdout.readline().strip()
    t = time.monotonic()
    restore = run("vramctl", "restore", "--pid", str(work.pid), "--image", image, "--json")
    facts["restore"] = {"s": round(time.monotonic() - t, 2), "report": json.loads(restore.stdout)}
    work.stdin.write("hash\n")
    work.stdin.flush()
    after = work.stdout.readline().strip()
    work.stdin.close()
    work.wait(timeout=60)
    facts["sha256"] = {"before": before, "scribbled": scribbled, "after": after}

    # the C library, found through pkg-config
    with open("/tmp/client.c", "w") as f:
        f.write(C_PROGRAM)
    flags = run("pkg-config", "--cflags", "--libs", "vramd").stdout.split()
    run("gcc", "-Wall", "-Werror", "-o", "/tmp/client", "/tmp/client.c", *flags)
    facts["pkg_config"] = flags
    facts["c_client"] = run("/tmp/client").stdout.strip()
    facts["c_client_links"] = [line.split()[2] for line in run("ldd", "/tmp/client").stdout.splitlines()
                               if "libvramd" in line]

    # who may connect: a member of group vramd (the socket's group, allowed_groups) may, another user may not
    for name, groups in (("vramd-member", ["-G", "vramd"]), ("vramd-outsider", [])):
        run("useradd", "--no-create-home", "--no-user-group", "--gid", "users", *groups, name)
        r = subprocess.run(["setpriv", f"--reuid={name}", "--regid=users", "--init-groups", "vramctl", "--socket",
                            path, "status", "--json"], capture_output=True, text=True, timeout=60)
        facts[name] = {"rc": r.returncode, "stderr": r.stderr.strip(),
                       "server": json.loads(r.stdout)["server"] if r.returncode == 0 else None}

    facts["daemon_exit"] = stop()
    facts["socket_kept"] = os.path.exists(path)  # systemd's (or this script's), not the daemon's
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
