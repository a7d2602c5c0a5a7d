"""A committed image opened for reading: its manifest (and its parents') checked, then every data file the
client attaches checked as it arrives.

The daemon opens no name (docs/protocol.md, "Image files: the client's
rights"): the client opens the manifests and hands them over
(`from_manifests`), then opens the data files the reader still `needed()`
and hands them over too (`attach`).  A format v2 image may refer to records
of its parents (an incremental image): each parent's manifest is checked to
be the very image the child recorded (image id and the BLAKE3 of its
manifest) before anything is read, and its data files join the reader's file
list after the image's own (`fds`, `names`: the image's own files keep their
manifest index, so a v1 image reads as before).  The reader takes fds only, in
the daemon and in a client that reads an image itself alike (vramd.imagedir,
`read_image`: the client's part).
"""
from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from typing import NamedTuple

from ..errors import (
    CorruptChunkError,
    CorruptManifestError,
    InvalidRequestError,
    ParentMismatchError,
    ParentMissingError,
    TruncatedDataError,
)
from ..hostmem.staging import StagingBuffer
from ..pb import image_pb2 as pb
from .chunks import ParentEntries
from .codec import DecodedChunk, decode_record
from .fileio import check_attached, check_direct, image_os_error, pread_into, preadv_all, read_manifest_hashed
from .format import DATA_HEADER, check_data_header, chunk_count
from .manifest import TableView, chunk_record
from .names import MANIFEST_NAME


class Loc(NamedTuple):
    """Where one chunk's record is: a slot of the reader's file list, and how to check it (a named tuple:
    one is made per record a restore reads)."""

    slot: int                      # index into ImageReader.fds / names
    offset: int                    # the record's file offset
    length: int                    # the whole record's length
    record_checksum: int | None    # the manifest's binding (None: a v1 image from before binding)
    chash: bytes | None = None     # format v2: the content hash the record must carry
    base: Loc | None = None        # a delta record's base chunk
    foreign: bool = False          # a less trusted parent's record: its decoded bytes are checked against `chash`


def parent_label(ref: pb.ParentRef, k: int) -> str:
    """How errors name parent #k: its position, and where the child's dump said it was."""
    path = ref.relative_path if len(ref.relative_path) <= 200 else ref.relative_path[:200] + "..."
    hint = f" (recorded at {path!r})" if path else ""
    return f"parent #{k} of the chain{hint}"


class ImageReader:
    """A committed image: its manifests checked; its data files attached and checked one by one."""

    def __init__(self, manifest: pb.Manifest, *, parents: Sequence[pb.Manifest] = (), manifest_hash: bytes = b"",
                 owner: int | None = None) -> None:
        """`owner`: the uid owning the image's manifest file (whose parent records are trusted as its own)."""
        self.manifest = manifest
        self.manifest_hash = manifest_hash  # BLAKE3 of manifest.vrdm (how a child would name this image)
        self.parents = list(parents)  # the parents' manifests, nearest first
        self.owner = owner
        # (image, file index) -> slot in fds: image 0 is this one, k its parents[k - 1]
        self._slot: dict[tuple[int, int], int] = {}
        self.names: list[str] = []
        self._by_name: dict[tuple[int, str], int] = {}
        for k, m in enumerate([manifest, *self.parents]):
            prefix = "" if k == 0 else f"{parent_label(manifest.parents[k - 1], k)}: "
            for fi, df in enumerate(m.files):
                self._slot[(k, fi)] = len(self.names)
                self._by_name[(k, df.name)] = len(self.names)
                self.names.append(prefix + df.name)
        self._files = [(k, df) for k, m in enumerate([manifest, *self.parents]) for df in m.files]
        self.fds: list[int] = [-1] * len(self.names)  # the attached data files (the caller's), by slot
        self._direct: list[tuple[int, int] | None] = [None] * len(self.names)  # slot -> (O_DIRECT fd, size)
        self.bos = {bo.id: bo for bo in manifest.bos}
        self._locs: dict[int, Loc] = {}  # v2 chunk table index -> its Loc
        # set by Engine.open_parent for a dump's parent: its records by hash (image.chunks.parent_entries)
        self.chunk_entries: ParentEntries | None = None
        self._table = TableView(manifest.chunks)
        self._v2 = manifest.format_version >= 2  # (read once per chunk a restore locates)
        # per image of the chain: its records are trusted as the image's own (else verified by content hash)
        self._trusted: list[bool] = [True] + [False] * len(self.parents)
        self.has_deltas = any(self._table.base)
        self._lock = threading.Lock()
        # a streamed session's: the image's own data files are filled while it runs, their headers checked
        # once supplied (`check_header`), not when attached
        self.streamed = False
        self._check_parent_files()

    @property
    def version(self) -> int:
        return int(self.manifest.format_version)

    @classmethod
    async def from_manifests(cls, manifest_fd: int, parent_fds: Sequence[int] = ()) -> ImageReader:
        """Read and check the manifest in the file `manifest_fd` and those of its parents (`parent_fds`,
        nearest first, format v2): each must be the image the child recorded, else PARENT_MISMATCH; one the
        chain needs and the caller did not give is PARENT_MISSING.  The data files are attached next
        (`needed`, `attach`).  The fds stay the caller's."""
        manifest, digest = await read_manifest_hashed(manifest_fd)
        parents = await cls._parents(manifest, parent_fds)
        try:
            owner: int | None = os.fstat(manifest_fd).st_uid
        except OSError:
            owner = None
        # its indexes grow with the image (49,152 BOs: ~50 ms): built off the event loop too
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: cls(manifest, parents=parents, manifest_hash=digest, owner=owner))

    def needed(self) -> list[tuple[int, str]]:
        """The data files still to attach: (image, name), image 0 being this one and k its k-th parent."""
        return [(k, df.name) for (k, df), fd in zip(self._files, self.fds) if fd < 0]

    @property
    def ready(self) -> bool:
        """Every data file attached."""
        return all(fd >= 0 for fd in self.fds)

    async def attach(self, image: int, name: str, fd: int, direct: int | None = None) -> None:
        """A data file the client opened: checked (a regular file open for reading, this image's header, at
        least as long as the manifest says) in a thread; the fds stay the caller's.  Once the last is here,
        which parents' records are trusted is settled."""
        slot = self._by_name.get((image, name))
        if slot is None:
            raise InvalidRequestError(f"{name!r} of image #{image} is not a data file this session needs")
        if self.fds[slot] >= 0:
            raise InvalidRequestError(f"{self.names[slot]} is attached already")
        run = asyncio.get_running_loop().run_in_executor
        size = await run(None, self._check_file, slot, fd, direct)
        if self.fds[slot] >= 0:  # attached meanwhile
            raise InvalidRequestError(f"{self.names[slot]} is attached already")
        self.fds[slot] = fd
        self._direct[slot] = (direct, size) if direct is not None else None
        if self.ready and self.parents:
            self._trusted = await run(None, self._parents_trusted)

    def _check_file(self, slot: int, fd: int, direct: int | None) -> int:
        k, df = self._files[slot]
        name = self.names[slot]
        size = check_attached(fd, name, write=False)
        if direct is not None:
            check_direct(direct, fd, name)
        m = self.manifest if k == 0 else self.parents[k - 1]
        if k or not self.streamed:
            self._check_header(fd, m, name)
        if size < df.length:
            raise self._truncation(m, df, slot - self._slot[(k, 0)], size)
        return size

    def check_header(self, slot: int) -> None:
        """Check the header of the attached data file in `slot` (in the calling thread: never the event loop)."""
        k, _ = self._files[slot]
        self._check_header(self.fds[slot], self.manifest if k == 0 else self.parents[k - 1], self.names[slot])

    @staticmethod
    def _check_header(fd: int, m: pb.Manifest, name: str) -> None:
        header = memoryview(bytearray(DATA_HEADER.size))
        try:
            got = pread_into(fd, header, 0)
        except OSError as e:
            raise image_os_error(e, f"cannot read data file {name}") from None
        check_data_header(bytes(header[:got]), m.image_id, name)

    def _check_parent_files(self) -> None:
        """Every table entry of a parent names a data file that parent lists (the parents' manifests
        were read only now: decode_manifest could check the image's own entries alone)."""
        t = self._table
        for i in range(len(t)):
            if (t.image[i], t.file_index[i]) not in self._slot:
                raise CorruptManifestError(f"{MANIFEST_NAME}: chunks[{i}] refers to data file #{t.file_index[i]} "
                                           f"of parent #{t.image[i]}, which has no such file")

    def _parents_trusted(self) -> list[bool]:
        """Per image of the chain: are its data files as trusted as the image's own?  Yes where every one is
        owned by the owner of the image's manifest and writable by no one else (then only that owner could
        have forged a record, as it could the image's own).  Otherwise a parent's record is verified against
        its BLAKE3 content hash before use: its xxh3 checksums do not stop a forger who chose its bytes."""
        if self.owner is None:
            return [True] + [False] * len(self.parents)
        try:
            out = [True]
            for k in range(1, len(self.parents) + 1):
                slots = [slot for (img, _fi), slot in self._slot.items() if img == k]
                sts = [os.fstat(self.fds[slot]) for slot in slots]
                out.append(all(st.st_uid == self.owner and not st.st_mode & 0o022 for st in sts))
            return out
        except OSError:
            return [True] + [False] * len(self.parents)

    @staticmethod
    async def _parents(manifest: pb.Manifest, parent_fds: Sequence[int]) -> list[pb.Manifest]:
        """Each parent the manifest lists, from the manifest file given for it, checked to be that very image."""
        chain = manifest.parents
        if len(parent_fds) > len(chain):
            raise InvalidRequestError(f"{len(parent_fds)} parent manifests given; the image's chain has "
                                      f"{len(chain)}")
        out: list[pb.Manifest] = []
        for k, ref in enumerate(chain, 1):
            what = parent_label(ref, k)
            if k > len(parent_fds):
                raise ParentMissingError(f"the image is incremental and needs {what}, which was not given")
            pm, digest = await read_manifest_hashed(parent_fds[k - 1])
            if pm.image_id != ref.image_id:
                raise ParentMismatchError(f"the image given as {what} is another image")
            if digest != ref.manifest_hash:
                raise ParentMismatchError(f"the image given as {what} was altered since the child was dumped "
                                          "(its manifest's hash differs)")
            if [p.image_id for p in pm.parents] != [p.image_id for p in chain[k:]]:
                raise ParentMismatchError(f"the image given as {what} has another chain of parents than the "
                                          "child recorded")
            out.append(pm)
        return out

    @staticmethod
    def _truncation(manifest: pb.Manifest, df: pb.DataFile, index: int, size: int) -> TruncatedDataError:
        msg = f"data file {df.name} is {size} bytes; the manifest says {df.length}"
        first = None  # the first chunk (by file position) that is cut short
        for bo in manifest.bos:
            for i in range(chunk_count(bo.size, manifest.chunk_size)):
                rec = chunk_record(manifest, bo, i)  # this image's own record of the chunk, if any
                if rec is None or rec[0] != index:
                    continue
                _, off, ln, _ = rec
                if off + ln > size and (first is None or off < first[0]):
                    first = (off, bo.id, i * manifest.chunk_size)
        if first:
            return TruncatedDataError(msg, bo_id=first[1], offset=first[2])
        return TruncatedDataError(msg)

    # --- where a chunk's record is ----------------------------------------

    def locate(self, entry: pb.BoEntry, i: int) -> Loc | None:
        """Chunk `i` of a BO of this image: where its record is (None: a hole, all zeros, no record)."""
        if not self._v2:
            rec = chunk_record(self.manifest, entry, i)  # a v1 hole is a record too
            assert rec is not None
            return Loc(*rec)
        ref = entry.chunk_refs[i]
        return self._table_loc(ref - 1) if ref else None

    def _table_loc(self, index: int) -> Loc:
        loc = self._locs.get(index)
        if loc is None:
            t = self._table
            image = t.image[index]
            base = self._table_loc(t.base[index] - 1) if t.base[index] else None
            loc = self._locs[index] = Loc(self._slot[(image, t.file_index[index])], t.offset[index],
                                          t.length[index], t.record_checksum[index], t.hash(index), base,
                                          not self._trusted[image])
        return loc

    @property
    def table(self) -> TableView:
        """The image's (v2) chunk table, as read once (no Loc made: `locate` keeps one per entry it was asked)."""
        return self._table

    def locate_entry(self, index: int) -> Loc:
        """Entry `index` of this image's (v2) chunk table."""
        return self._table_loc(index)

    def read_raw(self, loc: Loc, stored: StagingBuffer, out: StagingBuffer, at: int, raw_length: int, *,
                 bo_id: int, offset: int) -> DecodedChunk:
        """Read and decode one plain record (a delta's base) in the calling thread (never the event loop):
        the record lands at `at` in `stored`, a compressed one is decoded at the same place in `out`.
        Errors name `bo_id` and `offset`: the chunk that needed the record."""
        if loc.base is not None:
            raise CorruptChunkError(f"{self.names[loc.slot]} @ {loc.offset:#x}: a delta's base is itself a delta",
                                    bo_id=bo_id, offset=offset)
        return self.read_record(loc, stored, out, at, raw_length, bo_id=bo_id, offset=offset)[0]

    def read_record(self, loc: Loc, stored: StagingBuffer, out: StagingBuffer, at: int, raw_length: int, *,
                    bo_id: int, offset: int, base: memoryview | None = None) -> tuple[DecodedChunk, int]:
        """`read_raw` for any record (a delta given its base's bytes); also returns the record's head length."""
        where = f"{self.names[loc.slot]} @ {loc.offset:#x}"
        view = stored.view[at:at + loc.length]
        try:
            got = self.readv(loc.slot, [view], loc.offset)
        except OSError as e:
            raise image_os_error(e, f"cannot read data file {self.names[loc.slot]} at {loc.offset:#x}",
                                 bo_id=bo_id, offset=offset) from None
        finally:
            view.release()
        if got < loc.length:
            raise TruncatedDataError(f"data file {self.names[loc.slot]} ends inside a chunk record at "
                                     f"{loc.offset + got:#x}", bo_id=bo_id, offset=offset)
        return decode_record(bo_id, offset, raw_length, stored, at, loc.length, out, where=where,
                             record_checksum=loc.record_checksum, content_hash=loc.chash, base=base,
                             check_content=loc.foreign)

    def readv(self, file_index: int, views: Sequence[memoryview], offset: int) -> int:
        """Fill `views` from consecutive file bytes at `offset` of file slot `file_index`; returns bytes read
        (short at end of file)."""
        return preadv_all(self.fds[file_index], views, offset)

    def direct_fd(self, file_index: int) -> tuple[int, int] | None:
        """(the data file opened with O_DIRECT by the client, its size); None where there is none."""
        return self._direct[file_index]

    def close(self) -> None:
        """Forget the files (the attached fds are the caller's: it closes them)."""
        self.fds = [-1] * len(self.fds)
        self._direct = [None] * len(self._direct)
