"""A committed image opened for reading: the manifest checked, every data file opened and checked up front.

A format v2 image may refer to records of its parents (an incremental
image): the caller hands each parent's directory as an fd, nearest first;
each is checked to be the very image the child recorded (image id and the
BLAKE3 of its manifest) before anything is read, and its data files join
the reader's file list after the image's own (`fds`, `names`: the image's
own files keep their manifest index, so a v1 image reads as before).
"""
from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import (
    CorruptChunkError,
    CorruptManifestError,
    ForeignDataFileError,
    InvalidRequestError,
    ManifestMissingError,
    ParentMismatchError,
    ParentMissingError,
    TruncatedDataError,
)
from ..hostmem.staging import StagingBuffer
from ..pb import image_pb2 as pb
from .chunks import ParentEntries
from .codec import DecodedChunk, decode_chunk
from .fileio import image_os_error, open_regular, pread_into, preadv_all, read_manifest_hashed, reopen_direct
from .format import (
    DATA_HEADER,
    MANIFEST_NAME,
    TableView,
    check_data_header,
    chunk_count,
    chunk_record,
    record_head_length,
)


@dataclass(frozen=True)
class Loc:
    """Where one chunk's record is: a slot of the reader's file list, and how to check it."""

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
    """A committed image, its data files opened and checked up front."""

    def __init__(self, dir_fd: int, manifest: pb.Manifest, fds: list[int], *,
                 parents: Sequence[tuple[int, pb.Manifest]] = (), names: list[str] | None = None,
                 manifest_hash: bytes = b"") -> None:
        self.dir_fd = dir_fd
        self.manifest = manifest
        self.manifest_hash = manifest_hash  # BLAKE3 of manifest.vrdm (how a child would name this image)
        self.fds = fds  # the image's own data files (manifest order), then each parent's
        self.names = names if names is not None else [f.name for f in manifest.files]
        self.parents = list(parents)  # (directory fd, manifest), nearest first
        # (image, file index) -> slot in fds: image 0 is this one, k its parents[k - 1]
        self._slot: dict[tuple[int, int], int] = {}
        slot = 0
        for k, m in enumerate([manifest, *(pm for _, pm in self.parents)]):
            for fi in range(len(m.files)):
                self._slot[(k, fi)] = slot
                slot += 1
        self._dirs = [dir_fd, *(fd for fd, _ in self.parents)]
        self._slot_dir = [k for (k, _fi) in sorted(self._slot, key=self._slot.__getitem__)]
        self.bos = {bo.id: bo for bo in manifest.bos}
        self._locs: dict[int, Loc] = {}  # v2 chunk table index -> its Loc
        # set by Engine.open_parent for a dump's parent: its records by hash (image.chunks.parent_entries)
        self.chunk_entries: ParentEntries | None = None
        self._table = TableView(manifest.chunks)
        # per image of the chain: its records are trusted as the image's own (else verified by content hash)
        self._trusted: list[bool] = [True] + [False] * len(self.parents)
        self.has_deltas = any(self._table.base)
        self._lock = threading.Lock()
        self._direct: dict[int, tuple[int, int] | None] = {}  # slot -> (O_DIRECT fd, file size), or None

    @property
    def dir_fds(self) -> list[int]:
        """The directory fds of the image and of each parent (the caller's; never closed here)."""
        return list(self._dirs)

    @property
    def version(self) -> int:
        return int(self.manifest.format_version)

    @classmethod
    async def open(cls, dir_fd: int, parent_fds: Sequence[int] = ()) -> ImageReader:
        """Read and check the manifest, then open and check every data file (file I/O in a thread).

        The manifest's file names were checked by decode_manifest (plain names of this
        format only); each is opened O_NOFOLLOW|O_NONBLOCK and must be a regular file.
        `parent_fds`: the directories of the image's parents, nearest first (format v2);
        each must hold the image the child recorded, else PARENT_MISMATCH; one the
        chain needs and the caller did not give is PARENT_MISSING.  All before any
        chunk is read.
        """
        manifest, digest = await read_manifest_hashed(dir_fd)
        parents = await cls._parents(manifest, parent_fds)
        run = asyncio.get_running_loop().run_in_executor
        fds: list[int] = []
        names: list[str] = []
        try:
            for k, (fd, m) in enumerate([(dir_fd, manifest), *parents]):
                fds += await run(None, cls._open_files, fd, m)
                prefix = "" if k == 0 else f"{parent_label(manifest.parents[k - 1], k)}: "
                names += [prefix + f.name for f in m.files]
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        reader = cls(dir_fd, manifest, fds, parents=parents, names=names, manifest_hash=digest)
        if parents:
            try:
                reader._check_parent_files()
                reader._trusted = await run(None, reader._parents_trusted)
            except BaseException:
                reader.close()
                raise
        return reader

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
        owned by the owner of the image's directory and writable by no one else (then only that owner could
        have forged a record, as it could the image's own).  Otherwise a parent's record is verified against
        its BLAKE3 content hash before use: its xxh3 checksums do not stop a forger who chose its bytes."""
        try:
            owner = os.fstat(self.dir_fd).st_uid
            out = [True]
            for k in range(1, len(self.parents) + 1):
                slots = [slot for (img, _fi), slot in self._slot.items() if img == k]
                sts = [os.fstat(self.fds[slot]) for slot in slots]
                out.append(all(st.st_uid == owner and not st.st_mode & 0o022 for st in sts))
            return out
        except OSError:
            return [True] + [False] * len(self.parents)

    @staticmethod
    async def _parents(manifest: pb.Manifest, parent_fds: Sequence[int]) -> list[tuple[int, pb.Manifest]]:
        """Each parent the manifest lists, from the fd given for it, checked to be that very image."""
        chain = manifest.parents
        if len(parent_fds) > len(chain):
            raise InvalidRequestError(f"{len(parent_fds)} parent directories given; the image's chain has "
                                      f"{len(chain)}")
        out: list[tuple[int, pb.Manifest]] = []
        for k, ref in enumerate(chain, 1):
            what = parent_label(ref, k)
            if k > len(parent_fds):
                raise ParentMissingError(f"the image is incremental and needs {what}, which was not given")
            fd = parent_fds[k - 1]
            try:
                pm, digest = await read_manifest_hashed(fd)
            except ManifestMissingError:
                raise ParentMismatchError(f"the directory given as {what} holds no committed image") from None
            if pm.image_id != ref.image_id:
                raise ParentMismatchError(f"the directory given as {what} holds another image")
            if digest != ref.manifest_hash:
                raise ParentMismatchError(f"the image given as {what} was altered since the child was dumped "
                                          "(its manifest's hash differs)")
            if [p.image_id for p in pm.parents] != [p.image_id for p in chain[k:]]:
                raise ParentMismatchError(f"the image given as {what} has another chain of parents than the "
                                          "child recorded")
            out.append((fd, pm))
        return out

    @classmethod
    def _open_files(cls, dir_fd: int, manifest: pb.Manifest) -> list[int]:
        fds: list[int] = []
        try:
            for df in manifest.files:
                try:
                    fd = open_regular(df.name, dir_fd, ForeignDataFileError)
                except FileNotFoundError:
                    raise TruncatedDataError(f"data file {df.name} listed in the manifest is missing") from None
                fds.append(fd)
                header = memoryview(bytearray(DATA_HEADER.size))
                try:
                    got = pread_into(fd, header, 0)
                    size = os.fstat(fd).st_size
                except OSError as e:
                    raise image_os_error(e, f"cannot read data file {df.name}") from None
                check_data_header(bytes(header[:got]), manifest.image_id, df.name)
                if size < df.length:
                    raise cls._truncation(manifest, df, len(fds) - 1, size)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

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
        if self.manifest.format_version < 2:
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
                                          foreign=not self._trusted[image])
        return loc

    def file_slot(self, image: int, file_index: int) -> int:
        """The slot of data file `file_index` of image `image` (0: this one; k: parents[k - 1])."""
        return self._slot[(image, file_index)]

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
        head_len = record_head_length(stored.view[at:at + min(loc.length, 512)], bo_id=bo_id, offset=offset,
                                      where=where)
        if loc.length - head_len > raw_length:
            raise CorruptChunkError(f"{where}: record of {loc.length} bytes for a {raw_length}-byte chunk",
                                    bo_id=bo_id, offset=offset)
        return decode_chunk(bo_id, offset, raw_length, bytes(stored.view[at:at + head_len]), stored,
                            loc.length - head_len, out, where=where, buf_offset=at + head_len,
                            record_checksum=loc.record_checksum, content_hash=loc.chash, base=base,
                            check_content=loc.foreign), head_len

    def readv(self, file_index: int, views: Sequence[memoryview], offset: int) -> int:
        """Fill `views` from consecutive file bytes at `offset` of file slot `file_index`; returns bytes read
        (short at end of file)."""
        return preadv_all(self.fds[file_index], views, offset)

    def direct_fd(self, file_index: int) -> tuple[int, int] | None:
        """(the data file opened a second time with O_DIRECT, its size), by the same opening rules as
        every image file and checked to be the file already open (fileio.reopen_direct); None where
        the file system refuses O_DIRECT.  Opened on first use, in the calling thread (never the loop)."""
        with self._lock:
            if file_index not in self._direct:
                k = self._slot_dir[file_index]
                images = [self.manifest, *(m for _, m in self.parents)]
                base = min(s for (img, _fi), s in self._slot.items() if img == k)
                fd = reopen_direct(images[k].files[file_index - base].name, self._dirs[k], self.fds[file_index],
                                   os.O_RDONLY)
                if fd is not None:
                    try:
                        self._direct[file_index] = (fd, os.fstat(fd).st_size)
                    except OSError:
                        os.close(fd)
                        self._direct[file_index] = None
                else:
                    self._direct[file_index] = None
            return self._direct[file_index]

    def close(self) -> None:
        with self._lock:
            for d in self._direct.values():
                if d is not None:
                    os.close(d[0])
            self._direct.clear()
        for fd in self.fds:
            os.close(fd)
        self.fds = []
