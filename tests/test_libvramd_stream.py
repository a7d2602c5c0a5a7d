"""libvramd's streamed restore (vramd_open_args.supply_fd, vramd_criu_config.supply_fd) against a real daemon,
with this test as the writer (native/client/tests/t_stream.c, group "stream"): the C program dumps a BO, this
test lays out the streamed directory (manifest.vrdm, each data file at its full length, no byte written) and
holds the write end of the pipe whose read end the C program hands the daemon; the copy waits until this test
writes the files and says so in 16-byte supply messages (vramd.image.supply)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import test_libvramd as base
from test_libvramd import TESTS_BIN, c_env, read_line, run_suite

from vramd.image.manifest import decode_manifest
from vramd.image.names import MANIFEST_NAME
from vramd.image.supply import encode

build = base.build  # the module's fixture: build/libvramd and its C test program
PIECE = 256 << 10


def test_c_supply_fd_checks(build, daemon):
    """The defaults (0: none), the refusals (a dump's, a bad fd) and a 1.1 caller whose struct ends before
    supply_fd: never read, the restore of a complete image works as it did."""
    out = run_suite(daemon, [str(build / TESTS_BIN)],
                    ["supply_defaults", "supply_refused", "supply_not_read_from_a_1_1_struct"], 300)
    for name in ("supply_defaults", "supply_refused", "supply_not_read_from_a_1_1_struct"):
        assert f"PASS {name} " in out, out


def layout(dumped: Path, streamed: Path) -> list[tuple[Path, Path]]:
    """`streamed` as a streamed restore needs it: `dumped`'s manifest, each data file at its length, holes
    only; (source, target) per data file, in the manifest's order (the supply's file indexes)."""
    streamed.mkdir()
    shutil.copyfile(dumped / MANIFEST_NAME, streamed / MANIFEST_NAME)
    m = decode_manifest((dumped / MANIFEST_NAME).read_bytes())
    pairs = []
    for f in m.files:
        src, dst = dumped / f.name, streamed / f.name
        with open(dst, "wb") as out:
            out.truncate(src.stat().st_size)
        pairs.append((src, dst))
    assert pairs, "the dump made no data file"
    return pairs


def supply(pairs: list[tuple[Path, Path]], w: int, fraction: float = 1.0) -> int:
    """Write each data file piece by piece, each piece's end sent once it is written; `fraction` of each
    file only.  The bytes supplied."""
    total = 0
    for index, (src, dst) in enumerate(pairs):
        data = src.read_bytes()
        stop = int(len(data) * fraction)
        with open(dst, "r+b") as out:
            for pos in range(0, stop, PIECE):
                piece = data[pos:min(pos + PIECE, stop)]
                out.seek(pos)
                out.write(piece)
                out.flush()
                os.write(w, encode(index, pos + len(piece)))
                total += len(piece)
    return total


@pytest.mark.parametrize("via", ["open", "criu"])
@pytest.mark.parametrize("expect", ["done", "truncated"])
def test_streamed_restore_through_libvramd(build, daemon, tmp_path, via, expect):
    """vramd_open_session (and vramd_criu_restore_submit + attach) with supply_fd: the copy waits for the
    supply (a wait of 300 ms times out with nothing supplied), then lands the dumped bytes once this test has
    written and announced them; a supply that ends with half of each file announced fails the session with
    TRUNCATED_DATA naming the data file.  The C program's read end stays its own (the pipe's end is its
    writers': this test's write end)."""
    r, w = os.pipe2(os.O_CLOEXEC)
    os.set_inheritable(r, True)
    env = c_env(daemon, VRAMD_TEST_SUPPLY_FD=r, VRAMD_TEST_STREAM_VIA=via, VRAMD_TEST_STREAM_EXPECT=expect)
    p = subprocess.Popen([str(build / TESTS_BIN), "stream_restore"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, pass_fds=(r,))
    os.close(r)
    try:
        dumped = Path(read_line(p, "DUMPED ").split(" ", 1)[1].strip())
        pairs = layout(dumped, tmp_path / "streamed")
        assert p.stdin is not None
        p.stdin.write(f"{tmp_path / 'streamed'}\n")
        p.stdin.flush()
        read_line(p, "STARTED")
        sent = supply(pairs, w, 1.0 if expect == "done" else 0.5)
        assert sent > 0
        os.close(w)  # the supply's end
        w = -1
        out, err = p.communicate(timeout=120)
    finally:
        if w >= 0:
            os.close(w)
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0 and "PASS stream_restore" in out, out + err
    if expect == "truncated":
        assert "TRUNCATED the client stopped supplying data file" in out, out
