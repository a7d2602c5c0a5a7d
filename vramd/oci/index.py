"""An image whose OCI manifest would be over a registry's cap on a manifest body, as an OCI image index of part
manifests (pure: no I/O; docs/image-format.md, "The artifact").

A registry refuses a manifest body past a cap (the distribution registry's is 4 MiB): at ~145 bytes of JSON per
payload layer, that is a process of ~240 GB at 8 MiB chunks.  Past a budget below the cap, push emits the same
layers in N part manifests, each a valid OCI image manifest of artifactType ARTIFACT_PART: the first has the
image's config (manifest.vrdm) and the skeleton as layers[0], every later one the OCI empty config; each lists a
contiguous run of the payload layers, so the skeleton's payload table is exactly the parts' layers one after the
other.  One index over them (its artifactType the image's, its subject the parent, the operator's annotations,
and the type and parent as annotations too: see encode_index) is what the tag names; it goes up last, after
every part, as one manifest goes after every blob.

On the way in the index and each part are checked as one manifest is (vramd.oci.layout), and the parts as a whole:
at most MAX_PARTS of them, their declared sizes at most MAX_PARTS_BYTES in all before any is fetched, each fetched
by its digest and its size checked, no part listed twice, no payload layer in two parts, and no index in an index.
The result is the Artifact a single manifest makes: nothing after the manifest reading knows the difference.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import CorruptManifestError, ImageError
from .layout import (
    ANN_PARENT,
    ARTIFACT_TYPE,
    CONFIG_MEDIA,
    MAX_CONFIG,
    MAX_LAYERS,
    MAX_OCI_MANIFEST,
    MAX_SKELETON,
    MEDIA_OCI_INDEX,
    MEDIA_OCI_MANIFEST,
    MEDIA_SKELETON,
    Artifact,
    Descriptor,
    annotations_and_parent,
    chunk_layers,
    descriptor,
    manifest_from_doc,
    parse_json,
    sha256_digest,
)

ARTIFACT_PART = "application/vnd.vramd.image.part.v1"
MEDIA_EMPTY = "application/vnd.oci.empty.v1+json"
EMPTY_CONFIG = b"{}"  # the OCI spec's empty config: a later part has no config of its own
EMPTY = Descriptor(MEDIA_EMPTY, sha256_digest(EMPTY_CONFIG), len(EMPTY_CONFIG))

# Push: a manifest body past this goes up as an index.  The distribution registry's cap is 4 MiB (4,194,304
# bytes, docs/distributed.md "Manifest weight"); half a MiB is left to registries with a lower one.
DEFAULT_MAX_MANIFEST = 3_670_016
MIN_MAX_MANIFEST = 1024  # below this not even a part of one payload layer fits
MAX_MAX_MANIFEST = MAX_OCI_MANIFEST  # past this a pull would refuse the one manifest a push wrote

# Pull: bounds on what an index may make us fetch and hold.
MAX_INDEX = 1 << 20  # a part's entry takes ~230 bytes of JSON
MAX_PARTS = 1024  # 3.5 MiB parts: ~25 M layers, past MAX_LAYERS
MAX_PARTS_BYTES = 512 << 20  # all parts' JSON; the layers' count is MAX_LAYERS as for one manifest

_SEP = (",", ":")
ANN_TYPE = "org.vramd.image.type"  # an index's: ARTIFACT_TYPE, for a client of OCI 1.0 (no artifactType there)


@dataclass(frozen=True)
class Index:
    """A checked OCI image index of a vramd image: its parts (not fetched yet), its parent, its annotations."""

    parts: tuple[Descriptor, ...]
    parent: str | None
    annotations: Mapping[str, str]


@dataclass(frozen=True)
class Part:
    config: Descriptor | None  # the first part's: manifest.vrdm
    skeleton: Descriptor | None  # the first part's
    chunks: tuple[Descriptor, ...]


# --- push ---------------------------------------------------------------------------------------------------------

def encode_part(config: Descriptor, layers: Sequence[Descriptor]) -> bytes:
    doc = {"schemaVersion": 2, "mediaType": MEDIA_OCI_MANIFEST, "artifactType": ARTIFACT_PART,
           "config": config.to_json(), "layers": [d.to_json() for d in layers]}
    return json.dumps(doc, separators=_SEP).encode()


def split(config: Descriptor, skeleton: Descriptor, chunks: Sequence[Descriptor], budget: int) -> list[bytes]:
    """The part manifests of an image whose one manifest is over `budget` bytes: each at most `budget`, as few as
    fill them in order (the first: config, skeleton, then payloads; each later one: the empty config and at least
    one payload).  A budget too small for that is an ImageError."""
    check_budget(budget)
    parts: list[bytes] = []
    cfg, run = config, [skeleton]
    size = len(encode_part(cfg, run))
    for c in chunks:
        add = len(json.dumps(c.to_json(), separators=_SEP)) + 1  # the descriptor and its comma
        if size + add > budget:
            parts.append(encode_part(cfg, run))
            cfg, run = EMPTY, []
            size = len(encode_part(cfg, run)) - 1  # its first descriptor has no comma
            if size + add > budget:
                raise ImageError(f"a manifest budget of {budget} bytes does not hold one payload layer")
        run.append(c)
        size += add
    parts.append(encode_part(cfg, run))
    for body in parts:
        if len(body) > budget:
            raise ImageError(f"a manifest budget of {budget} bytes does not hold the config and the skeleton")
    return parts


def check_budget(budget: int) -> None:
    """A budget a push can keep and a pull reads what it makes: an ImageError if not."""
    if budget < MIN_MAX_MANIFEST:
        raise ImageError(f"a manifest budget of {budget} bytes is below {MIN_MAX_MANIFEST}")
    if budget > MAX_MAX_MANIFEST:
        raise ImageError(f"a manifest budget of {budget} bytes is above the {MAX_MAX_MANIFEST} a pull reads")


def index_for(parts: Sequence[bytes], parent: Descriptor | None, annotations: Mapping[str, str],
              budget: int) -> bytes:
    """The index over `parts` (split's), checked before anything is sent against the budget and against what a
    pull takes (MAX_PARTS parts, MAX_INDEX bytes): a push never tags an image no pull reads."""
    if len(parts) > MAX_PARTS:
        raise ImageError(f"{len(parts)} part manifests at a budget of {budget} bytes: a pull takes at most "
                         f"{MAX_PARTS}; raise --max-manifest-bytes")
    body = encode_index([Descriptor(MEDIA_OCI_MANIFEST, sha256_digest(p), len(p)) for p in parts], parent,
                        annotations)
    if len(body) > min(budget, MAX_INDEX):
        raise ImageError(f"the OCI index of its {len(parts)} parts is {len(body)} bytes, over the manifest budget "
                         f"of {budget} or the {MAX_INDEX} a pull takes (are its annotations that long?)")
    return body


def encode_index(parts: Sequence[Descriptor], parent: Descriptor | None, annotations: Mapping[str, str]) -> bytes:
    """The index over the parts: `artifactType` ARTIFACT_TYPE and the parent as `subject` (OCI 1.1: a registry's
    referrers API lists an indexed child under its parent, as it does a one-manifest child), and both as the
    annotations ANN_TYPE and ANN_PARENT for a client of OCI 1.0.  Written as a Go client of image-spec 1.1 writes
    it (fields in its order, annotations by key, `<>&` escaped), so that one that decodes and re-encodes it writes
    these very bytes: the copy keeps its digest, which a child's parent reference holds.  (skopeo 1.9.3 `copy
    --all` copies an index it does not change byte for byte, whatever its form: tests/test_oci_index.py.)"""
    ann = {**annotations, ANN_TYPE: ARTIFACT_TYPE}
    if parent is not None:
        ann[ANN_PARENT] = parent.digest
    doc: dict[str, object] = {
        "schemaVersion": 2,
        "mediaType": MEDIA_OCI_INDEX,
        "artifactType": ARTIFACT_TYPE,
        "manifests": [p.to_json() for p in parts],
    }
    if parent is not None:
        doc["subject"] = parent.to_json()
    doc["annotations"] = dict(sorted(ann.items()))
    text = json.dumps(doc, separators=_SEP, ensure_ascii=False)
    for c, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                   ("\u2029", "\\u2029")):
        text = text.replace(c, esc)
    return text.encode()


# --- pull ---------------------------------------------------------------------------------------------------------

def decode_top(body: bytes, what: str) -> Artifact | Index:
    """What a reference names: one OCI image manifest of a vramd image (its Artifact), or the index of one (its
    parts still to fetch: `decode_part` each, then `assemble`).  Anything else is a CorruptManifestError."""
    doc = parse_json(body, what, MAX_OCI_MANIFEST)
    if doc.get("mediaType") != MEDIA_OCI_INDEX:
        if doc.get("artifactType") == ARTIFACT_PART:  # `skopeo copy` without --all copies an index's first part
            raise CorruptManifestError(f"{what}: a part of a vramd image pushed as an OCI image index, not the "
                                       "image: reference the index (`skopeo copy` without --all copies its first "
                                       "part alone: copy it with `skopeo copy --all`)")
        return manifest_from_doc(doc, what)
    if len(body) > MAX_INDEX:
        raise CorruptManifestError(f"{what}: OCI image index larger than {MAX_INDEX} bytes")
    ann = doc.get("annotations")
    if not isinstance(ann, dict) or ann.get(ANN_TYPE) != ARTIFACT_TYPE or doc.get("artifactType", ARTIFACT_TYPE) != \
            ARTIFACT_TYPE:
        raise CorruptManifestError(f"{what}: an OCI image index, but not of a vramd image (its annotation {ANN_TYPE} "
                                   f"is not {ARTIFACT_TYPE}): vramctl reads no other")
    entries = doc.get("manifests")
    if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_PARTS:
        raise CorruptManifestError(f"{what}: manifests must list 1 to {MAX_PARTS} parts")
    parts = []
    for i, e in enumerate(entries):
        at = f"{what}: manifests[{i}]"
        if isinstance(e, dict) and e.get("mediaType") == MEDIA_OCI_INDEX:
            raise CorruptManifestError(f"{at}: an index in an index: a vramd image's parts are manifests")
        parts.append(descriptor(e, at, [MEDIA_OCI_MANIFEST], MAX_OCI_MANIFEST))  # its type: the part's own
    if len({p.digest for p in parts}) != len(parts):
        raise CorruptManifestError(f"{what}: a part listed twice")
    if sum(p.size for p in parts) > MAX_PARTS_BYTES:
        raise CorruptManifestError(f"{what}: its parts' manifests are more than {MAX_PARTS_BYTES} bytes in all")
    ann, parent = annotations_and_parent(doc, what)
    return Index(tuple(parts), parent, ann)


def decode_part(body: bytes, what: str, *, first: bool) -> Part:
    """One part manifest of an index (fetched by its digest: the body is the one the index names), checked."""
    doc = parse_json(body, what, MAX_OCI_MANIFEST)
    if doc.get("mediaType") != MEDIA_OCI_MANIFEST:
        raise CorruptManifestError(f"{what}: a part is not an OCI image manifest ({MEDIA_OCI_MANIFEST})")
    if doc.get("artifactType") != ARTIFACT_PART:
        raise CorruptManifestError(f"{what}: not a part of a vramd image (artifactType is not {ARTIFACT_PART})")
    if "subject" in doc:
        raise CorruptManifestError(f"{what}: a part names a subject (only the index names the parent)")
    layers = doc.get("layers")
    if not isinstance(layers, list) or not 1 <= len(layers) <= MAX_LAYERS:
        raise CorruptManifestError(f"{what}: layers must list 1 to {MAX_LAYERS} layers")
    if first:
        config = descriptor(doc.get("config"), f"{what}: config", list(CONFIG_MEDIA.values()), MAX_CONFIG)
        skeleton = descriptor(layers[0], f"{what}: layers[0]", [MEDIA_SKELETON], MAX_SKELETON)
        return Part(config, skeleton, chunk_layers(layers[1:], what, 1))
    if descriptor(doc.get("config"), f"{what}: config", [MEDIA_EMPTY], len(EMPTY_CONFIG)) != EMPTY:
        raise CorruptManifestError(f"{what}: a later part's config is not the OCI empty config")
    return Part(None, None, chunk_layers(layers, what, 0))


def assemble(index: Index, parts: Sequence[Part], what: str) -> Artifact:
    """The index's parts, in its order, as the one Artifact a manifest would be: the first part's config and
    skeleton, every part's payload layers one after the other (none in two parts, MAX_LAYERS in all)."""
    if len(parts) != len(index.parts) or not parts or parts[0].config is None or parts[0].skeleton is None:
        raise CorruptManifestError(f"{what}: the parts are not the index's")
    chunks: list[Descriptor] = []
    seen: set[str] = set()
    for i, p in enumerate(parts):
        chunks += p.chunks
        if len(chunks) >= MAX_LAYERS:
            raise CorruptManifestError(f"{what}: its parts list more than {MAX_LAYERS - 1} payload layers")
        for c in p.chunks:
            if c.digest in seen:
                raise CorruptManifestError(f"{what}: payload layer {c.digest} listed twice (again in part {i})")
            seen.add(c.digest)
    return Artifact(parts[0].config, parts[0].skeleton, tuple(chunks), index.parent, dict(index.annotations))
