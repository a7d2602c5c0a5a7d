"""One big client does not starve the others (issue #12, finding 3).

A child process adds 49,152 procmem BOs to one dump session in messages as
big as the daemon takes (about 1 MiB, some 60,000 BOs each where the
socket allows), while another times GetStatus round trips on its own
connection.  The per-BO work of an AddBos runs on the event loop in steps
of a few ms (service.intake.ADD_STEP_SECONDS), and the full garbage collection
waits for a quiet moment, so the round trips stay short throughout.  (On
main, before this, one such message held the loop for seconds.)

The round trips are measured while the BOs are added, while the image is
committed (the chunk table, the BO entries, the totals and the manifest are
built and encoded off the event loop, in a CPU thread and the image's
thread, and go into protobuf fields a slice per call so no one call holds
the GIL for long), and while the same 49,152 BOs are restored (the manifest
is read, checked and indexed off the loop).  They must be answered within
100 ms (all but one in 200, the stalls of a VM's vCPU) and none take 400 ms.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from helpers import ROOT

from vramd.testing import DaemonProcess

N = 49_152  # about 5 s of adding on 2 busy cores


@pytest.fixture
def daemon(run_dir, tmp_path):
    """A daemon that takes N BOs in one session, ahead of the machine's other work in the CPU queue (root
    may raise priority): this measures what the daemon's event loop does with its time, not how busy the
    machine's cores are."""
    cfg = tmp_path / "big.toml"
    cfg.write_text(f"max_bos_per_session = {N}\nmax_bos_per_uid = {N}\n")
    prefix = ["nice", "-n", "-10", sys.executable] if os.geteuid() == 0 else None
    with DaemonProcess(run_dir, "--config", str(cfg), argv_prefix=prefix) as d:
        yield d


@pytest.mark.slow
def test_getstatus_answers_quickly_while_another_client_dumps_and_restores_many_bos(daemon, image_dir):
    code = textwrap.dedent(f"""
        import os, socket, sys
        import vramd.protocol.client as pc
        from vramd.client import Client, ClientBo, SESSION_DUMP, SESSION_RESTORE
        from vramd.testing import Workload
        dfd = os.open({str(image_dir[0])!r}, os.O_RDONLY | os.O_DIRECTORY)
        with Workload([{{"size": 16 << 20, "fill": "random", "seed": 1}}]) as w, Client({daemon.socket!r}) as c:
            try:  # root: a send buffer that takes the daemon's biggest message
                c.sock.setsockopt(socket.SOL_SOCKET, 32, 4 << 20)  # SO_SNDBUFFORCE
                pc.TARGET_MESSAGE_BYTES = c.limits.max_message_bytes - 1024
            except OSError:
                pc.TARGET_MESSAGE_BYTES = 180 << 10  # under the default send buffer
            base = w.regions[0]["addr"]
            mem, wmem = w.open_mem(), w.open_mem(os.O_RDWR)
            bos = [ClientBo(i + 1, mem, offset=base + (i % 4096) * 4096, size=4096, backend="procmem")
                   for i in range({N})]
            print("ready", flush=True)
            sys.stdin.readline()
            s = c.open_session(SESSION_DUMP, dfd)
            info = c.add_bos(s.token, bos)
            print("added", info.progress.bos_total, flush=True)
            c.start(s.token)
            assert c.wait(s.token).progress.bos_done == {N}
            c.close_session(s.token)
            print("dumped", flush=True)
            for b in bos:
                b.fd = wmem
            s = c.open_session(SESSION_RESTORE, dfd)
            c.add_bos(s.token, bos)
            c.start(s.token)
            assert c.wait(s.token).progress.bos_done == {N}
            c.close_session(s.token)
            print("restored", flush=True)
    """)
    probe = textwrap.dedent(f"""
        import sys, time
        from vramd.client import Client
        with Client({daemon.socket!r}, timeout=30) as c:
            print("ready", flush=True)
            while not sys.stdin.readline().strip():  # an empty line: one more round trip
                t = time.perf_counter()
                c.status()
                print(time.perf_counter() - t, flush=True)
    """)
    nice = ["nice", "-n", "-10"] if os.geteuid() == 0 else []  # the probe too: it measures, it must not wait
    loader = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    prober = subprocess.Popen([*nice, sys.executable, "-c", probe], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    phases: dict[str, list[float]] = {}
    try:
        assert loader.stdout.readline().strip() == "ready"
        assert prober.stdout.readline().strip() == "ready"
        loader.stdin.write("go\n")
        loader.stdin.flush()
        os.set_blocking(loader.stdout.fileno(), False)
        for phase, ends_with in (("adding", f"added {N}"), ("committing", "dumped"), ("restoring", "restored")):
            rtts = phases[phase] = []
            line = ""
            while not line.endswith("\n"):  # round trips until the loader says the phase is over
                prober.stdin.write("\n")
                prober.stdin.flush()
                rtts.append(float(prober.stdout.readline()))
                line += loader.stdout.readline()  # non-blocking: a line may come in pieces
            assert line.strip() == ends_with, line
        os.set_blocking(loader.stdout.fileno(), True)
        prober.stdin.write("stop\n")
        prober.stdin.flush()
        assert loader.wait(120) == 0
    finally:
        for child in (loader, prober):
            if child.poll() is None:
                child.kill()
            child.wait()
            child.stdin.close()
            child.stdout.close()
    report = f"{N} BOs; GetStatus round trips " + "; ".join(
        f"{phase} {len(r)}: p50 {sorted(r)[len(r) // 2] * 1e3:.1f} ms, max {max(r) * 1e3:.1f} ms"
        for phase, r in phases.items())
    print(report)
    every = sorted(x for r in phases.values() for x in r)
    assert len(every) > 100, report
    # The loop holds no step longer than a few ms, and no protobuf call in another thread holds the GIL for
    # long.  Measured here (2 cores, quiet): max 28-39 ms; before the totals and the manifest's fields left
    # the loop's reach, 67-87 ms, and 649 ms with the whole commit on the loop.  A VM's vCPU can stall for
    # tens of ms whatever the daemon does (one round trip of thousands took 108 ms once), so: no round trip
    # near the 649 ms of one step too long, and at most one in 200 over 100 ms, where a step too long on
    # the loop would delay every round trip that meets it.
    slow = [x for x in every if x >= 0.100]
    assert every[-1] < 0.400, report
    assert len(slow) <= len(every) // 200, f"{len(slow)} round trips took 100 ms or more; {report}"
