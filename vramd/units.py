"""Sizes as users write them (4096, 0x1000, 8M, 1GiB), and the arithmetic every layer shares."""
from __future__ import annotations

import argparse
import mmap
import re

PAGE = mmap.PAGESIZE  # the host page size: staging buffers, mappings and batch slots align to it

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(0[xX][0-9a-fA-F]+|\d+)\s*([KMGTkmgt]?)(?:i?[bB])?\s*$")
MiB = 1 << 20


def ceil_div(n: int, d: int) -> int:
    """n / d rounded up (n >= 0, d > 0)."""
    return -(-n // d)


def round_up(n: int, to: int = PAGE) -> int:
    """n rounded up to a multiple of `to`."""
    return ceil_div(n, to) * to


def parse_size(text: str | int) -> int:
    """Parse a byte count: decimal or 0x-hex, optional K/M/G/T suffix (powers of two)."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"negative size {text}")
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 0x1000, 8M, 1GiB)")
    return int(m.group(1), 0) * _SUFFIX[m.group(2).upper()]


def size_arg(text: str) -> int:
    """`parse_size` as an argparse type: a bad size is a usage error (exit 2) in parse_size's own words, the one
    style every command and the configuration share ("not a size: '12Q' (examples: ...)")."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
