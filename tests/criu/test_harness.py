"""The CRIU harness's own papercuts (no CRIU needed): relative libvramd paths, "without
libvramd", and a failing plugin build that must show the compiler's error."""
from __future__ import annotations

import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import criu_harness
from criu_harness import REPO, Env, build


def test_relative_libvramd_paths_resolve_from_where_they_were_given(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("VRAMD_CLIENT_INC", "native/client/include")
    # make runs with -C tests/criu: a relative path would name tests/criu/native/client/include there
    assert criu_harness._in_repo("VRAMD_CLIENT_INC", "native/client/include", "vramd/client.h") == \
        os.path.join(REPO, "native", "client", "include")


def test_an_empty_libvramd_variable_means_without_libvramd(monkeypatch, tmp_path):
    (tmp_path / "libvramd.so").write_bytes(b"")      # a libvramd the default would pick up
    monkeypatch.setattr(criu_harness, "REPO", str(tmp_path.parent))
    monkeypatch.setenv("VRAMD_CLIENT_LIBDIR", "")
    assert criu_harness._in_repo("VRAMD_CLIENT_LIBDIR", tmp_path.name, "libvramd.so") is None
    monkeypatch.delenv("VRAMD_CLIENT_LIBDIR")
    assert criu_harness._in_repo("VRAMD_CLIENT_LIBDIR", tmp_path.name, "libvramd.so") == str(tmp_path)


@pytest.mark.skipif(not shutil.which("make") or not shutil.which("cc"), reason="needs make and cc")
def test_a_failing_plugin_build_shows_the_compilers_error(tmp_path):
    criu = tmp_path / "criu"
    (criu / "criu" / "include").mkdir(parents=True)
    (criu / "criu" / "include" / "criu-plugin.h").write_text("#error vramd-harness-test-marker\n")
    with pytest.raises(RuntimeError, match="vramd-harness-test-marker"):
        build(Env(criu_src=str(criu), criu_bin="/bin/true"), str(tmp_path / "out"), with_vramd=False)
