"""A shared taker of an image directory's lock against siblings' release cycles, forced one by one.

Children of one image hold its directory's `.lock` shared; the last holder to release it removes the file
(vramd/imagedir/lock.py, DirectoryLock.release), so a taker that opened it just before finds, once it flocks it,
that the name is gone or another file's, and looks again.  Under a churn of siblings (tests/test_image_locks.py's
four processes taking and releasing 2,000 times each) a taker could see that more than 8 times in a row and
was refused, "its .lock was replaced 8 times in a row", though nobody ever excluded it: a flake on a loaded
machine.  Here the replacements are forced in that window, between a real process's open of `.lock` and its
flock, by a real sibling process, one per step, synchronised through pipes: no sleep, no chance.
"""
from __future__ import annotations

import os
import select
import subprocess
import sys

import pytest
from helpers import ROOT

from vramd.errors import InvalidRequestError
from vramd.imagedir import lock_directory
from vramd.imagedir.lock import RELEASES

# A shared taker that stops between each open of `.lock` and its flock (an audit hook: Python raises "open"
# and "fcntl.flock" before each call) until a line comes on stdin, then says how it came out.
TAKER = """
import fcntl, os, sys
from vramd.imagedir import take_lock
from vramd.errors import VramdError
opened = False
def pause(event, args):  # at the first flock after each open of .lock
    global opened
    if event == "open" and args[0] == ".lock":
        opened = True
    elif event == "fcntl.flock" and opened:
        opened = False
        print("OPENED", flush=True)
        if sys.stdin.readline().strip() != "go":
            os._exit(3)
sys.addaudithook(pause)
d = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
try:
    lock = take_lock(d, "the parent", shared=True)
except VramdError as e:
    print("REFUSED", e.code, e.message, flush=True)
    sys.exit(0)
st, now = os.fstat(lock.fd), os.stat(".lock", dir_fd=d)
print("TAKEN", (st.st_ino, st.st_nlink) == (now.st_ino, 1), flush=True)
sys.stdin.readline()
lock.release()
print("RELEASED", flush=True)
"""

# A sibling child's hold of the parent's lock, once per line on stdin: "cycle" takes it shared and releases it;
# "hold" takes it shared and keeps it until the next line.
CYCLER = """
import os, sys
from vramd.imagedir import take_lock
from vramd.errors import VramdError
d = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
held = None
for line in sys.stdin:
    if held is not None:
        held.release()
        held = None
    try:
        lock = take_lock(d, "the parent", shared=True)
    except VramdError as e:
        print("REFUSED", e.message, flush=True)
        continue
    if line.strip() == "hold":
        held = lock
    else:
        lock.release()
    print("ok", flush=True)
"""

CYCLES = 12  # more than the 8 replacements in a row after which take_lock used to refuse a shared taker


def _line(p) -> str:
    """The next line `p` says; a failure where none comes within a minute (a taker that loops for ever)."""
    ready, _, _ = select.select([p.stdout], [], [], 60)
    assert ready, "no answer within 60 s"
    return p.stdout.readline().strip()


def _tell(p, line: str) -> str:
    p.stdin.write(line + "\n")
    p.stdin.flush()
    return _line(p)


@pytest.mark.parametrize("then", ["free", "sibling-holds", "exclusive", "moved-away", "directory-gone",
                                  "removed-in-a-loop"])
def test_a_shared_taker_outlasts_any_number_of_siblings_release_cycles(tmp_path, then):
    """A child taking its parent's lock shared while siblings take and release it sees `.lock` replaced between
    its open and its flock 12 times (each time its last holder, a sibling, removed the very file the taker had
    opened): it is never refused for that (before: "its .lock was replaced 8 times in a row", the flake of the
    4-process churn test on a loaded machine), and is still refused for the real reasons.  Then: `free`, it
    holds the lock (the file at the name, one link), excludes a dump, and `.lock` goes with its release;
    `sibling-holds`, a sibling holds the new file shared, and the taker shares it; `exclusive`, a dump takes
    the lock in that window: "another dump is writing"; `moved-away`, the file it opened is renamed aside (a
    replacement no holder's release explains) 8 times: refused, never looping; `directory-gone`, the parent
    is removed: refused, its `.lock` cannot be created; `removed-in-a-loop`, a process that may write the
    directory removes `.lock` in that window each time: refused after RELEASES removals in all, never looping
    (a dump inside CRIU would otherwise spin for as long as that process likes)."""
    parent = tmp_path / "parent"
    parent.mkdir()
    taker, sibling = (subprocess.Popen([sys.executable, "-c", script, str(parent)], cwd=ROOT, text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                      for script in (TAKER, CYCLER))
    dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    dump_lock = None
    try:
        line = _line(taker)
        for cycle in range(CYCLES):
            assert line == "OPENED", (cycle, line, taker.stderr.read() if line.startswith("REFUSED") else "")
            assert (parent / ".lock").exists()  # the taker's (it created it: nobody held the lock)
            assert _tell(sibling, "cycle") == "ok"  # took it shared, and released it: the last holder
            assert not (parent / ".lock").exists(), cycle  # it removed the taker's file
            line = _tell(taker, "go")
        assert line == "OPENED", line
        if then == "sibling-holds":
            assert _tell(sibling, "hold") == "ok"
        elif then == "exclusive":
            dump_lock = lock_directory(dfd, "the parent")
        elif then == "moved-away":
            for k in range(8):
                assert line == "OPENED", (k, line)
                os.rename(parent / ".lock", tmp_path / f"moved-{k}")  # its file keeps a link, elsewhere
                line = _tell(taker, "go")
            assert line.startswith("REFUSED INVALID_REQUEST") and "replaced 8 times" in line, line
        elif then == "directory-gone":
            assert _tell(sibling, "cycle") == "ok"
            os.rmdir(parent)
        elif then == "removed-in-a-loop":
            for k in range(CYCLES, RELEASES):
                assert line == "OPENED", (k, line)
                os.unlink(parent / ".lock")  # as a release does, but nobody took the lock
                line = _tell(taker, "go")
            assert line.startswith("REFUSED INVALID_REQUEST") and f"removed {RELEASES} times" in line, line
            assert not (parent / ".lock").exists()
        if then not in ("moved-away", "removed-in-a-loop"):
            line = _tell(taker, "go")
        if then in ("free", "sibling-holds"):
            assert line == "TAKEN True", line
            with pytest.raises(InvalidRequestError, match="another dump is writing into the parent"):
                lock_directory(dfd, "the parent")
            assert _tell(sibling, "cycle") == "ok"  # a sibling still shares it
            assert _tell(taker, "release") == "RELEASED"
            assert os.listdir(parent) == []
        elif then == "exclusive":
            assert line.startswith("REFUSED INVALID_REQUEST") and "another dump is writing into the parent" in \
                line, line
        elif then == "directory-gone":
            assert line.startswith("REFUSED") and "cannot create its .lock" in line, line
    finally:
        if dump_lock is not None:
            dump_lock.release()
        os.close(dfd)
        for p in (taker, sibling):
            p.stdin.close()
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    assert taker.returncode == 0 and sibling.returncode == 0, (taker.stderr.read(), sibling.stderr.read())
