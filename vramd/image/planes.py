"""Byte planes (placeholder until the float-aware codec lands)."""
from __future__ import annotations

from collections.abc import Callable


def decompress_planes(payload: memoryview, word: int, raw_length: int, dest: memoryview,
                      bad: Callable[[str], Exception]) -> None:
    raise bad("byte-plane records are not supported by this build")
