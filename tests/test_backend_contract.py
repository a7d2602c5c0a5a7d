"""Every backend passes one contract suite (vramd.testing.check_backend), and the suite can fail.

SDMA runs on the software model of libdrm_amdgpu + SDMA (no AMD GPU here).
"""
from __future__ import annotations

import os

import pytest

from vramd.backends import MmapBackend
from vramd.backends.sdma.binding import MODEL_PATH
from vramd.testing import SUBJECTS, Subject, check_backend
from vramd.testing.contract import mmap_subject


@pytest.mark.parametrize("name", sorted(SUBJECTS))
def test_backend_passes_the_contract(name):
    if name == "sdma" and not os.path.exists(MODEL_PATH):
        pytest.skip("the SDMA model is not built (needs libdrm-dev at install time; ./dev.sh installs it)")
    check_backend(SUBJECTS[name])


class _OffByOne(MmapBackend):
    """Copies from one byte past where it was asked: the contract must notice."""

    def endpoint(self, handle, bo_offset, length):
        return super().endpoint(handle, bo_offset + 1 if bo_offset + length < handle.size else bo_offset, length)


class _Untruthful(MmapBackend):
    """Accepts an fd that is closed: the contract must notice."""

    def check(self, fd, direction, *, bo_id, checked=None):
        return os.fstat(0)


def _subject_with(cls):
    def make():
        s = mmap_subject()
        s.backend.close()
        return Subject(cls(), s.kind, s.new_bo, s.cleanups)
    return make


@pytest.mark.parametrize("broken", [_OffByOne, _Untruthful])
def test_the_contract_catches_a_broken_backend(broken):
    with pytest.raises(AssertionError):
        check_backend(_subject_with(broken))
