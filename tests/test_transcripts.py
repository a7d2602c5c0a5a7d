"""Transcripts keep the Python client and libvramd in step (tests/transcripts/README.md).

Each fixture in tests/transcripts/ is replayed against each client by a scripted fake daemon
(vramd.testing.transcript.FakeDaemon) that compares every packet the client sends with the fixture, field by
field and fd role by fd role: `test_transcript[c-dump]` fails, naming the step and the field, when libvramd
sends something the dump fixture does not have.  The clients act the fixture's "setup" out: the Python client
through vramd.testing.transcript_drive, libvramd through its driver program
(native/client/tests/t_transcript.c).  The fixtures are recorded from a real daemon; `test_no_drift`
records them again and compares.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from vramd.testing.transcript import (
    FakeDaemon,
    TranscriptMismatch,
    differences,
    direct_io_dir,
    image_dirs,
    load,
    without_direct,
)
from vramd.testing.transcript_drive import drive, expected, make_dirs
from vramd.testing.transcript_record import record_all
from vramd.testing.transcript_scenarios import DERIVED_FROM, SCENARIOS

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "transcripts"
NAMES = sorted(p.stem for p in FIXTURES.glob("*.json"))
CLIENTS = ("python", "c")
REGENERATE = "python -m vramd.testing.transcript_record tests/transcripts"


@pytest.fixture(scope="module")
def c_driver() -> Path:
    """libvramd's transcript driver, built with the library (build/libvramd, as ./dev.sh builds it)."""
    build = ROOT / "build" / "libvramd"
    setup = [["meson", "setup", str(build), str(ROOT / "native" / "client")]]
    for cmd in ([] if (build / "build.ninja").exists() else setup) + [["meson", "compile", "-C", str(build)]]:
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-4000:]}{r.stderr[-4000:]}"
    return build / "tests" / "libvramd-transcript"


def c_script(setup: dict, socket_path: str, root: Path) -> str:
    """The setup as t_transcript.c's script (its comment says the format)."""
    def w(v) -> str:
        v = str(v) if v not in (None, "") else "-"
        assert " " not in v and "\n" not in v, f"{v!r}: the C driver's words have no spaces"
        return v

    def dirs(a: dict) -> str:
        return ",".join(str(root / p) for p in a.get("parents", [])) or "-"

    lines = [f"socket {socket_path}"]
    for b in setup.get("bos", []):
        lines.append(f"bo {b['id']} {b.get('memfd_size', 0)} {b.get('size', 0)} {int('gpu_id' in b)} "
                     f"{b.get('gpu_id', 0)} {w(b.get('backend'))} {w(b.get('name'))} {b.get('fd_of', '-')} "
                     f"{b.get('offset', 0)} {b.get('alloc_flags', 0)} {b.get('va_addr', 0)}")
    for a in setup["actions"]:
        do = a["do"]
        if do == "open":
            lines.append(f"open {a['kind']} {root / a['dir']} {w(a.get('compression'))} {a.get('chunk_size', 0)} "
                         f"{w(a.get('label'))} {int(bool(a.get('allow_partial')))} {w(a.get('parent_hint'))} "
                         f"{dirs(a)} {int(bool(a.get('no_dedup')))} {int(bool(a.get('replace_parent')))} "
                         f"{int(bool(a.get('supply')))}")
        elif do == "wait":
            lines.append(f"wait {a.get('timeout_ms', -1)}")
        elif do == "cancel":
            lines.append(f"cancel {w(a.get('reason'))}")
        elif do == "criu_restore_submit":
            lines.append(f"criu_restore_submit {root / a['dir']} {w(a.get('label'))} {w(a.get('backend'))} "
                         f"{int(bool(a.get('allow_partial')))} {dirs(a)}")
        else:
            lines.append(do)
        lines.append(f"expect {expected(a, 'c')}")
    return "\n".join(lines) + "\n"


def replay(client: str, fixture: dict, c_driver: Path | None = None, setup: dict | None = None,
           wrapper: Sequence[str] = ()) -> list[list[str]]:
    """Run `client` against a fake daemon scripted by `fixture` (acting out `setup`, default the fixture's):
    its outcomes; raises TranscriptMismatch naming the first step and field it got wrong.  `wrapper`: what runs
    the C driver (e.g. valgrind)."""
    setup = setup if setup is not None else fixture["setup"]
    base = direct_io_dir()
    root = Path(tempfile.mkdtemp(prefix="vramd-tx-", dir=base or "/tmp"))
    try:
        os.chmod(root, 0o755)
        make_dirs(fixture["setup"], root)
        before = set(root.rglob("*"))
        steps = fixture["steps"] if base else without_direct(fixture["steps"])
        sock = str(root / "fake.sock")
        with FakeDaemon(sock, steps, image_dirs(root, fixture["setup"]), name=fixture["scenario"]) as fake:
            if client == "python":
                outcomes = drive(setup, sock, root)
            else:
                assert c_driver is not None
                (root / "script").write_text(c_script(setup, sock, root))
                r = subprocess.run([*wrapper, str(c_driver), str(root / "script")], capture_output=True, text=True,
                                   timeout=120)
                assert r.returncode == 0, r.stdout + r.stderr
                outcomes = [line.split(" ", 1) for line in r.stdout.splitlines()]
            fake.result()
        left = left_behind(root, before)
        assert not left, f"{client} left {left} in the image directories after {fixture['scenario']}"
        return outcomes
    finally:
        shutil.rmtree(root, ignore_errors=True)


def left_behind(root: Path, before: set[Path]) -> list[str]:
    """What a replay's client left in its directories that is not a committed image: a temporary, a lock, or
    anything at all where no dump committed (a failed dump's files and marks are removed, its lock released)."""
    new = {p for p in set(root.rglob("*")) - before if p.name not in ("fake.sock", "script")}
    committed = any(p.name == "manifest.vrdm" for p in new)
    return sorted(str(p.relative_to(root)) for p in new
                  if p.name.endswith(".tmp") or p.name == ".lock" or not committed)


def expected_outcomes(fixture: dict, client: str) -> list[list[str]]:
    return [[a["do"], expected(a, client)] for a in fixture["setup"]["actions"]]


def replay_params() -> list:
    return [pytest.param(c, n, id=f"{c}-{n}") for c in CLIENTS for n in NAMES]


@pytest.mark.parametrize(("client", "name"), replay_params())
def test_transcript(client, name, request):
    """The client sends exactly the fixture's packets (fds by role) and ends each action as the fixture says."""
    fixture = load(FIXTURES / f"{name}.json")
    driver = request.getfixturevalue("c_driver") if client == "c" else None
    assert replay(client, fixture, driver) == expected_outcomes(fixture, client)


def test_fixture_set():
    """Every scenario the issue names has its fixture, the hand-written ones say so, and each fixture's setup
    ends with the outcome its steps imply."""
    want = {"dump", "dump-incremental", "restore", "verify", "offload", "open-refused", "wait-job-error",
            "wait-cancelled", "too-many-files", "wrong-request-id", "hangup", "broken-connection", "bad-file-name",
            "restore-partial"}
    assert want <= set(NAMES)
    for name in NAMES:
        t = load(FIXTURES / f"{name}.json")
        assert t["scenario"] == name
        if name in DERIVED_FROM:
            assert t["derived_from"] == DERIVED_FROM[name] and t["about"].startswith("written by hand")
        else:
            assert "derived_from" not in t
        assert t["steps"][0]["send"]["hello"]["client"] == "<any>"


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize(("field", "change"), [
    ("open_session.chunk_size", {"chunk_size": 131072}),
    ("open_session.compression", {"compression": "zstd"}),
    ("open_session.label", {"label": "tx-other"}),
])
def test_a_wrong_field_fails_naming_it(client, field, change, request):
    """A client that sends one field differently (here: told another chunk size, compression or label)
    fails the unchanged dump fixture, and the failure names the step and that field."""
    fixture = load(FIXTURES / "dump.json")
    setup = copy.deepcopy(fixture["setup"])
    for a in setup["actions"]:
        if a["do"] == "open":
            a.update(change)
    driver = request.getfixturevalue("c_driver") if client == "c" else None
    with pytest.raises(TranscriptMismatch) as e:
        replay(client, fixture, driver, setup)
    assert f"step 2 (send open_session): {field}: the fixture has" in str(e.value)


@pytest.mark.parametrize("client", CLIENTS)
def test_a_missing_fd_fails_naming_its_role(client, request):
    """A fixture that expects another fd role than the client attaches fails naming the fds."""
    fixture = load(FIXTURES / "restore.json")
    fixture = json.loads(json.dumps(fixture))
    open_step = next(s for s in fixture["steps"] if "open_session" in s.get("send", {}))
    open_step["fds"] = ["manifest:1"]
    driver = request.getfixturevalue("c_driver") if client == "c" else None
    want = r"step 2 \(send open_session\): fds: the fixture has \['manifest:1'"
    with pytest.raises(TranscriptMismatch, match=want):
        replay(client, fixture, driver)


def test_without_direct_twins():
    """The o-direct rule: where no O_DIRECT open works, each file's attach carries its one fd, numbered in order."""
    fixture = load(FIXTURES / "dump-incremental.json")
    twins = sum(str(r).endswith("+direct") for s in fixture["steps"] for r in s.get("fds", []))
    assert twins >= 4
    steps = without_direct(fixture["steps"])
    assert len(steps) == len(fixture["steps"])
    for s in steps:
        files = s.get("send", {}).get("attach_files", {}).get("files", [])
        if files:
            assert [f.get("fd_index", 0) for f in files] == list(range(len(files)))
            assert not any("direct_fd_index" in f for f in files)
            assert len(s["fds"]) == len(files) and not any(r.endswith("+direct") for r in s["fds"])


ERROR_PATHS = ("open-refused", "wait-job-error", "wait-cancelled", "wait-timeout", "too-many-files",
               "wrong-request-id", "broken-connection", "bad-file-name", "hangup")


@pytest.mark.parametrize("name", ERROR_PATHS)
def test_c_error_paths_leak_nothing(name, c_driver, tmp_path):
    """libvramd on each error path, under valgrind: the same packets, and no byte of memory nor any fd left
    behind by the library when the driver has closed what it opened."""
    if shutil.which("valgrind") is None:
        pytest.fail("valgrind is missing: ./dev.sh installs it")
    fixture = load(FIXTURES / f"{name}.json")
    log = tmp_path / "valgrind.log"
    vg = ["valgrind", "-q", "--error-exitcode=99", "--leak-check=full", "--errors-for-leak-kinds=all",
          "--track-fds=yes", f"--log-file={log}"]
    assert replay("c", fixture, c_driver, wrapper=vg) == expected_outcomes(fixture, "c")
    report = log.read_text()
    assert "FILE DESCRIPTORS:" in report, report
    leaked = [b for b in report.split("Open file descriptor ")[1:] if "<inherited from parent>" not in b]
    assert not leaked, f"fds left open at exit: {leaked}"


def test_no_drift():
    """The recordable fixtures, recorded again from a real daemon, are the committed ones; the hand-written
    ones are still the edits of them that transcript_scenarios.derive makes."""
    recorded = record_all()
    assert sorted(recorded) == NAMES, f"the fixtures are not the scenarios' ({REGENERATE})"
    assert len(recorded) == len(SCENARIOS) + len(DERIVED_FROM)
    for name, t in recorded.items():
        t = json.loads(json.dumps(t))
        committed = load(FIXTURES / f"{name}.json")
        how = f"derived from {t['derived_from']}.json as transcript_scenarios.derive says" if name in DERIVED_FROM \
            else "what a real daemon and the Python client exchange now"
        assert t == committed, (
            f"tests/transcripts/{name}.json is not {how} ({'; '.join(differences(committed, t))[:2000]}); if the "
            f"change is meant, regenerate the fixtures: {REGENERATE}")
