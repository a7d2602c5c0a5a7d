"""A vramd image directory as an OCI artifact (pure: no I/O): the skeleton layer and the OCI image manifest,
encoded and decoded, every size, digest and media type checked on the way in (docs/image-format.md, "OCI
artifact").

The artifact is a lossless transport of the directory: its config blob is `manifest.vrdm` itself (so the
pulled image's BLAKE3, which children's parent references hold, stays valid), one skeleton layer holds every
data file byte but the chunk payloads (headers, record prefixes and headers, gaps), and each distinct stored
payload is one layer whose digest is the sha256 of those bytes alone: one chunk stored by replicas on several
nodes, or by an image and its child, is one blob in the registry.
"""
from __future__ import annotations

import datetime
import hashlib
import io
import json
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import zstandard

from ..errors import CorruptManifestError
from ..image.names import DATA_FILE_NAME
from ..pb import image_pb2 as pb

MEDIA_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_OCI_INDEX = "application/vnd.oci.image.index.v1+json"  # an image too big for one manifest (vramd.oci.index)
ARTIFACT_TYPE = "application/vnd.vramd.image.v1"
MEDIA_SKELETON = "application/vnd.vramd.skeleton.v1+zstd"
MEDIA_CHUNK = "application/vnd.vramd.chunk.v1"
CONFIG_MEDIA = {1: "application/vnd.vramd.manifest.v1", 2: "application/vnd.vramd.manifest.v2",
                3: "application/vnd.vramd.manifest.v3"}  # by the image's format version

# Annotations an operator filters on (the OCI keys where the spec has one).
ANN_PARENT = "org.vramd.image.parent"  # the parent's OCI manifest (or index) digest (also the `subject`)
ANN_IMAGE_ID = "org.vramd.image.id"
ANN_GPUS = "org.vramd.image.gpus"
ANN_BYTES = "org.vramd.image.bo-bytes"
ANN_CREATED = "org.opencontainers.image.created"
ANN_PID = "org.vramd.image.pid"
ANN_CRIU_ID = "org.vramd.image.criu-id"

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
ANNOTATION_KEY = re.compile(r"[a-z0-9][a-z0-9.\-]{0,127}")

# Bounds on what a registry may make us read or hold: no length in untrusted input is used before these.
MAX_OCI_MANIFEST = 64 << 20  # 1 TiB of BOs at 8 MiB chunks is ~131,000 layers, ~20 MB of JSON
MAX_CONFIG = 1 << 30  # manifest.MAX_MANIFEST_BYTES
MAX_SKELETON = 256 << 20  # compressed and decompressed
MAX_LAYERS = 1 << 22
MAX_PAYLOAD = 1 << 30
JSON_BYTES_PER_CONTAINER = 64
# A decoded segment is a Python object (~100 bytes) made from as few as 5 bytes of a skeleton that compresses
# without limit: their count is bounded apart from the bytes.  A 1 TiB image at 1 MiB chunks has ~3 M.
MAX_SEGMENTS = 1 << 22
MAX_LITERAL = 1 << 20  # one literal run: a data file header, a record head or a gap (O_DIRECT: < 1 page)

SKELETON_MAGIC = b"VRDSKEL1"
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_BLOB = struct.Struct("<32sQ")
LITERAL, ZEROS, PAYLOAD = 0, 1, 2


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int

    def to_json(self) -> dict[str, str | int]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of a data file: literal bytes, zeros, or the payload blob `blob` (an index into Skeleton.blobs)."""

    kind: int
    length: int
    data: bytes = b""
    blob: int = -1


@dataclass(frozen=True)
class FileSkeleton:
    name: str
    length: int
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class Skeleton:
    blobs: tuple[tuple[str, int], ...]  # (digest, size) of each payload layer, in the layers' order
    files: tuple[FileSkeleton, ...]


@dataclass(frozen=True)
class Artifact:
    """A checked OCI image manifest of a vramd image."""

    config: Descriptor
    skeleton: Descriptor
    chunks: tuple[Descriptor, ...]
    parent: str | None  # the parent's OCI manifest digest
    annotations: Mapping[str, str] = field(default_factory=dict)


def sha256_digest(data: bytes | bytearray | memoryview) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# --- the skeleton ------------------------------------------------------------

def encode_skeleton(sk: Skeleton) -> bytes:
    out = io.BytesIO()
    out.write(SKELETON_MAGIC + _U32.pack(len(sk.blobs)))
    for digest, size in sk.blobs:
        out.write(_BLOB.pack(bytes.fromhex(digest[7:]), size))
    out.write(_U32.pack(len(sk.files)))
    for f in sk.files:
        name = f.name.encode()
        out.write(struct.pack("<H", len(name)) + name + _U64.pack(f.length) + _U32.pack(len(f.segments)))
        for s in f.segments:
            if s.kind == LITERAL:
                out.write(bytes([LITERAL]) + _U32.pack(len(s.data)) + s.data)
            elif s.kind == ZEROS:
                out.write(bytes([ZEROS]) + _U64.pack(s.length))
            else:
                out.write(bytes([PAYLOAD]) + _U32.pack(s.blob))
    return zstandard.ZstdCompressor(level=3).compress(out.getvalue())


class _Cursor:
    def __init__(self, data: bytes, what: str) -> None:
        self.data, self.pos, self.what = data, 0, what

    def take(self, n: int) -> bytes:
        if n > len(self.data) - self.pos:
            raise CorruptManifestError(f"{self.what}: cut short")
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b

    def u(self, st: struct.Struct) -> int:
        value: int = st.unpack(self.take(st.size))[0]
        return value


def decode_skeleton(blob: bytes | bytearray, *, what: str = "skeleton", layers: int | None = None) -> Skeleton:
    """The skeleton layer's bytes (already checked against their digest), decoded with every count bounded before
    anything is made of it: payloads by `layers` (the artifact's payload layers, where the caller has them) and
    MAX_LAYERS, segments by MAX_SEGMENTS in all; no run is empty (an encoder never writes one)."""
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob)) as r:
            raw = r.read(MAX_SKELETON + 1)
    except zstandard.ZstdError:
        raise CorruptManifestError(f"{what}: not a zstd frame") from None
    if len(raw) > MAX_SKELETON:
        raise CorruptManifestError(f"{what}: decompresses to more than {MAX_SKELETON} bytes")
    c = _Cursor(raw, what)
    if c.take(len(SKELETON_MAGIC)) != SKELETON_MAGIC:
        raise CorruptManifestError(f"{what}: not a vramd skeleton (bad magic)")
    nblobs = c.u(_U32)
    if nblobs * _BLOB.size > len(raw) or nblobs >= MAX_LAYERS:
        raise CorruptManifestError(f"{what}: {nblobs} payloads cannot fit")
    if layers is not None and nblobs != layers:
        raise CorruptManifestError(f"{what}: {nblobs} payloads, but the artifact has {layers} payload layers")
    blobs = []
    for _ in range(nblobs):
        h, size = _BLOB.unpack(c.take(_BLOB.size))
        blobs.append(("sha256:" + h.hex(), size))
    files = []
    nsegs = 0
    for i in range(c.u(_U32)):
        name_len = c.u(struct.Struct("<H"))
        try:
            name = c.take(name_len).decode("ascii")
        except UnicodeDecodeError:
            name = ""
        if DATA_FILE_NAME.fullmatch(name) is None:
            raise CorruptManifestError(f"{what}: files[{i}] is not a data file name")
        length, nseg = c.u(_U64), c.u(_U32)
        nsegs += nseg
        if nseg > len(raw) or nsegs > MAX_SEGMENTS:
            raise CorruptManifestError(f"{what}: {name}: {nseg} segments cannot fit (at most {MAX_SEGMENTS} in all)")
        segs, total = [], 0
        for _ in range(nseg):
            kind = c.take(1)[0]
            if kind == LITERAL:
                n = c.u(_U32)
                if n > MAX_LITERAL:
                    raise CorruptManifestError(f"{what}: {name}: a literal run of {n} bytes")
                segs.append(Segment(LITERAL, n, data=c.take(n)))
            elif kind == ZEROS:
                segs.append(Segment(ZEROS, c.u(_U64)))
            elif kind == PAYLOAD:
                k = c.u(_U32)
                if k >= nblobs:
                    raise CorruptManifestError(f"{what}: {name}: payload #{k} is not in the table")
                segs.append(Segment(PAYLOAD, blobs[k][1], blob=k))
            else:
                raise CorruptManifestError(f"{what}: {name}: unknown segment kind {kind}")
            if segs[-1].length == 0:
                raise CorruptManifestError(f"{what}: {name}: an empty run")
            total += segs[-1].length
            if total > length:
                raise CorruptManifestError(f"{what}: {name}: segments run past the file's {length} bytes")
        if total != length:
            raise CorruptManifestError(f"{what}: {name}: segments cover {total} of its {length} bytes")
        files.append(FileSkeleton(name, length, tuple(segs)))
    if c.pos != len(raw):
        raise CorruptManifestError(f"{what}: trailing bytes")
    return Skeleton(tuple(blobs), tuple(files))


def check_skeleton(sk: Skeleton, art: Artifact, manifest: pb.Manifest) -> None:
    """The skeleton agrees with the artifact's layers and the image's manifest: the same data files (names,
    lengths, order), payloads exactly the layers after the skeleton, each used, none longer than a chunk."""
    if [(d.digest, d.size) for d in art.chunks] != list(sk.blobs):
        raise CorruptManifestError("skeleton: its payload table is not the artifact's layers")
    if [(f.name, f.length) for f in sk.files] != [(f.name, f.length) for f in manifest.files]:
        raise CorruptManifestError("skeleton: its data files are not the ones manifest.vrdm lists")
    used = set()
    for f in sk.files:
        for s in f.segments:
            if s.kind == PAYLOAD:
                used.add(s.blob)
    if len(used) != len(sk.blobs):
        raise CorruptManifestError("skeleton: a payload layer no data file uses")
    for digest, size in sk.blobs:
        if size > manifest.chunk_size + 4096:  # a stored payload is never larger than its chunk (plus a frame)
            raise CorruptManifestError(f"layer {digest}: {size} bytes is more than a chunk's payload")


# --- the OCI image manifest ----------------------------------------------------

def annotations_for(manifest: pb.Manifest, extra: Mapping[str, str]) -> dict[str, str]:
    created = datetime.datetime.fromtimestamp(manifest.created_unix_ns / 1e9, datetime.UTC)
    ann = {
        ANN_IMAGE_ID: manifest.image_id.hex(),
        ANN_CREATED: created.strftime("%Y-%m-%dT%H:%M:%SZ"),
        ANN_GPUS: ",".join(f"{g:x}" for g in sorted({f.gpu_id for f in manifest.files})),
        ANN_BYTES: str(manifest.totals.bo_bytes),
    }
    ann.update(extra)
    return ann


def encode_oci_manifest(config: Descriptor, skeleton: Descriptor, chunks: Sequence[Descriptor],
                        parent: Descriptor | None, annotations: Mapping[str, str]) -> bytes:
    doc: dict[str, object] = {
        "schemaVersion": 2,
        "mediaType": MEDIA_OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": config.to_json(),
        "layers": [skeleton.to_json()] + [c.to_json() for c in chunks],
    }
    ann = dict(annotations)
    if parent is not None:
        doc["subject"] = parent.to_json()
        ann[ANN_PARENT] = parent.digest
    doc["annotations"] = ann
    return json.dumps(doc, separators=(",", ":")).encode()


def descriptor(d: object, what: str, media: Sequence[str], max_size: int) -> Descriptor:
    if not isinstance(d, dict):
        raise CorruptManifestError(f"{what}: not a descriptor")
    mt, digest, size = d.get("mediaType"), d.get("digest"), d.get("size")
    if mt not in media:
        raise CorruptManifestError(f"{what}: media type is not one of {', '.join(media)}")
    if not isinstance(digest, str) or DIGEST.fullmatch(digest) is None:
        raise CorruptManifestError(f"{what}: digest is not sha256:<64 hex>")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= max_size:
        raise CorruptManifestError(f"{what}: size is not a whole number of at most {max_size}")
    assert isinstance(mt, str)
    return Descriptor(mt, digest, size)


def parse_json(body: bytes, what: str, limit: int) -> dict[str, object]:
    """An OCI manifest or index from a registry (untrusted), parsed once it is known to be bounded: at most `limit`
    bytes, and (JSON's objects and arrays cost ~60 bytes each once parsed, for 2 bytes of text: "{}") at most one
    object or array per JSON_BYTES_PER_CONTAINER bytes (a descriptor takes ~150) before json.loads builds any."""
    if len(body) > limit:
        raise CorruptManifestError(f"{what}: OCI manifest larger than {limit} bytes")
    if body.count(b"{") + body.count(b"[") > len(body) // JSON_BYTES_PER_CONTAINER + 16:
        raise CorruptManifestError(f"{what}: OCI manifest has more objects and arrays than a manifest needs")
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise CorruptManifestError(f"{what}: OCI manifest is not JSON") from None
    if not isinstance(doc, dict) or doc.get("schemaVersion") != 2:
        raise CorruptManifestError(f"{what}: not an OCI image manifest (schemaVersion 2, {MEDIA_OCI_MANIFEST})")
    return doc


def annotations_and_parent(doc: Mapping[str, object], what: str) -> tuple[dict[str, str], str | None]:
    """A manifest's or an index's annotations, and the parent they name, which `subject` (a manifest or an
    index: a parent too big for one manifest is an index) must agree with."""
    ann = doc.get("annotations", {})
    if not isinstance(ann, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ann.items()):
        raise CorruptManifestError(f"{what}: annotations must map strings to strings")
    parent = ann.get(ANN_PARENT)
    if parent is not None and DIGEST.fullmatch(parent) is None:
        raise CorruptManifestError(f"{what}: annotation {ANN_PARENT} is not a sha256 digest")
    subject = doc.get("subject")
    if subject is not None:
        sub = descriptor(subject, f"{what}: subject", [MEDIA_OCI_MANIFEST, MEDIA_OCI_INDEX], MAX_OCI_MANIFEST)
        if sub.digest != parent:
            raise CorruptManifestError(f"{what}: subject and annotation {ANN_PARENT} name different parents")
    return dict(ann), parent


def decode_oci_manifest(body: bytes, what: str) -> Artifact:
    """An OCI image manifest from a registry (untrusted), checked: ours, well-formed, bounded."""
    return manifest_from_doc(parse_json(body, what, MAX_OCI_MANIFEST), what)


def manifest_from_doc(doc: Mapping[str, object], what: str) -> Artifact:
    if doc.get("mediaType") != MEDIA_OCI_MANIFEST:
        raise CorruptManifestError(f"{what}: not an OCI image manifest (schemaVersion 2, {MEDIA_OCI_MANIFEST})")
    if doc.get("artifactType") != ARTIFACT_TYPE:
        raise CorruptManifestError(f"{what}: not a vramd image (artifactType is not {ARTIFACT_TYPE})")
    config = descriptor(doc.get("config"), f"{what}: config", list(CONFIG_MEDIA.values()), MAX_CONFIG)
    layers = doc.get("layers")
    if not isinstance(layers, list) or not 1 <= len(layers) <= MAX_LAYERS:
        raise CorruptManifestError(f"{what}: layers must list the skeleton and at most {MAX_LAYERS - 1} payloads")
    skeleton = descriptor(layers[0], f"{what}: layers[0]", [MEDIA_SKELETON], MAX_SKELETON)
    chunks = chunk_layers(layers[1:], what, 1)
    if len({c.digest for c in chunks}) != len(chunks):
        raise CorruptManifestError(f"{what}: a payload layer listed twice")
    ann, parent = annotations_and_parent(doc, what)
    return Artifact(config, skeleton, chunks, parent, ann)


def chunk_layers(layers: Sequence[object], what: str, first: int) -> tuple[Descriptor, ...]:
    """Payload layers' descriptors (`layers[first]` is the first of them)."""
    return tuple(descriptor(d, f"{what}: layers[{i}]", [MEDIA_CHUNK], MAX_PAYLOAD)
                 for i, d in enumerate(layers, first))


def check_config(art: Artifact, manifest: pb.Manifest, what: str) -> None:
    """The decoded manifest.vrdm agrees with its artifact: media type, and a parent exactly where it has one."""
    if CONFIG_MEDIA.get(manifest.format_version) != art.config.media_type:
        raise CorruptManifestError(f"{what}: config media type does not match manifest.vrdm's format version")
    if bool(manifest.parents) != (art.parent is not None):
        raise CorruptManifestError(f"{what}: manifest.vrdm and the OCI manifest disagree on whether it has a "
                                   "parent")
