"""Pull a vramd image (and its parents) from a registry into image directories, byte for byte as pushed.

Registry data is untrusted: the OCI manifest, the config (manifest.vrdm, which must decode and pass every check
a reader makes) and the skeleton are checked against each other (vramd.oci.layout) before a file is created;
the payload blobs are streamed into the files (vramd.oci.fill: `concurrency` at once, 1 MiB each in memory,
none longer than its descriptor says, each checked against its digest as it ends).  Files are created only
under the data file names manifest.vrdm lists, as `<name>.tmp` in the one directory the caller named, and the
manifest is renamed into place last: a pull that fails leaves no image (and removes what it created).
"""
from __future__ import annotations

import dataclasses
import fcntl
import itertools
import os
import re
import stat
from dataclasses import dataclass

import blake3

from ..errors import CorruptManifestError, DigestMismatchError, ImageError, ParentMismatchError, from_os_error
from ..image.manifest import decode_manifest
from ..image.names import MANIFEST_NAME, is_data_file_name, is_own_temporary, manifest_tmp_name
from ..pb import image_pb2 as pb
from .fill import Filler, chunk_of
from .index import assemble, decode_part, decode_top
from .layout import (
    LITERAL,
    MAX_CONFIG,
    MAX_OCI_MANIFEST,
    PAYLOAD,
    Artifact,
    Skeleton,
    check_config,
    check_skeleton,
    decode_skeleton,
    sha256_digest,
)
from .marks import mark_parents
from .push import MAX_CHAIN, open_dir, open_file, read_manifest_bytes
from .registry import Registry

SIBLING_HINT = re.compile(r"\.\./([A-Za-z0-9_][A-Za-z0-9._-]{0,200})")
LINK_HINT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,200}")  # a hint naming an entry of the child's own directory


@dataclass(frozen=True)
class Pulled:
    path: str
    digest: str  # of the OCI manifest
    manifest: pb.Manifest
    parent: str | None  # the parent's OCI manifest digest
    cached: bool  # the directory held this very image already: nothing was downloaded
    link: str | None = None  # the name in `path` made a link to the parent's directory (pull_chain), if any


class Puller:
    def __init__(self, reg: Registry, repo: str, *, concurrency: int = 4, keep: str | None = None) -> None:
        """`keep`: a directory of the caller's where skeleton layers are kept by digest (restore's cache), so
        checking a cached image against its artifact downloads no blob."""
        self.reg, self.repo, self.concurrency, self.keep = reg, repo, max(1, concurrency), keep
        self._by_digest: dict[str, tuple[Artifact, str]] = {}

    def artifact(self, ref: str) -> tuple[Artifact, str]:
        """The checked OCI manifest at `ref`, and its digest; where `ref` names an OCI image index of ours
        (vramd.oci.index), its parts fetched by digest one after the other, each checked, and made one Artifact.
        Fetched once per digest for the Puller's life (a digest names one manifest for ever: a parent's, looked at
        to find where it goes and then pulled, is one GET, its parts too); a tag is asked for each time (it may
        move)."""
        if ref in self._by_digest:
            return self._by_digest[ref]
        body, digest = self.reg.get_manifest(self.repo, ref, MAX_OCI_MANIFEST)
        what = f"{self.reg.host}/{self.repo}@{digest}"
        top = decode_top(body, what)
        if isinstance(top, Artifact):
            got = top, digest
        else:
            parts = []
            for i, d in enumerate(top.parts):
                part, _ = self.reg.get_manifest(self.repo, d.digest, d.size)  # by digest: checked against it
                if len(part) != d.size:
                    raise CorruptManifestError(f"{what}: part {i} ({d.digest}) is {len(part)} bytes, not the "
                                               f"{d.size} the index says")
                parts.append(decode_part(part, f"{what}: part {i} ({d.digest})", first=i == 0))
            got = assemble(top, parts, what), digest
        self._by_digest[digest] = got
        return got

    def config(self, art: Artifact, digest: str) -> tuple[bytearray, pb.Manifest]:
        """The artifact's config blob (manifest.vrdm's bytes, every reader check passed) and its decoding."""
        what = f"{self.reg.host}/{self.repo}@{digest}"
        config = self.reg.get_blob(self.repo, art.config.digest, min(art.config.size, MAX_CONFIG),
                                   where=" (the image's manifest.vrdm)")
        manifest = decode_manifest(config, f"{what}: config ({MANIFEST_NAME})")
        check_config(art, manifest, what)
        return config, manifest

    def pull(self, ref: str, dest: str) -> Pulled:
        """The image at `ref` into `dest`, one pull at a time per parent directory (an flock of it: restores of
        one reference on one node share its cache entry; a pull that died holds no lock, so its temporaries are
        swept)."""
        art, digest = self.artifact(ref)
        lock = lock_parent(dest)
        try:
            return self._pull_locked(art, digest, dest)
        finally:
            os.close(lock)

    def _pull_locked(self, art: Artifact, digest: str, dest: str) -> Pulled:
        created_dir, empty = prepare(dest)
        if not empty:
            held = _held(dest)
            if held != art.config.digest:
                raise ImageError(f"{dest} holds another image; pull into a new or empty directory (or vramctl rm "
                                 "it)")
            dfd = open_dir(dest)  # the very image, committed: only its skeleton is downloaded, to check it by
            try:
                manifest = decode_manifest(read_manifest_bytes(dfd, dest), f"{dest}/{MANIFEST_NAME}")
                check_config(art, manifest, dest)
                sk = self.skeleton(art, digest, manifest)
                _verify(dfd, dest, sk, manifest)
            finally:
                os.close(dfd)
            return Pulled(dest, digest, manifest, art.parent, True)
        try:  # nothing is created before the config and the skeleton passed every check
            config, manifest = self.config(art, digest)
            sk = self.skeleton(art, digest, manifest)
        except BaseException:
            if created_dir:
                os.rmdir(dest)
            raise
        dfd = open_dir(dest)
        created: list[str] = []
        try:
            self._write(dfd, dest, sk, manifest, created)
            for name in list(created):
                os.rename(name, name.removesuffix(".tmp"), src_dir_fd=dfd, dst_dir_fd=dfd)
                created[created.index(name)] = name.removesuffix(".tmp")
            tmp = manifest_tmp_name(manifest.image_id)  # a dump's name for it: what prepare sweeps
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dfd)
            created.append(tmp)
            try:
                os.write(fd, config)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, MANIFEST_NAME, src_dir_fd=dfd, dst_dir_fd=dfd)  # the commit
            created.pop()
            os.fsync(dfd)
        except BaseException as e:
            for name in created:
                try:
                    os.unlink(name, dir_fd=dfd)
                except OSError:
                    pass
            if created_dir:
                try:
                    os.rmdir(dest)
                except OSError:
                    pass
            if isinstance(e, OSError):
                raise from_os_error(e, dest, ImageError) from None
            raise
        finally:
            os.close(dfd)
        return Pulled(dest, digest, manifest, art.parent, False)

    def skeleton(self, art: Artifact, digest: str, manifest: pb.Manifest) -> Skeleton:
        what = f"{self.reg.host}/{self.repo}@{digest}"
        kept = os.path.join(self.keep, art.skeleton.digest.removeprefix("sha256:")) if self.keep else None
        blob: bytes | bytearray | None = _read_kept(kept, art.skeleton.digest, art.skeleton.size)
        if blob is None:
            blob = self.reg.get_blob(self.repo, art.skeleton.digest, art.skeleton.size,
                                     where=" (the skeleton layer)")
            _keep(kept, blob)
        sk = decode_skeleton(blob, what=f"{what}: skeleton", layers=len(art.chunks))
        check_skeleton(sk, art, manifest)
        return sk

    def _write(self, dfd: int, dest: str, sk: Skeleton, manifest: pb.Manifest, created: list[str]) -> None:
        """The data files, as `<name>.tmp`: vramd.oci.fill's writer with no session to supply."""
        filler = Filler(self.reg, self.repo, sk, manifest, concurrency=self.concurrency, where=dest)
        try:
            filler.create(dfd, ".tmp", created)
            filler.run()
            filler.sync()
        finally:
            filler.close()


def _verify(dfd: int, dest: str, sk: Skeleton, manifest: pb.Manifest) -> None:
    """A directory that held the image already (a cache entry) is used only if every byte is what the artifact
    says: each data file as long as its skeleton, each literal run equal, each zero run zeros, each payload's
    sha256 its layer's digest; else DigestMismatchError naming the file, the offset and the BO, and nothing
    was restored from it.  Reads the image once (sha256 at disk speed), never more than a chunk at a time."""
    for fi, f in enumerate(sk.files):
        fd = open_file(dfd, f.name, dest)
        try:
            if os.fstat(fd).st_size != f.length:
                raise DigestMismatchError(f"{dest}/{f.name}: {os.fstat(fd).st_size} bytes, not the {f.length} the "
                                          f"artifact has; {_DAMAGED.format(dest=dest)}")
            pos = 0
            for s in f.segments:
                good = True
                if s.kind == PAYLOAD:
                    good = sha256_digest(os.pread(fd, s.length, pos)) == sk.blobs[s.blob][0]
                elif s.kind == LITERAL:
                    good = os.pread(fd, s.length, pos) == s.data
                else:
                    for at in range(pos, pos + s.length, 4 << 20):
                        n = min(4 << 20, pos + s.length - at)
                        good = good and os.pread(fd, n, at).count(0) == n
                if not good:
                    bo, off, name = chunk_of(manifest, fi, pos)
                    chunk = f"a chunk of BO {bo} at offset {off:#x}" if bo is not None and off is not None else \
                        "no BO's payload"
                    raise DigestMismatchError(f"{dest}/{name} @ {pos:#x} ({chunk}) is not what the artifact holds; "
                                              f"{_DAMAGED.format(dest=dest)}", bo_id=bo, offset=off)
                pos += s.length
        except OSError as e:
            raise from_os_error(e, f"{dest}/{f.name}", ImageError) from None
        finally:
            os.close(fd)


def _read_kept(path: str | None, digest: str, size: int) -> bytes | None:
    """A kept skeleton layer, if it is there and is the layer (its sha256 checked: a cache is no authority)."""
    if path is None:
        return None
    try:
        with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as fh:
            data = fh.read(size + 1)
    except OSError:
        return None
    return data if len(data) == size and sha256_digest(data) == digest else None


def _keep(path: str | None, data: bytes | bytearray) -> None:
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except OSError:
        pass  # a cache: the next check downloads the layer again


_DAMAGED = "the copy in {dest} is damaged and nothing was restored from it: remove the directory to pull it again"


def lock_parent(dest: str, *, shared: bool = False) -> int:
    """An flock of `dest`'s parent directory: exclusive for a pull or a cache entry's commit, `shared` for a
    restore reading a committed entry (no refresh removes it meanwhile)."""
    parent = os.path.dirname(os.path.abspath(dest))
    try:
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise from_os_error(e, parent, ImageError) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
    except OSError as e:
        os.close(fd)
        raise from_os_error(e, f"cannot lock {parent}", ImageError) from None
    return fd


def prepare(dest: str) -> tuple[bool, bool]:
    """(made, empty): make `dest` if it is not there; an existing one must be a directory that holds an image
    already (the cache's case), or nothing but the temporaries of a pull or dump that died before its commit
    (a vramctl killed midway: they are removed, so that a cache entry is never stuck), or nothing at all."""
    try:
        os.mkdir(dest)
        return True, True
    except FileExistsError:
        pass
    except OSError as e:
        raise from_os_error(e, dest, ImageError) from None
    if not os.path.isdir(dest) or os.path.islink(dest):
        raise ImageError(f"{dest}: not a directory")
    names = set(os.listdir(dest))
    if MANIFEST_NAME in names:
        return False, False
    if not all(is_own_temporary(n) for n in names):
        raise ImageError(f"{dest}: not empty, and holds no image; pull into a new or empty directory")
    dfd = open_dir(dest)
    try:
        for name in names:  # regular files only: lstat, then unlink of the name
            if stat.S_ISREG(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                os.unlink(name, dir_fd=dfd)
            else:
                raise ImageError(f"{dest}/{name}: not a regular file; pull into a new or empty directory")
    except OSError as e:
        raise from_os_error(e, dest, ImageError) from None
    finally:
        os.close(dfd)
    return False, True


def _held(dest: str) -> str:
    """The sha256 digest of the manifest.vrdm `dest` holds."""
    dfd = open_dir(dest)
    try:
        return sha256_digest(read_manifest_bytes(dfd, dest))
    finally:
        os.close(dfd)


def _free_or_holding(puller: Puller, path: str, ref: str | None) -> bool:
    """Nothing at `path`, or a directory holding the image of the artifact at `ref`."""
    if not os.path.lexists(path):
        return True
    if ref is None or os.path.islink(path) or not os.path.isfile(os.path.join(path, MANIFEST_NAME)):
        return False
    try:
        return _held(path) == puller.artifact(ref)[0].config.digest
    except ImageError:
        return False


def pull_chain(puller: Puller, ref: str, dest: str) -> list[Pulled]:
    """The image at `ref` into `dest`, and its parents (by the digests the artifacts name) into sibling
    directories: at the name the child recorded where that is `../NAME`, so vramctl finds them as it finds
    any parent, if nothing is there yet or that very image is (the name comes from the registry: a directory
    of the caller's is never filled, nor its temporaries swept); else `DEST.parent-K` (then name the first
    with --parent).  Where an image recorded its parent as a plain name inside its own directory (`parent`, as
    CRIU's amdgpu plugin does), that name is made a relative symbolic link to the directory its parent was
    pulled into, so vramctl and the plugin find the chain with no step of the operator's."""
    first = puller.pull(ref, dest)
    return link_chain(first, pull_parents(puller, ref, first))


def link_chain(first: Pulled, parents: list[Pulled], made: list[str] | None = None) -> list[Pulled]:
    """The chain [first, *parents], `first` linked to its first parent where it recorded a plain name
    (link_parent: its `link` set, and the link's name appended to `made` before anything else can fail), and the
    parents marked as a dump marks them (vramctl rm of a parent is then refused while `first` needs it).
    `first`'s directory must exist."""
    if parents:
        first = dataclasses.replace(first, link=link_parent(first, parents[0].path))
        if first.link is not None and made is not None:
            made.append(first.link)
    chain = [first, *parents]
    mark_parents(chain)
    return chain


def link_parent(child: Pulled, parent_dir: str) -> str | None:
    """Where `child` recorded its parent as a name in its own directory (LINK_HINT: never a name of vramd's
    files, a dot name or a path), that name becomes a relative symbolic link to `parent_dir`, made beside it and
    renamed over it (atomic: a link already there, from an earlier pull, is replaced; anything else in its way
    is an ImageError, never removed).  The link's name, or None where the hint is no such name."""
    name = child.manifest.parents[0].relative_path if child.manifest.parents else ""
    if LINK_HINT.fullmatch(name) is None or name == MANIFEST_NAME or is_data_file_name(name) or \
            is_own_temporary(name):
        return None
    target = os.path.relpath(os.path.abspath(parent_dir), os.path.abspath(child.path))
    tmp = f".{name}.{os.getpid()}.link.tmp"
    dfd = open_dir(child.path)
    try:
        try:
            if not stat.S_ISLNK(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                raise ImageError(f"{child.path}/{name}: not a symbolic link, in the way of the link to the image's "
                                 f"parent ({target}); move it away and pull again")
        except FileNotFoundError:
            pass
        os.symlink(target, tmp, dir_fd=dfd)
        try:
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            os.unlink(tmp, dir_fd=dfd)
            raise
        os.fsync(dfd)
    except OSError as e:
        raise from_os_error(e, f"{child.path}/{name}: the link to its parent", ImageError) from None
    finally:
        os.close(dfd)
    return name


def pull_parents(puller: Puller, ref: str, child: Pulled, avoid: tuple[str, ...] = ()) -> list[Pulled]:
    """The parents of `child` (pulled, or about to be, into child.path), each pulled whole, nearest first; never
    into child.path nor a path of `avoid` (a streamed restore's staging directory), whatever name they recorded:
    the child may not be there yet.  Each parent that recorded its own parent as a plain name gets that link
    (link_parent); the child's is its caller's to make."""
    out = [child]
    taken = {os.path.abspath(p) for p in (child.path, *avoid)}
    while out[-1].parent is not None:
        child = out[-1]
        if len(out) > MAX_CHAIN:
            raise CorruptManifestError(f"{ref}: a chain of more than {MAX_CHAIN} parents")
        pref = child.manifest.parents[0]
        hint = SIBLING_HINT.fullmatch(pref.relative_path)
        base = os.path.dirname(os.path.abspath(child.path))
        path = os.path.join(base, hint[1]) if hint else ""
        if not path or path in taken or not _free_or_holding(puller, path, child.parent):
            path = f"{os.path.abspath(out[0].path)}.parent-{len(out)}"
        assert child.parent is not None
        try:
            got = puller.pull(child.parent, path)
        except ImageError as e:
            raise ImageError(f"parent #{len(out)} of {ref} ({path}): {e.message}") from None
        dfd = open_dir(path)
        try:
            mbytes = read_manifest_bytes(dfd, path)
        finally:
            os.close(dfd)
        if got.manifest.image_id != pref.image_id or blake3.blake3(mbytes).digest() != pref.manifest_hash:
            raise ParentMismatchError(f"{ref}: the artifact named as parent #{len(out)} ({child.parent}) is not the "
                                      "image the child recorded")
        out.append(got)
    # each parent linked to its own where it recorded it as a plain name: the chain resolves from the first
    # parent on (a streamed restore names the first with --parent; pull_chain links the child itself)
    parents = out[1:]
    return [*(dataclasses.replace(p, link=link_parent(p, pp.path)) for p, pp in itertools.pairwise(parents)),
            *parents[-1:]]
