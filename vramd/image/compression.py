"""How a dump compresses: one `Compression` value from the CLI and the wire to the codec and the manifest.

    none            store every chunk raw (holes are always holes)
    zstd[:L]        one zstd frame per chunk at level L (default 1)
    bplanes[:L]     per chunk, a trial on a sample picks plane words 2, 4 or plain zstd at level L
    auto[:L]        bplanes' trial, and compress a chunk only where that makes the dump faster (image/policy.py)

`--compress` / the config's `compression` / OpenSession's `compression` are
text, parsed once where they arrive (`Compression.parse`); the engine, the
dump job and the codec take the value; the manifest records it as
`pb.Compression` (`to_pb`), read back by `from_pb` and named as the CLI
takes it (`str`, `compression_name`).
"""
from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..pb import image_pb2 as pb
from .policy import LEVELS, AutoPolicy, Choice, Mode, candidates, choose, sample_slices

FORMS = "none, zstd, zstd:LEVEL, bplanes, bplanes:LEVEL, auto, auto:LEVEL"
MODES = ("none", "zstd", "bplanes", "auto")  # what a shell completes after --compress
_SPEC = re.compile(r"(none|zstd|bplanes|auto)(?::(-?[0-9]{1,2}))?")


@dataclass(frozen=True)
class Compression:
    """What a dump asks for: `none`, `zstd[:L]`, `bplanes[:L]` (per chunk, a trial on a sample picks byte
    planes of 2- or 4-byte words or plain zstd), `auto[:L]` (bplanes' choice, but a chunk is compressed
    only where that makes the dump faster at the sink's measured speed: image.policy.AutoPolicy).
    `level`: zstd's (-7..22; also the level of an incremental image's deltas under `none`)."""

    mode: Mode = "none"
    level: int = 1

    @classmethod
    def parse(cls, text: str) -> Compression:
        """'none', 'zstd[:L]', 'bplanes[:L]' or 'auto[:L]' (L a zstd level, -7..22; default, and for 0: 1);
        ValueError naming the accepted forms."""
        m = _SPEC.fullmatch(text)
        if m is None or (m.group(1) == "none" and m.group(2) is not None):
            raise ValueError(f"unknown compression {text!r} (accepted: {FORMS})")
        mode: Mode = m.group(1)  # type: ignore[assignment]  # the pattern admits only the four
        if mode == "none":
            return cls()
        level = int(m.group(2)) if m.group(2) is not None else 1
        if not LEVELS[0] <= level <= LEVELS[1]:
            raise ValueError(f"zstd level {level} out of range ({LEVELS[0]}..{LEVELS[1]}) in {text!r}")
        return cls(mode, level or 1)  # level 0 (zstd's "its default"): vramd's default, 1

    def __str__(self) -> str:
        """The form `parse` takes back."""
        return self.mode if self.mode == "none" else f"{self.mode}:{self.level}"

    @classmethod
    def from_pb(cls, c: pb.Compression) -> Compression:
        """What an image's manifest says it was dumped with."""
        if c.automatic:
            return cls("auto", c.level)
        if c.codec == pb.CODEC_ZSTD:
            return cls("zstd", c.level)
        if c.codec == pb.CODEC_PLANES:
            return cls("bplanes", c.level)
        return cls()

    @property
    def codec(self) -> pb.Codec:
        """The codec the manifest names (auto: CODEC_PLANES, with `automatic`)."""
        return {"none": pb.CODEC_RAW, "zstd": pb.CODEC_ZSTD}.get(self.mode, pb.CODEC_PLANES)

    def to_pb(self) -> pb.Compression:
        if self.mode == "none":
            return pb.Compression(codec=pb.CODEC_RAW)
        return pb.Compression(codec=self.codec, level=self.level, automatic=self.mode == "auto")

    @property
    def buffers_per_chunk(self) -> int:
        return 1 if self.mode == "none" else 2

    def chooser(self, workers: int) -> Chooser | None:
        """Per chunk, which codec (None for plain zstd or none: no trial).  `workers`: the threads that
        compress at once (auto weighs its CPU cost against the sink's speed with it)."""
        if self.mode == "bplanes":
            cands = candidates(self.mode, self.level)
            return lambda view: choose(sample_slices(view), cands)
        if self.mode == "auto":
            return AutoPolicy(self.level, workers)
        return None


# Picks a chunk's codec: image.policy.AutoPolicy (whose `decide` learns what pays), or bplanes' trial.
Chooser = AutoPolicy | Callable[[memoryview], Choice]


def compression_name(c: pb.Compression) -> str:
    """How an image's manifest names its compression (as `--compress` takes it; an auto image of no recorded
    level: `auto`)."""
    return "auto" if c.automatic and not c.level else str(Compression.from_pb(c))


def compression_arg(text: str) -> str:
    """A --compress value checked by the parser (a usage error, exit 2, naming the accepted forms), kept as
    text: the daemon parses it again where it arrives."""
    try:
        Compression.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text
