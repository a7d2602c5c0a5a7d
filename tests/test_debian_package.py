"""The Debian packages installed on a fresh Debian 12: debootstrap a chroot, install the built .debs there with
apt (so their dependencies resolve from the archive), then run tests/debian_scenario.py in it: the users, groups
and directories the maintainer scripts made, the daemon started from the installed units as user vramd on
/run/vramd/vramd.sock, a workload dumped and restored byte-exact through that socket with the package's vramctl,
and a C program built with `pkg-config vramd` (docs/packaging.md).

The .debs: VRAMD_DEBS=DIR (.ci/debian builds them first), else this builds them (.ci/debian --build-only).
The chroot: debootstrap --variant=minbase bookworm from the mirror apt uses here; the result is cached as a
tarball (VRAMD_DEBIAN_CACHE, default ~/.cache/vramd) and reused for a week.  Needs root, debootstrap and
unshare; everything runs in a private mount and pid namespace, so nothing stays mounted or running.  With
systemd-nspawn the installed chroot is booted with systemd as PID 1 (VRAMD_DEBIAN_BOOT=0: the plain chroot, where
tests/debian_scenario.py starts the daemon as the units would).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="debootstrap and chroot need root"),
    pytest.mark.skipif(shutil.which("debootstrap") is None or shutil.which("unshare") is None,
                       reason="needs debootstrap and unshare (.ci/debian installs debootstrap)"),
]
SUITE = "bookworm"
SCENARIO = "usr/local/lib/vramd-package-test/scenario.py"  # not under /tmp: a booted container mounts a tmpfs there
CACHE_DAYS = 7


def _mirror() -> str:
    """The Debian mirror this machine's apt uses (deb822 or one-line sources), else deb.debian.org."""
    for src in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        try:
            text = src.read_text()
        except OSError:
            continue
        for m in re.finditer(r"^(?:URIs:\s*|deb\s+(?:\[[^\]]*\]\s+)?)(\S+)", text, re.M):
            uri = m.group(1)
            if uri.rstrip("/").endswith("/debian"):
                return uri
    return "http://deb.debian.org/debian"


@pytest.fixture(scope="module")
def debs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("VRAMD_DEBS")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("debs")
    r = subprocess.run([os.path.join(ROOT, ".ci", "debian"), "--build-only", str(out)], capture_output=True,
                       text=True, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def _base_tarball() -> tuple[Path, float]:
    """A debootstrapped Debian 12 (minbase), cached; the seconds debootstrap took (0.0: from the cache)."""
    cache = Path(os.environ.get("VRAMD_DEBIAN_CACHE", Path.home() / ".cache" / "vramd"))
    tarball = cache / f"debootstrap-{SUITE}-minbase-amd64.tar"
    if tarball.exists() and time.time() - tarball.stat().st_mtime < CACHE_DAYS * 86400:
        return tarball, 0.0
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(subprocess.run(["mktemp", "-d", "-p", str(cache)], capture_output=True, text=True,
                               check=True).stdout.strip())
    try:
        start = time.monotonic()
        r = subprocess.run(["debootstrap", "--variant=minbase", SUITE, str(work / "root"), _mirror()],
                           capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        took = time.monotonic() - start
        subprocess.run(["tar", "-C", str(work / "root"), "-cf", str(work / "base.tar"), "."], check=True)
        os.replace(work / "base.tar", tarball)  # whole or not at all
        return tarball, took
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _in_chroot(root: Path, script: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """`script` (sh) run in the chroot, in new mount and pid namespaces: /dev, /proc and a tmpfs /run are
    mounted there only, and go away with every process the script started."""
    setup = (f'set -e; mount --make-rprivate /; r="{root}"; mount --rbind /dev "$r/dev"; '
             'mount -t proc proc "$r/proc"; mount -t tmpfs -o mode=0755 tmpfs "$r/run"; '
             'cp /etc/resolv.conf "$r/etc/resolv.conf"; exec chroot "$r" /bin/sh -c "$0"')
    return subprocess.run(["unshare", "--mount", "--pid", "--fork", "--kill-child", "/bin/sh", "-c", setup, script],
                          capture_output=True, text=True, timeout=timeout)


def _chroot_scenario(root: Path) -> dict[str, object]:
    """No systemd-nspawn: the scenario in the chroot, starting the daemon as the units would."""
    # a fresh /run, as at boot: systemd-tmpfiles-setup.service's part (the chroot has no systemd to run it)
    r = _in_chroot(root, f"systemd-tmpfiles --create && exec python3.11 /{SCENARIO}", timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _boot(root: Path) -> dict[str, object]:
    """The chroot booted with systemd as PID 1 (systemd-nspawn --boot): a oneshot unit runs the scenario
    once multi-user.target is up (the enabled vramd.socket listening), then powers the container off."""
    units = root / "etc" / "systemd" / "system"
    (units / "vramd-package-test.service").write_text(
        "[Unit]\nAfter=multi-user.target\n[Service]\nType=oneshot\nStandardOutput=file:/root/facts.json\n"
        f"StandardError=file:/root/scenario.err\nExecStart=/usr/bin/python3.11 /{SCENARIO}\n"
        "ExecStopPost=/usr/bin/systemctl --no-block poweroff\n[Install]\nWantedBy=multi-user.target\n")
    (units / "multi-user.target.wants").mkdir(exist_ok=True)
    (units / "multi-user.target.wants" / "vramd-package-test.service").symlink_to(
        "/etc/systemd/system/vramd-package-test.service")
    # --register=no, --keep-unit: no systemd (and no bus) on the host side; the console's output for a failure
    r = subprocess.run(["systemd-nspawn", "-q", "-D", str(root), "--register=no", "--keep-unit", "--boot",
                        "--console=read-only"], capture_output=True, text=True, timeout=600)
    err = (root / "root" / "scenario.err").read_text() if (root / "root" / "scenario.err").exists() else ""
    out = (root / "root" / "facts.json").read_text() if (root / "root" / "facts.json").exists() else ""
    assert r.returncode == 0 and out.strip(), f"nspawn exit {r.returncode}\n{r.stdout[-4000:]}\n{err}"
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    """An empty directory for the chroot, removed afterwards (about 500 MB once installed)."""
    (tmp_path / "root").mkdir()
    yield tmp_path / "root"
    shutil.rmtree(tmp_path / "root", ignore_errors=True)


def test_the_packages_install_on_debian_12_and_serve_a_dump_and_restore(debs: Path, root: Path) -> None:
    names = sorted(p.name for p in debs.glob("*.deb") if "dbgsym" not in p.name)
    assert [n.split("_")[0] for n in names] == ["libvramd-dev", "libvramd1", "vramd"], names
    start = time.monotonic()
    tarball, debootstrap_s = _base_tarball()
    subprocess.run(["tar", "-C", str(root), "-xf", str(tarball)], check=True)
    unpack_s = time.monotonic() - start - debootstrap_s
    (root / "tmp" / "debs").mkdir()
    for n in names:
        shutil.copy(debs / n, root / "tmp" / "debs" / n)
    (root / SCENARIO).parent.mkdir(parents=True)
    shutil.copy(Path(ROOT, "tests", "debian_scenario.py"), root / SCENARIO)
    assert not (root / "usr" / "bin" / "vramd").exists() and not (root / "usr" / "bin" / "python3.11").exists()

    script = (
        "set -e; export DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 PATH=/usr/sbin:/usr/bin:/sbin:/bin; "
        "apt-get update -qq >/tmp/apt.log 2>&1; "
        f"apt-get install -y -q --no-install-recommends {' '.join('/tmp/debs/' + n for n in names)} "
        "gcc libc6-dev pkg-config >>/tmp/apt.log 2>&1 || { tail -40 /tmp/apt.log; exit 1; }"
    )
    t = time.monotonic()
    r = _in_chroot(root, script, timeout=1200)
    install_s = time.monotonic() - t
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    t = time.monotonic()
    boot = shutil.which("systemd-nspawn") is not None and os.environ.get("VRAMD_DEBIAN_BOOT", "1") != "0"
    facts = _boot(root) if boot else _chroot_scenario(root)
    scenario_s = time.monotonic() - t
    print(f"\ndebootstrap {debootstrap_s:.0f} s (0: cached), unpack {unpack_s:.1f} s, apt install {install_s:.1f} s, "
          f"pid 1 {facts['pid1']}: boot + scenario {scenario_s:.1f} s (daemon up {facts['ready_s']} s, dump "
          f"{facts['dump']['s']} s, restore {facts['restore']['s']} s), all {time.monotonic() - start:.0f} s",
          file=sys.stderr)
    print(f"a user not in group vramd: {facts['vramd-outsider']}", file=sys.stderr)
    if boot:
        assert facts["pid1"] == "systemd"  # the real thing: the units as systemd runs them

    # installed as the unit names them; the maintainer scripts ran sysusers.d, tmpfiles.d and enabled the socket
    assert facts["documentation"] == "/usr/share/doc/vramd/protocol.md" and facts["documentation_exists"]
    assert facts["socket_enabled"]
    user = facts["user"]
    assert user["name"] == "vramd" and 0 < user["uid"] < 1000 and user["shell"] == "/usr/sbin/nologin"
    assert {"render", "video"} <= set(facts["member_of"])  # minbase has no render group: sysusers made it
    assert facts["run_dir"] == ["0o755", "root", "vramd"]
    assert facts["socket"] == ["/run/vramd/vramd.sock", "0o660", "root", "vramd"]

    # the daemon: the package's, as vramd, with its groups, no capabilities
    d = facts["daemon"]
    assert d["exe"] == "/usr/bin/python3.11" and d["cmdline"][1:3] == ["/usr/bin/vramd", "--config"], d
    assert d["uid"] == user["uid"] and d["group"] == "vramd" and {"render", "video"} <= set(d["groups"]), d
    assert facts["daemon_holds_the_socket"]
    assert int(d["cap_eff"], 16) == 0 and d["no_new_privs"] == "1", d

    # byte-exact through the socket
    sha = facts["sha256"]
    assert sha["after"] == sha["before"] != sha["scribbled"], sha
    assert facts["verify"]["ok"] is True, facts["verify"]
    image = root / "var" / "tmp" / "vramd-image"
    files = sorted(p.name for p in image.iterdir())
    assert files and all((image / f).stat().st_uid == 0 for f in files), files  # the client's files, not vramd's

    # the C library via pkg-config
    assert "-lvramd" in facts["pkg_config"]
    path, server = facts["c_client"].split()[:2]
    assert path == "/run/vramd/vramd.sock" and server.startswith("vramd"), facts["c_client"]
    assert facts["c_client_links"] == ["/lib/x86_64-linux-gnu/libvramd.so.1"] or \
        facts["c_client_links"] == ["/usr/lib/x86_64-linux-gnu/libvramd.so.1"], facts["c_client_links"]

    # the socket's group is the gate: a member of vramd gets in, another user gets one line, not a traceback
    assert facts["vramd-member"]["rc"] == 0 and facts["vramd-member"]["server"].startswith("vramd")
    outsider = facts["vramd-outsider"]
    assert outsider["rc"] != 0 and "Traceback" not in outsider["stderr"] and outsider["stderr"], outsider
    assert "denied" in outsider["stderr"].lower() or "permission" in outsider["stderr"].lower(), outsider

    assert facts["daemon_exit"] == 0 and facts["socket_kept"]
