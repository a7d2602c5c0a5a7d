"""One big client does not starve the others (issue #12, finding 3).

A child process adds 49,152 procmem BOs to one dump session in messages as
big as the daemon takes (about 1 MiB, some 60,000 BOs each where the
socket allows), while another times GetStatus round trips on its own
connection.  The per-BO work of an AddBos runs on the event loop in steps
of a few ms (sessions.ADD_STEP_SECONDS), and the full garbage collection
waits for a quiet moment, so the round trips stay short throughout.  (On
main, before this, one such message held the loop for seconds.)

The round trips are measured while the BOs are added and while the image
is committed: the chunk table, the BO entries and the manifest are built
and encoded off the event loop (in a CPU thread and the image's thread).
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
def test_getstatus_answers_quickly_while_another_client_adds_many_bos(daemon, image_dir):
    code = textwrap.dedent(f"""
        import os, socket, sys
        import vramd.protocol.client as pc
        from vramd.client import Client, ClientBo, SESSION_DUMP
        from vramd.testing import Workload
        dfd = os.open({str(image_dir[0])!r}, os.O_RDONLY | os.O_DIRECTORY)
        with Workload([{{"size": 16 << 20, "fill": "random", "seed": 1}}]) as w, Client({daemon.socket!r}) as c:
            try:  # root: a send buffer that takes the daemon's biggest message
                c.sock.setsockopt(socket.SOL_SOCKET, 32, 4 << 20)  # SO_SNDBUFFORCE
                pc.TARGET_MESSAGE_BYTES = c.limits.max_message_bytes - 1024
            except OSError:
                pc.TARGET_MESSAGE_BYTES = 180 << 10  # under the default send buffer
            mem, base = w.open_mem(), w.regions[0]["addr"]
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
            print("done", flush=True)
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
    try:
        assert loader.stdout.readline().strip() == "ready"
        assert prober.stdout.readline().strip() == "ready"
        loader.stdin.write("go\n")
        loader.stdin.flush()
        rtts = []
        os.set_blocking(loader.stdout.fileno(), False)
        added = ""
        while not added.endswith("\n"):  # round trips until the loader's AddBos are all answered
            prober.stdin.write("\n")
            prober.stdin.flush()
            rtts.append(float(prober.stdout.readline()))
            added += loader.stdout.readline()  # non-blocking: a line may come in pieces
        assert added.split() == ["added", str(N)], added
        adding = len(rtts)
        done = ""
        while not done.endswith("\n"):  # and while the image is committed: manifest, chunk table, files
            prober.stdin.write("\n")
            prober.stdin.flush()
            rtts.append(float(prober.stdout.readline()))
            done += loader.stdout.readline()
        os.set_blocking(loader.stdout.fileno(), True)
        assert done.strip() == "done", done
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
    rtts.sort()
    committing = len(rtts) - adding
    report = (f"{N} BOs; {len(rtts)} GetStatus ({committing} while it committed): "
              f"p50 {rtts[len(rtts) // 2] * 1e3:.1f} ms, "
              f"p99 {rtts[int(len(rtts) * 0.99)] * 1e3:.1f} ms, max {rtts[-1] * 1e3:.1f} ms")
    print(report)
    assert len(rtts) > 100, report
    # The loop holds no step longer than a few ms; on a 2-core machine shared with other work the scheduler
    # and the GIL (the daemon's copy threads) still delay the odd round trip, hence p99 and a looser maximum.
    # Measured here: max 42-56 ms with the commit off the loop, 649 ms with it on the loop (49,152 BOs).
    assert rtts[int(len(rtts) * 0.99)] < 0.100, report
    assert rtts[-1] < 0.200, report
