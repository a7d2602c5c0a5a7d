"""Who can block whom in an image directory, and the `.child.<id>` marks that protect parents.

The lock is the directory's `.lock` file (vramd/imagedir/lock.py, take_lock), which only who may write the
image can create and only its owner (and root) can open: a user who may merely read the directory (a flock
on the directory itself, a child dump reading the image as its parent) blocks no dump, rm or gc of its
owner.  A `.lock` that is a symlink, a FIFO, another user's file, a hard link or open to others is refused.
A mark names its child (image id, directory): replacing a child leaves one mark in its parent, stale marks
(child gone, or holding another image) are removed by `vramctl gc` and ignored by `vramctl rm`, and rm of a
crafted image never removes another child's mark.  Real daemon, real vramctl processes, uid 65534 for the
reader.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from helpers import ROOT, vramctl

from vramd.image.names import child_mark_name

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid needs root (CI runs as root)")
DROP = f"import os; os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})\n"


@pytest.fixture
def shared_dir():
    """A directory uid 65534 can reach (tmp_path's parents are root's, 0700)."""
    d = tempfile.mkdtemp(prefix="vramd-locks-", dir="/var/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def dump(daemon, img, bo, *more) -> None:
    r = vramctl("dump", "--bo-file", str(bo), "--image", str(img), *more, socket=daemon.socket)
    assert r.returncode == 0, r.stderr


def image_id(img) -> str:
    r = vramctl("inspect", str(img), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["image_id"]


def marks(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith(".child."))


# As uid 65534, who may read the image directory but not write it: flock the directory itself, try the lock
# file, and (with a child directory of its own) open the client side of a child dump of that image, holding
# each until a line comes on stdin.
READER = """
import fcntl, os, sys
from vramd.imagedir import DumpDirectory
from vramd.errors import VramdError
""" + DROP + """
img, child = sys.argv[1], sys.argv[2]
dfd = os.open(img, os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the directory's own flock: any reader gets it
got = ["dir-flocked"]
for flags in (os.O_RDONLY, os.O_RDWR | os.O_CREAT):
    try:
        fd = os.open(os.path.join(img, ".lock"), flags | os.O_NOFOLLOW, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        got.append("LOCK-FILE-TAKEN")
    except OSError as e:
        got.append(f"lock-file-refused-{e.errno}")
os.mkdir(child)
cfd = os.open(child, os.O_RDONLY | os.O_DIRECTORY)
pfd = os.open(img, os.O_RDONLY | os.O_DIRECTORY)
holder = DumpDirectory(cfd, [pfd])  # a child dump's client side, from its OpenSession on
print("HELD", *got, flush=True)
sys.stdin.readline()
holder.close()
"""


@needs_root
def test_a_reader_of_an_image_directory_blocks_no_dump_rm_or_gc_of_its_owner(daemon, shared_dir):
    """uid 65534 may read root's image directory (0755): it flocks the directory, tries the lock file, and
    holds a child dump's client side reading the image as its parent.  Meanwhile root's dump --force, gc and
    rm of that directory all go through (before, each was refused: "another dump is writing into")."""
    img, child = os.path.join(shared_dir, "img"), os.path.join(shared_dir, "reader-child")
    bo = os.path.join(shared_dir, "bo.bin")
    with open(bo, "wb") as f:
        f.write(os.urandom(300_000))
    dump(daemon, img, bo)
    os.chmod(shared_dir, 0o777)  # uid 65534 makes its own child directory here
    reader = subprocess.Popen([sys.executable, "-c", READER, img, child], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = reader.stdout.readline().split()
        assert line[:2] == ["HELD", "dir-flocked"], (line, reader.stderr.read() if reader.poll() is not None else "")
        assert "LOCK-FILE-TAKEN" not in line, line  # a reader can neither open nor create .lock
        r = vramctl("dump", "--bo-file", bo, "--image", img, "--force", socket=daemon.socket)
        assert r.returncode == 0, r.stderr
        r = vramctl("gc", img)
        assert r.returncode == 0, r.stderr
        assert marks(img) == []  # the reader's child could not mark root's image
        r = vramctl("rm", img)
        assert r.returncode == 0, r.stderr
        assert not os.path.exists(img)
    finally:
        reader.stdin.close()
        reader.wait(60)
    assert reader.returncode == 0, reader.stderr.read()


@pytest.mark.parametrize("kind", ["symlink", "fifo", "foreign", "hardlink", "open-to-others"])
def test_a_lock_file_that_is_not_the_owners_own_is_refused(daemon, tmp_path, kind):
    """A `.lock` someone who may write the directory put there instead of vramd's (a symlink, a FIFO,
    another uid's file, a hard link to another file, one others may open) is refused by dump, gc and rm,
    each naming it, and never followed or written; a leftover of a crashed holder (the owner's own 0600
    file) blocks nothing."""
    img, bo = tmp_path / "img", tmp_path / "bo.bin"
    bo.write_bytes(os.urandom(100_000))
    dump(daemon, img, bo)
    before = sorted(os.listdir(img))
    target = tmp_path / "target"
    target.write_bytes(b"not a lock")
    lock = img / ".lock"
    if kind == "symlink":
        lock.symlink_to(target)
        why = "symbolic link"
    elif kind == "fifo":
        os.mkfifo(lock, 0o600)
        why = "not a regular file"
    elif kind == "foreign":
        if os.geteuid() != 0:
            pytest.skip("making another uid's file needs root")
        lock.write_bytes(b"")
        os.chmod(lock, 0o600)
        os.chown(lock, NOBODY, NOBODY)
        why = f"uid {NOBODY}"
    elif kind == "hardlink":
        os.chmod(target, 0o600)
        os.link(target, lock)
        why = "2 links"
    else:
        lock.write_bytes(b"")
        os.chmod(lock, 0o644)
        why = "0644"
    for args in (["dump", "--bo-file", str(bo), "--image", str(img), "--force"], ["gc", str(img)],
                 ["rm", str(img)]):
        r = vramctl(*args, socket=daemon.socket)
        assert r.returncode == 1 and ".lock" in r.stderr and why in r.stderr, (args, r.stderr)
    assert sorted(n for n in os.listdir(img) if n != ".lock") == before  # nothing replaced or removed
    assert target.read_bytes() == b"not a lock"
    # a crashed holder's leftover: the owner's own empty 0600 file
    lock.unlink()
    lock.write_bytes(b"")
    os.chmod(lock, 0o600)
    dump(daemon, img, bo, "--force")
    assert not lock.exists()  # the lock file exists only while held


def test_replacing_a_child_twice_leaves_one_mark_and_rm_removes_both(daemon, tmp_path):
    """dump --force over an incremental image, twice: its parent holds exactly one mark, the current
    image's, naming the child's directory; rm of the child removes it and rm of the parent then works."""
    bo, parent, child = tmp_path / "bo.bin", tmp_path / "parent", tmp_path / "child"
    bo.write_bytes(os.urandom(200_000))
    dump(daemon, parent, bo)
    for _ in range(3):
        dump(daemon, child, bo, "--force", "--parent", str(parent))
    cid = bytes.fromhex(image_id(child))
    assert marks(parent) == [child_mark_name(cid)]
    text = (parent / child_mark_name(cid)).read_bytes()
    assert text == f"vramd child mark 1\nimage {cid.hex()}\npath ../child\nabs {child}\n".encode()
    r = vramctl("rm", str(parent))
    assert r.returncode == 1 and "parent of 1 incremental image" in r.stderr, r.stderr
    r = vramctl("rm", str(child))
    assert r.returncode == 0, r.stderr
    assert marks(parent) == []
    r = vramctl("rm", str(parent))
    assert r.returncode == 0, r.stderr
    assert not parent.exists()


def test_stale_marks_are_removed_by_gc_and_ignored_by_rm_live_ones_still_protect(daemon, tmp_path):
    """Four children of one parent: A's directory deleted by hand (rm -r), B replaced by a self-contained
    image, C's manifest gone (as after a client killed in its commit); D is whole.  gc removes the marks of
    A, B and C, saying why, and keeps D's, which still refuses rm of the parent.  Once D's mark is stale
    too, rm ignores it, says so in one line, and removes the parent."""
    bo, parent = tmp_path / "bo.bin", tmp_path / "parent"
    bo.write_bytes(os.urandom(200_000))
    dump(daemon, parent, bo)
    kids = {k: tmp_path / k for k in "ABCD"}
    ids = {}
    for k, d in kids.items():
        dump(daemon, d, bo, "--parent", str(parent))
        ids[k] = image_id(d)
    assert marks(parent) == sorted(child_mark_name(bytes.fromhex(i)) for i in ids.values())
    shutil.rmtree(kids["A"])
    dump(daemon, kids["B"], bo, "--force")  # no parent any more: its old mark names another image
    (kids["C"] / "manifest.vrdm").unlink()
    r = vramctl("gc", str(parent), "--json")
    assert r.returncode == 0, r.stderr
    stale = json.loads(r.stdout)["stale_marks"]
    assert sorted(s.split()[0] for s in stale) == sorted(child_mark_name(bytes.fromhex(ids[k])) for k in "ABC")
    assert any("is gone" in s for s in stale) and any("holds another image" in s for s in stale) and \
        any("holds no image" in s for s in stale), stale
    assert marks(parent) == [child_mark_name(bytes.fromhex(ids["D"]))]  # the live one stays
    r = vramctl("rm", str(parent))
    assert r.returncode == 1 and "parent of 1 incremental image" in r.stderr, r.stderr
    assert (parent / "manifest.vrdm").exists()
    dump(daemon, kids["D"], bo, "--force")  # D's mark goes stale: rm ignores it, and says so
    r = vramctl("rm", str(parent))
    assert r.returncode == 0, r.stderr
    assert "stale mark" in r.stdout and child_mark_name(bytes.fromhex(ids["D"])) in r.stdout, r.stdout
    assert not parent.exists()


def test_rm_of_a_crafted_image_never_unmarks_another_images_parent(daemon, tmp_path):
    """An image is data: a copy of a child's directory (its manifest names the same image id and parent path)
    removed with vramctl rm leaves the real child's mark in the parent, since the mark names the real
    child's directory; the parent stays protected.  Symlinked parents are followed only to read."""
    bo, parent, child = tmp_path / "bo.bin", tmp_path / "victim", tmp_path / "child"
    bo.write_bytes(os.urandom(200_000))
    dump(daemon, parent, bo)
    dump(daemon, child, bo, "--parent", str(parent))
    mark = marks(parent)
    assert len(mark) == 1
    crafted = tmp_path / "crafted"
    shutil.copytree(child, crafted)  # same image id, same recorded parent path (../victim)
    r = vramctl("rm", str(crafted))
    assert r.returncode == 0, r.stderr
    assert f"kept {mark[0]} in parent #1: it names another directory than {crafted}" in r.stdout, r.stdout
    assert marks(parent) == mark
    r = vramctl("rm", str(parent))
    assert r.returncode == 1 and "parent of 1 incremental image" in r.stderr, r.stderr
    # through a symlink to the parent (--parent): the mark still names the real child only
    link = tmp_path / "link"
    link.symlink_to(parent)
    shutil.copytree(child, crafted)
    r = vramctl("rm", str(crafted), "--parent", str(link))
    assert r.returncode == 0 and marks(parent) == mark, r.stderr
    r = vramctl("rm", str(child))
    assert r.returncode == 0, r.stderr
    assert marks(parent) == []


def test_rm_removes_the_parent_link_the_image_recorded_and_only_a_link(daemon, tmp_path):
    """A child recording its parent as `parent`, a symlink in its own directory (as CRIU's amdgpu plugin does,
    and vramctl pull makes): rm removes that link (not what it points to), its mark in the parent, and the
    directory.  Was: the link stayed, and so did the directory.  A `parent` that is a real directory holding
    the parent image is no link: it stays, and so does the child's directory."""
    bo, parent, child = tmp_path / "bo.bin", tmp_path / "parent", tmp_path / "child"
    bo.write_bytes(os.urandom(200_000))
    dump(daemon, parent, bo)
    child.mkdir()
    (child / "parent").symlink_to("../parent")
    dump(daemon, child, bo, "--parent", str(child / "parent"))
    assert len(marks(parent)) == 1
    r = vramctl("rm", str(child), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["directory_kept"] is False, r.stdout
    assert not os.path.lexists(child)
    assert (parent / "manifest.vrdm").is_file() and marks(parent) == []  # the link's target is untouched
    # a real directory at the recorded name is the operator's, not a link: kept
    nested = tmp_path / "nested"
    dump(daemon, nested / "parent", bo)
    dump(daemon, nested, bo, "--parent", str(nested / "parent"))
    r = vramctl("rm", str(nested), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["directory_kept"] is True, r.stdout
    assert os.listdir(nested) == ["parent"] and (nested / "parent" / "manifest.vrdm").is_file()
    assert marks(nested / "parent") == []


# A sibling child dump's hold of its parent's lock, N times over: take it shared, release it.  Starts when a
# line comes on stdin (all siblings at once); prints how many times it was refused, and the messages.
SIBLING = """
import os, sys
from vramd.imagedir import take_lock
from vramd.errors import VramdError
d = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
print("READY", flush=True)
sys.stdin.readline()
refused = []
for _ in range(int(sys.argv[2])):
    try:
        lock = take_lock(d, "the parent", shared=True)
    except VramdError as e:
        refused.append(e.message)
        continue
    lock.release()
print(len(refused), sorted(set(refused))[:3], flush=True)
"""


def test_sibling_children_taking_and_releasing_a_parents_lock_never_refuse_each_other(tmp_path):
    """Children of one image hold its directory's lock shared and never exclude each other: four processes
    taking and releasing it 2,000 times each at once are never refused (found by review: a sibling that
    opened `.lock` as its last holder removed it was refused, "has 0 links", and one that flocked it while a
    releasing sibling held it exclusively for its unlink, "another dump is writing": ~30 % of the takes),
    and `.lock` is gone once all have released it."""
    parent = tmp_path / "parent"
    parent.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", SIBLING, str(parent), "2000"], cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(4)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "READY", p.stderr.read()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert out.startswith("0 "), out
    assert os.listdir(parent) == []


@needs_root
def test_a_child_in_another_owners_directory_does_not_mark_the_parent(daemon, shared_dir):
    """Root (as CRIU through libvramd would) dumps an incremental image into a directory uid 65534 owns, whose
    parent is in root's own directory: uid 65534, who may write only the child, would otherwise hold a mark
    that refuses root's rm and plain dump of the parent for as long as it keeps the child.  The parent is
    neither locked nor marked (as for a child whose client does not own the parent), and root's rm of the
    parent goes through (found by review: rm was refused, "the parent of 1 incremental image(s)")."""
    parent, child, bo = (os.path.join(shared_dir, n) for n in ("parent", "child", "bo.bin"))
    with open(bo, "wb") as f:
        f.write(os.urandom(200_000))
    dump(daemon, parent, bo)
    os.mkdir(child)
    os.chown(child, NOBODY, NOBODY)
    dump(daemon, child, bo, "--parent", parent)
    assert marks(parent) == []
    assert not os.path.exists(os.path.join(parent, ".lock"))
    r = vramctl("rm", parent)
    assert r.returncode == 0, r.stderr
    # a child in a directory of the parent's owner is still marked
    dump(daemon, parent, bo)
    mine = os.path.join(shared_dir, "mine")
    dump(daemon, mine, bo, "--parent", parent)
    assert len(marks(parent)) == 1


def test_a_mark_one_of_whose_paths_leads_elsewhere_is_kept(daemon, tmp_path):
    """A parent and its child moved together (tree a/ renamed to b/): the child's mark finds it by its relative
    path, while its absolute one names a/child, which no longer exists.  A new child dumped at a/child (parent
    b/parent) must not take that mark for one of its own replaced image, nor must rm of a copy of the child
    placed at a/child remove it: the live child b/child keeps its parent protected (found by review: either
    removed the live child's mark, since one of its paths led to the directory they were given)."""
    bo, a, b = tmp_path / "bo.bin", tmp_path / "a", tmp_path / "b"
    bo.write_bytes(os.urandom(200_000))
    a.mkdir()
    dump(daemon, a / "parent", bo)
    dump(daemon, a / "child", bo, "--parent", str(a / "parent"))
    kid = child_mark_name(bytes.fromhex(image_id(a / "child")))
    os.rename(a, b)
    a.mkdir()
    dump(daemon, a / "child", bo, "--parent", str(b / "parent"))  # its own, new child
    assert kid in marks(b / "parent") and len(marks(b / "parent")) == 2
    r = vramctl("rm", str(a / "child"))
    assert r.returncode == 0, r.stderr
    assert marks(b / "parent") == [kid]
    shutil.copytree(b / "child", a / "child")  # the same image id, at the path the mark also records
    r = vramctl("rm", str(a / "child"), "--parent", str(b / "parent"))
    assert r.returncode == 0, r.stderr
    assert marks(b / "parent") == [kid]
    r = vramctl("rm", str(b / "parent"))
    assert r.returncode == 1 and "parent of 1 incremental image" in r.stderr, r.stderr
