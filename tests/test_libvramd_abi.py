"""libvramd's ABI check (native/client/abi/check.sh; include/vramd/client.h, "ABI 1.0") and that it can fail.

The check compares a build with the committed baseline (libvramd-1.0.abi) through libabigail's abidiff and
the suppressions that state the growth rule.  Here: the library ./dev.sh builds passes it; a build with an
option appended to the size-versioned struct vramd_open_args (-DVRAMD_ABI_TEST_EXTRA, the header's own test
member) passes it too, while abidiff without the suppressions does see that member (so the rule is what lets
it through); and builds whose header removes, reorders or inserts a member fail it, naming the struct.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "native" / "client"
CHECK = SRC / "abi" / "check.sh"
BASELINE = SRC / "abi" / "libvramd-1.0.abi"
SUPPR = SRC / "abi" / "libvramd.suppr"
HEADER = Path("include") / "vramd" / "client.h"

pytestmark = pytest.mark.skipif(shutil.which("abidiff") is None,
                                reason="abidiff is missing: ./dev.sh installs abigail-tools")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)


def build_variant(tmp_path: Path, edit=None, c_args: str = "", edits: dict | None = None) -> Path:
    """libvramd built from a copy of native/client (and rpc.proto), its client.h changed by `edit` and the
    files named in `edits` (paths under native/client) by theirs."""
    tree = tmp_path / "tree"
    shutil.copytree(SRC, tree / "native" / "client", ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "proto" / "vramd" / "pb").mkdir(parents=True)
    shutil.copy(ROOT / "proto" / "vramd" / "pb" / "rpc.proto", tree / "proto" / "vramd" / "pb" / "rpc.proto")
    for rel, change in (({HEADER: edit} if edit else {}) | (edits or {})).items():
        path = tree / "native" / "client" / rel
        text = path.read_text()
        changed = change(text)
        assert changed != text, f"the edit of {rel} changed nothing"
        path.write_text(changed)
    build = tmp_path / "build"
    setup = ["meson", "setup", str(build), str(tree / "native" / "client"), "-Dtests=false", "-Dbench=false"]
    if c_args:
        setup.append(f"-Dc_args={c_args}")
    for cmd in (setup, ["meson", "compile", "-C", str(build)]):
        r = run(cmd)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return build / "libvramd.so.1"


def check(lib: Path) -> subprocess.CompletedProcess[str]:
    """check.sh on a variant's library and the headers it was built from."""
    include = lib.parent.parent / "tree" / "native" / "client" / "include"
    return run([str(CHECK), str(lib), *([str(include)] if include.is_dir() else [])])


def test_the_build_matches_the_baseline():
    """The library ./dev.sh builds is ABI 1.0: the check passes, abidiff reports no change at all."""
    lib = ROOT / "build" / "libvramd" / "libvramd.so.1"
    if not lib.exists():
        r = run(["meson", "compile", "-C", str(lib.parent)])
        assert r.returncode == 0 and lib.exists(), "build libvramd first: ./dev.sh test tests/test_libvramd.py"
    r = check(lib)
    assert r.returncode == 0, r.stdout + r.stderr
    # abidiff itself says nothing: not even a change the suppressions filter
    assert r.stdout.strip().splitlines() == [f"abi check: {lib} is compatible with libvramd ABI 1.0"], r.stdout
    soname = run(["objdump", "-p", str(lib)]).stdout
    assert re.search(r"SONAME\s+libvramd\.so\.1\b", soname), soname
    # every exported symbol carries the one version node
    dyn = run(["objdump", "-T", str(lib)]).stdout
    versions = set(re.findall(r"\s(VRAMD_[\d.]+)\s+vramd_", dyn))
    assert versions == {"VRAMD_1.0"}, versions


def test_an_appended_option_changes_nothing_for_existing_symbols(tmp_path):
    """struct vramd_open_args with one more member at its end (what a 1.x does): no change reported for any
    existing symbol under the growth rule; without the suppressions abidiff does report that very member."""
    lib = build_variant(tmp_path, c_args="-DVRAMD_ABI_TEST_EXTRA")
    r = check(lib)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"Functions changes summary: 0 Removed, 0 Changed \(\d+ filtered out\), 0 Added", r.stdout)
    raw = run(["abidiff", "--no-show-locs", str(BASELINE), str(lib)])
    assert raw.returncode != 0, raw.stdout
    assert "struct vramd_open_args" in raw.stdout and "abi_test_extra" in raw.stdout, raw.stdout


def swap_lines(a: str, b: str):
    """Swap two (unique) member lines."""
    def edit(text: str) -> str:
        assert text.count(a + "\n") == 1 and text.count(b + "\n") == 1
        return text.replace(a + "\n", "\0").replace(b + "\n", a + "\n").replace("\0", b + "\n")
    return edit


def drop_line(what: str, after: str):
    def edit(text: str) -> str:
        start = text.index(after)
        line_start = text.index(what, start)
        line_end = text.index("\n", line_start) + 1
        line_start = text.rindex("\n", 0, line_start) + 1
        return text[:line_start] + text[line_end:]
    return edit


def insert_before(what: str, new: str):
    return lambda text: text.replace(what, new + what, 1)


@pytest.mark.parametrize("edit, struct", [
    (swap_lines("    int min_fd;", "    int timeout_ms;"), "vramd_options"),             # reordered
    (drop_line("    uint64_t reserved[8];", "    bool draining;"), "vramd_status"),  # removed
    (insert_before("    const char *label;                 /* free-form",
                   "    uint32_t inserted;\n"), "vramd_open_args"),                    # inserted, not appended
    (lambda text: text.replace("    uint32_t gpu_id;                   /* dump: recorded",
                               "    int32_t gpu_id;                    /* dump: recorded"), "vramd_bo"),  # retyped
], ids=["reordered", "removed", "inserted", "retyped"])
def test_an_incompatible_change_fails_the_check(tmp_path, edit, struct):
    """A member reordered (vramd_options), removed (an output struct's), inserted in the middle (an input
    struct, where only appending is allowed) or retyped at the same size (vramd_bo.gpu_id) fails the check,
    which names the struct.  The reordered and retyped ones pass abidiff under the growth suppression alone:
    members.py is what catches them."""
    lib = build_variant(tmp_path, edit=edit)
    r = check(lib)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"struct {struct}" in r.stdout, r.stdout
    assert "FAILED" in r.stderr


def replace(old: str, new: str):
    def edit(text: str) -> str:
        assert text.count(old) == 1, old
        return text.replace(old, new)
    return edit


@pytest.mark.parametrize("edits, what", [
    # int -> long: abidiff reading the baseline reports nothing (abidw wrote vramd_wait without its symbol)
    ({HEADER: replace("const struct vramd_token *token, int timeout_ms,",
                      "const struct vramd_token *token, long timeout_ms,"),
      Path("src/session.c"): replace("const struct vramd_token *t, int timeout_ms, struct vramd_session_info *info,",
                                     "const struct vramd_token *t, long timeout_ms, struct vramd_session_info *info,")},
     "function vramd_wait changed"),
    # a member of an output struct reached only through a parameter, retyped
    ({HEADER: replace("    uint64_t staging_in_use;\n", "    int64_t staging_in_use;\n")},
     "function vramd_status changed"),
    ({Path("src/libvramd.map"): replace("        vramd_cancel_by_id;\n", "")}, "vramd_cancel_by_id"),
    # an enum callers pass as int: in no debug information, so only the header's constants show it
    ({HEADER: replace("VRAMD_BACKEND_SDMA = 3,", "VRAMD_BACKEND_SDMA = 4,")}, "constant VRAMD_BACKEND_SDMA"),
], ids=["parameter-retyped", "output-member-retyped", "function-removed", "enum-renumbered"])
def test_a_changed_function_or_constant_fails_the_check(tmp_path, edits, what):
    """A function's parameter retyped, a member of a struct it returns retyped, a function no longer exported,
    an enum value renumbered: each fails the check, which names it."""
    lib = build_variant(tmp_path, edits=edits)
    r = check(lib)
    assert r.returncode == 1, r.stdout + r.stderr
    assert what in r.stdout, r.stdout
    assert "FAILED" in r.stderr
