"""contrib/criu, the patch series against CRIU's plugins/amdgpu, checked without a CRIU tree: the
series file and the patches agree, the series stays inside plugins/amdgpu and changes CRIU's own
lines only where a hook calls into its files, and every libvramd function and macro it uses is in
libvramd's public headers and its export map.  Applying and building it inside a real CRIU is
tests/criu/test_kfd_vramd_plugin.py (CRIU_SRC, CRIU_BIN)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERIES = ROOT / "contrib" / "criu"
HEADERS = ROOT / "native" / "client" / "include" / "vramd"
MAP = ROOT / "native" / "client" / "src" / "libvramd.map"
OWN_FILES = {"plugins/amdgpu/amdgpu_plugin_vramd.c", "plugins/amdgpu/amdgpu_plugin_vramd.h"}


def _series() -> list[Path]:
    lines = (SERIES / "series").read_text().splitlines()
    return [SERIES / ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def _files(patch: str) -> dict[str, list[str]]:
    """path -> the patch's lines for that file (hunk bodies only)."""
    out: dict[str, list[str]] = {}
    cur: list[str] = []
    in_hunk = False
    for ln in patch.splitlines():
        m = re.match(r"^diff --git a/(\S+) b/(\S+)$", ln)
        if m:
            assert m.group(1) == m.group(2), ln        # no renames
            cur = out.setdefault(m.group(2), [])
            in_hunk = False
        elif ln.startswith("@@"):
            in_hunk = True
        elif ln == "-- " or ln.startswith("-- \n"):
            in_hunk = False
        elif in_hunk:
            cur.append(ln)
    return out


def test_the_series_lists_every_patch_and_nothing_else():
    listed = _series()
    assert listed and all(p.is_file() for p in listed), listed
    assert sorted(p.name for p in listed) == sorted(p.name for p in SERIES.glob("*.patch"))
    assert [p.name[:4] for p in listed] == [f"{i:04d}" for i in range(1, len(listed) + 1)]


def test_the_series_stays_in_plugins_amdgpu_and_touches_criu_lines_only_at_the_hooks():
    added: dict[str, int] = {}
    removed: dict[str, int] = {}
    for patch in _series():
        for path, lines in _files(patch.read_text()).items():
            assert path.startswith("plugins/amdgpu/"), (patch.name, path)
            added[path] = added.get(path, 0) + sum(1 for ln in lines if ln.startswith("+"))
            removed[path] = removed.get(path, 0) + sum(1 for ln in lines if ln.startswith("-"))
    assert set(added) >= OWN_FILES, added
    theirs = {p: n for p, n in added.items() if p not in OWN_FILES}
    # CRIU's own files: the include, the init and fini calls, the five hook call sites, the Makefile's probe
    assert set(theirs) == {"plugins/amdgpu/Makefile", "plugins/amdgpu/amdgpu_plugin.c"}, theirs
    assert theirs["plugins/amdgpu/amdgpu_plugin.c"] <= 25 and theirs["plugins/amdgpu/Makefile"] <= 12, theirs
    assert removed.get("plugins/amdgpu/amdgpu_plugin.c", 0) == 0
    assert removed.get("plugins/amdgpu/Makefile", 0) == 1         # the .so's source list, one file added


def test_every_libvramd_name_the_series_uses_is_public():
    used: set[str] = set()
    for patch in _series():
        for lines in _files(patch.read_text()).values():
            for ln in lines:
                if ln.startswith("+"):
                    used |= set(re.findall(r"\b(vramd_[a-z0-9_]+)\s*\(", ln))
                    used |= set(re.findall(r"\b(VRAMD_[A-Z0-9_]+)\b", ln))
    headers = "".join(p.read_text() for p in HEADERS.glob("*.h"))
    exported = set(re.findall(r"\b(vramd_[a-z0-9_]+);", MAP.read_text()))
    own = {"vramd_image_present", "vramd_config", "vramd_socket", "vramd_not_running", "vramd_log_error",
           "vramd_bos", "vramd_remove_dir", "vramd_refuse_stale"}    # the patch's own static helpers
    own_macros = {"VRAMD_UNIT"}
    funcs = {n for n in used if n.islower()} - own
    macros = {n for n in used if n.isupper()} - own_macros
    assert funcs >= {"vramd_criu_dump", "vramd_criu_restore_submit", "vramd_criu_restore_barrier",
                     "vramd_criu_table_publish", "vramd_criu_table_take_any", "vramd_criu_config_init"}, funcs
    assert funcs <= exported, funcs - exported
    for name in funcs:
        assert re.search(rf"\b{name}\s*\(", headers), name
    assert macros and all(re.search(rf"\b{m}\b", headers) for m in macros), macros
