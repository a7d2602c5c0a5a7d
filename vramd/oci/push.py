"""Push a vramd image directory (and its parents) to a registry as OCI artifacts (vramd.oci.layout).

Only what the registry lacks goes up: every blob is HEADed first (so a push that was interrupted is resumed by
pushing again), mounted from another repository where the caller names one, else uploaded; the OCI manifest
goes last, so a reference never names an artifact with a blob missing.  Blobs move `concurrency` at a time,
each read from its data file when its turn comes: memory holds at most `concurrency` payloads.
"""
from __future__ import annotations

import bisect
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import (
    CorruptManifestError,
    ImageError,
    ImageIoError,
    ManifestMissingError,
    ParentMissingError,
    RegistryError,
    TruncatedDataError,
    from_os_error,
)
from ..image.chain import parent_chain
from ..image.fileio import image_os_error, pread_exact, read_manifest_blob
from ..image.format import HEAD_PEEK, record_head_length
from ..image.manifest import bo_chunk_count, chunk_record, decode_manifest
from ..image.names import MANIFEST_NAME
from ..pb import image_pb2 as pb
from .index import DEFAULT_MAX_MANIFEST, EMPTY, EMPTY_CONFIG, check_budget, index_for, split
from .layout import (
    CONFIG_MEDIA,
    LITERAL,
    MAX_LITERAL,
    MAX_SKELETON,
    MEDIA_CHUNK,
    MEDIA_OCI_INDEX,
    MEDIA_OCI_MANIFEST,
    MEDIA_SKELETON,
    PAYLOAD,
    ZEROS,
    Descriptor,
    FileSkeleton,
    Segment,
    Skeleton,
    annotations_for,
    decode_skeleton,
    encode_oci_manifest,
    encode_skeleton,
    sha256_digest,
)
from .registry import Registry

MAX_CHAIN = 16
LARGE_MANIFEST = 1 << 20  # a manifest refused past this size gets the hint about the registry's cap
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True)
class Source:
    """Where a payload lies in the local image: (data file, offset, length), and the chunk whose record holds
    it (BO id, offset in the BO; None where no BO's chunk does), which a failed read names."""

    name: str
    offset: int
    size: int
    bo_id: int | None = None
    bo_offset: int | None = None


@dataclass
class LocalImage:
    path: str
    manifest_bytes: bytes
    manifest: pb.Manifest
    skeleton: Skeleton
    sources: dict[str, Source]  # payload digest -> one place it is stored


# A local image's files are read by the client's code for them (vramd.image.fileio: every read error typed,
# naming the file and offset); opening them by name is vramctl's, with its rights, never through a link.

def open_dir(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise from_os_error(e, path, ImageError) from None


def open_file(dfd: int, name: str, where: str) -> int:
    """`name` in the directory `dfd` (called `where`), a regular file opened for reading, never through a link
    and never blocking (a FIFO put in its place opens at once and is refused)."""
    try:
        fd = os.open(name, OPEN_FLAGS, dir_fd=dfd)
    except FileNotFoundError:
        if name == MANIFEST_NAME:
            raise ManifestMissingError(f"{where}: no {MANIFEST_NAME}: the directory holds no image") from None
        raise ImageError(f"{where}/{name}: missing") from None
    except OSError as e:
        raise from_os_error(e, f"{where}/{name}", ImageError) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ImageError(f"{where}/{name}: not a regular file")
    except OSError as e:
        os.close(fd)
        raise image_os_error(e, f"{where}/{name}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_manifest_bytes(dfd: int, where: str) -> bytes:
    fd = open_file(dfd, MANIFEST_NAME, where)
    try:
        return read_manifest_blob(fd, f"{where}/{MANIFEST_NAME}")
    finally:
        os.close(fd)


Record = tuple[int, int, int | None, int | None]  # offset, length, BO id, offset in the BO


def _records(m: pb.Manifest) -> list[list[Record]]:
    """Per data file, each record this image stores, by offset, with the BO chunk it holds (the first BO's
    that refers to it: a dedup'd record serves several)."""
    owner: dict[tuple[int, int], tuple[int, int]] = {}
    for bo in m.bos:
        for i in range(bo_chunk_count(m, bo)):
            rec = chunk_record(m, bo, i)
            if rec is not None:
                owner.setdefault((rec[0], rec[1]), (bo.id, i * m.chunk_size))
    per: list[set[tuple[int, int]]] = [set() for _ in m.files]
    if m.format_version >= 2:
        t = m.chunks
        for img, fi, off, ln in zip(t.image, t.file_index, t.offset, t.length, strict=True):
            if img == 0:
                per[fi].add((off, ln))
    else:
        for bo in m.bos:
            for off, ln in zip(bo.record_offsets, bo.record_lengths, strict=True):
                per[bo.file_index].add((off, ln))
    out: list[list[Record]] = []
    for fi, recs in enumerate(per):
        out.append([(off, ln, *owner.get((fi, off), (None, None))) for off, ln in sorted(recs)])
    return out


def _gap(fd: int, start: int, end: int, what: str) -> list[Segment]:
    segs = []
    while start < end:
        n = min(end - start, MAX_LITERAL)
        data = pread_exact(fd, n, start, what)
        segs.append(Segment(ZEROS, n) if data.count(0) == n else Segment(LITERAL, n, data=data))
        start += n
    return segs


Warn = Callable[[str], None]


def scan_image(path: str, cache: str | None = None, warn: Warn | None = None) -> LocalImage:
    """The image in `path`: its manifest bytes, its skeleton and where each distinct payload lies (every payload
    is read and hashed once here; a push reads again only those the registry lacks).  `cache`: a directory of
    the caller's where the skeleton of an image scanned before is kept (by its manifest's sha256), so pushing
    it again reads no payload; `warn` is told, in one line, why one could not be kept there.  A failed read
    is a typed error naming the file, the offset and the BO (vramd.image.fileio.pread_exact)."""
    dfd = open_dir(path)
    try:
        mbytes = read_manifest_bytes(dfd, path)
        m = decode_manifest(mbytes, f"{path}/{MANIFEST_NAME}")
        records = _records(m)
        cached = _cached_skeleton(cache, mbytes, m)
        if cached is not None:
            return LocalImage(path, mbytes, m, cached, _sources(cached, records))
        blobs: dict[str, int] = {}
        sources: dict[str, Source] = {}
        files = []
        for df, recs in zip(m.files, records, strict=True):
            what = f"{path}/{df.name}"
            fd = open_file(dfd, df.name, path)
            try:
                try:
                    size = os.fstat(fd).st_size
                except OSError as e:
                    raise image_os_error(e, what) from None
                if size < df.length:
                    raise TruncatedDataError(f"{what}: {size} bytes, shorter than its committed {df.length}")
                segs: list[Segment] = []
                pos = 0
                for off, ln, bo, bo_off in recs:
                    if off < pos or off + ln > df.length:
                        raise CorruptManifestError(f"{what}: records overlap or run past the file")
                    segs += _gap(fd, pos, off, what)
                    at = {"bo_id": bo, "bo_offset": bo_off}
                    head = record_head_length(pread_exact(fd, min(ln, HEAD_PEEK), off, what, **at),
                                              bo_id=bo or 0, offset=bo_off or 0, where=what)
                    if head > ln:
                        raise CorruptManifestError(f"{what}: record at {off:#x} shorter than its header", bo_id=bo,
                                                   offset=bo_off)
                    segs.append(Segment(LITERAL, head, data=pread_exact(fd, head, off, what, **at)))
                    size = ln - head
                    if size:
                        digest = sha256_digest(pread_exact(fd, size, off + head, what, **at))
                        if digest not in blobs:
                            blobs[digest] = len(blobs)
                            sources[digest] = Source(df.name, off + head, size, bo, bo_off)
                        segs.append(Segment(PAYLOAD, size, blob=blobs[digest]))
                    pos = off + ln
                segs += _gap(fd, pos, df.length, what)
            finally:
                os.close(fd)
            files.append(FileSkeleton(df.name, df.length, tuple(segs)))
        table = tuple((d, sources[d].size) for d in blobs)
        sk = Skeleton(table, tuple(files))
        _keep_skeleton(cache, mbytes, sk, warn)
        return LocalImage(path, mbytes, m, sk, sources)
    finally:
        os.close(dfd)


def _sources(sk: Skeleton, records: list[list[Record]]) -> dict[str, Source]:
    """Where each payload of a kept skeleton lies, with the BO chunk of the record around it."""
    out: dict[str, Source] = {}
    for f, recs in zip(sk.files, records, strict=True):
        starts = [r[0] for r in recs]
        pos = 0
        for s in f.segments:
            if s.kind == PAYLOAD:
                digest, size = sk.blobs[s.blob]
                k = bisect.bisect_right(starts, pos) - 1
                bo, bo_off = recs[k][2:] if k >= 0 and pos < recs[k][0] + recs[k][1] else (None, None)
                out.setdefault(digest, Source(f.name, pos, size, bo, bo_off))
            pos += s.length
    return out


def _cache_path(cache: str, mbytes: bytes) -> str:
    return os.path.join(cache, "push", sha256_digest(mbytes).removeprefix("sha256:") + ".skeleton")


def _cached_skeleton(cache: str | None, mbytes: bytes, m: pb.Manifest) -> Skeleton | None:
    if cache is None:
        return None
    try:
        with open(_cache_path(cache, mbytes), "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as fh:
            sk = decode_skeleton(fh.read(MAX_SKELETON + 1))
    except (OSError, CorruptManifestError):
        return None  # none kept, or damaged: scanned again
    if [(f.name, f.length) for f in sk.files] != [(f.name, f.length) for f in m.files]:
        return None
    return sk


def _keep_skeleton(cache: str | None, mbytes: bytes, sk: Skeleton, warn: Warn | None) -> None:
    if cache is None:
        return
    path = _cache_path(cache, mbytes)
    tmp = f"{path}.{os.getpid()}.tmp"
    made = False
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        made = True
        try:
            os.write(fd, encode_skeleton(sk))
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except OSError as e:  # a cache: the push goes on without it, and says so
        if made:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        if warn is not None:
            warn(f"the cache directory {cache}: cannot keep the image's skeleton there ({e.strerror or e}); the "
                 "push goes on without it (a next push of this image reads its payloads again)")


def parent_dirs(path: str, manifest: pb.Manifest, first: str | None) -> list[str]:
    """The directories of the image's parents, nearest first (vramd.image.chain: vramctl restore's rule),
    each checked to hold a committed image, the one the chain names."""
    def read(nxt: str, k: int) -> pb.Manifest:
        try:
            dfd = open_dir(nxt)
            try:
                return decode_manifest(read_manifest_bytes(dfd, nxt), f"{nxt}/{MANIFEST_NAME}")
            finally:
                os.close(dfd)
        except ImageIoError:
            raise  # the parent is there, its storage failed: that, not a missing parent
        except ImageError as e:
            raise ParentMissingError(f"{e.message}; {path} is incremental: name its parent #{k} with --parent DIR "
                                     "(a push sends the parents first)") from None
    return parent_chain(path, manifest, first, read)


class Pusher:
    def __init__(self, reg: Registry, repo: str, *, concurrency: int = 4, mount_from: Sequence[str] = (),
                 max_manifest_bytes: int = DEFAULT_MAX_MANIFEST) -> None:
        """`max_manifest_bytes`: an image whose OCI manifest would be longer goes up as an OCI image index of part
        manifests none longer (vramd.oci.index: a registry refuses a manifest body past its cap)."""
        self.reg, self.repo, self.concurrency, self.mount_from = reg, repo, max(1, concurrency), list(mount_from)
        check_budget(max_manifest_bytes)
        self.max_manifest_bytes = max_manifest_bytes

    def _ensure(self, digest: str, size: int, read: Source | bytes, where: str) -> None:
        if self.reg.blob_size(self.repo, digest) == size:
            self.reg.stats.add(blobs_present=1)
            return
        for other in self.mount_from:
            if self.reg.mount_blob(self.repo, digest, other):
                return
        if isinstance(read, bytes):
            data = read
        else:
            dfd = open_dir(where)
            try:
                fd = open_file(dfd, read.name, where)
            finally:
                os.close(dfd)
            try:
                data = pread_exact(fd, read.size, read.offset, f"{where}/{read.name}", bo_id=read.bo_id,
                                   bo_offset=read.bo_offset)
            finally:
                os.close(fd)
        self.reg.upload_blob(self.repo, digest, data)

    def _put_manifest(self, ref: str, body: bytes, media_type: str = MEDIA_OCI_MANIFEST) -> str:
        """A manifest or index PUT; a large one refused as invalid or too large (400, 413) is most likely over the
        registry's cap (distribution's is 4 MiB): the error says so, and what makes it smaller."""
        try:
            return self.reg.put_manifest(self.repo, ref, body, media_type)
        except RegistryError as e:
            if e.status not in (400, 413) or len(body) <= LARGE_MANIFEST:
                raise
            raise RegistryError(f"{e.message}: the manifest is {len(body)} bytes, likely over the registry's cap "
                                "(4 MiB for most): push with a smaller --max-manifest-bytes (default "
                                f"{DEFAULT_MAX_MANIFEST}), which sends it as an OCI image index of smaller "
                                "parts") from None

    def push_image(self, img: LocalImage, tag: str | None, parent: Descriptor | None,
                   annotations: Mapping[str, str]) -> Descriptor:
        """The image's blobs the registry lacks, then its OCI manifest (by digest, and by `tag` if given); an image
        whose manifest is over the budget: its part manifests by digest, then their OCI index."""
        config = Descriptor(CONFIG_MEDIA[img.manifest.format_version], sha256_digest(img.manifest_bytes),
                            len(img.manifest_bytes))
        skel_bytes = encode_skeleton(img.skeleton)
        skeleton = Descriptor(MEDIA_SKELETON, sha256_digest(skel_bytes), len(skel_bytes))
        chunks = [Descriptor(MEDIA_CHUNK, d, n) for d, n in img.skeleton.blobs]
        ann = annotations_for(img.manifest, annotations)
        body = encode_oci_manifest(config, skeleton, chunks, parent, ann)
        parts = split(config, skeleton, chunks, self.max_manifest_bytes) if len(body) > self.max_manifest_bytes \
            else []
        if parts:
            try:
                body = index_for(parts, parent, ann, self.max_manifest_bytes)
            except ImageError as e:
                raise ImageError(f"{img.path}: {e.message}") from None
        jobs: list[tuple[str, int, Source | bytes]] = [(config.digest, config.size, img.manifest_bytes),
                                                        (skeleton.digest, skeleton.size, skel_bytes)]
        if len(parts) > 1:
            jobs.append((EMPTY.digest, EMPTY.size, EMPTY_CONFIG))
        jobs += [(d, n, img.sources[d]) for d, n in img.skeleton.blobs]
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="vramd-push") as ex:
            for fut in [ex.submit(self._ensure, d, n, src, img.path) for d, n, src in jobs]:
                fut.result()
        if not parts:
            digest = self._put_manifest(tag or sha256_digest(body), body)
            return Descriptor(MEDIA_OCI_MANIFEST, digest, len(body))
        for p in parts:  # every part before the index that names them: the index is the commit
            if not self.reg.has_manifest(self.repo, sha256_digest(p)):  # a re-push (or a resumed one): not again
                self._put_manifest(sha256_digest(p), p)
        digest = self._put_manifest(tag or sha256_digest(body), body, MEDIA_OCI_INDEX)
        return Descriptor(MEDIA_OCI_INDEX, digest, len(body))


def push_chain(pusher: Pusher, path: str, tag: str, *, first_parent: str | None,
               annotations: Mapping[str, str], cache: str | None = None,
               warn: Warn | None = None) -> list[tuple[str, Descriptor]]:
    """The image in `path` and its parents, the farthest parent first (each child's manifest names its
    parent's digest); only the image itself gets `tag`.  Returns (directory, manifest descriptor) of each.
    `warn`: told in one line where the skeleton cache could not be written (the push goes on)."""
    img = scan_image(path, cache, warn)
    chain = parent_dirs(path, img.manifest, first_parent)
    if len(chain) > MAX_CHAIN:
        raise ImageError(f"{path}: a chain of {len(chain)} parents is longer than a push takes ({MAX_CHAIN})")
    pushed: list[tuple[str, Descriptor]] = []
    parent: Descriptor | None = None
    for d in reversed(chain):
        parent = pusher.push_image(scan_image(d, cache, warn), None, parent, {})
        pushed.append((d, parent))
    pushed.append((path, pusher.push_image(img, tag, parent, annotations)))
    return pushed
