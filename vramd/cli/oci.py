"""vramctl push, pull, and restore from a registry reference (vramd.oci; docs/image-format.md, "OCI artifact").

    vramctl push IMAGE_DIR HOST/REPO[:TAG] [--parent DIR] [--annotation K=V ...] [registry options]
    vramctl pull HOST/REPO[:TAG|@DIGEST] IMAGE_DIR [registry options]
    vramctl restore --pid PID --image oci://HOST/REPO[:TAG|@DIGEST] [--cache DIR] [registry options] ...

Registry options: --plain-http (explicit: TLS, verified, is the default), --ca-file, --registry-config
(docker/podman config.json), --username with --password-stdin (a password is never taken from argv),
--concurrency.  The network side is vramctl's: the daemon is handed the pulled directory's fds as for any
restore, and never talks to a registry.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import RegistryError
from ..oci.credentials import find_credentials, from_password_stdin
from ..oci.index import ANN_TYPE, DEFAULT_MAX_MANIFEST, MAX_MAX_MANIFEST, MIN_MAX_MANIFEST
from ..oci.layout import ANN_BYTES, ANN_CREATED, ANN_GPUS, ANN_IMAGE_ID, ANN_PARENT
from ..oci.pull import Pulled, Puller, pull_chain
from ..oci.push import Pusher, push_chain
from ..oci.registry import REPO, Reference, Registry
from ..oci.stream import SupplyPipe, restore
from ..oci.tls import Trust
from .common import EXIT_OK, Failure, connect, emit, rate
from .serve import add_serve_args, cmd_serve
from .transfer import cmd_restore

OCI_SCHEME = "oci://"
WINDOW_MIB = 256  # restore --no-cache's default --window
COMPUTED_ANNOTATIONS = (ANN_PARENT, ANN_IMAGE_ID, ANN_GPUS, ANN_BYTES, ANN_CREATED, ANN_TYPE)


def add_registry_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plain-http", action="store_true", help="talk HTTP, not HTTPS, to the registry (only a "
                   "registry you reach over a network you trust)")
    p.add_argument("--ca-file", metavar="PEM", help="trust the registry's certificate if this CA signed it")
    p.add_argument("--registry-config", metavar="PATH", help="a docker/podman config.json holding the registry's "
                   "credentials (default: $REGISTRY_AUTH_FILE, else ~/.docker/config.json, where there is one)")
    p.add_argument("--username", help="the registry user; the password is read from stdin (--password-stdin)")
    p.add_argument("--password-stdin", action="store_true", help="read the registry password from stdin")
    p.add_argument("--concurrency", type=int, default=4, metavar="N", help="blobs moved at once (default 4)")


def add_oci_commands(cmd: Callable[..., argparse.ArgumentParser]) -> None:
    """Registers push and pull with vramctl's `cmd(name, fn, help, daemon=...)`."""
    p = cmd("push", cmd_push, "push an image (and its parents, farthest first) to an OCI registry; only blobs the "
            "registry lacks are uploaded", daemon=False)
    p.add_argument("dir", metavar="IMAGE_DIR")
    p.add_argument("ref", metavar="HOST/REPO[:TAG]")
    p.add_argument("--parent", metavar="DIR", help="an incremental image's parent directory, where it is not where "
                   "the image recorded it")
    p.add_argument("--annotation", action="append", metavar="KEY=VALUE", default=[],
                   help="an annotation of the image's OCI manifest (e.g. org.vramd.image.pid=1234), repeatable")
    p.add_argument("--cache", metavar="DIR", help="where the skeletons of images pushed before are kept, so a second "
                   "push of one reads none of its payloads (default: as restore's --cache)")
    p.add_argument("--mount-from", action="append", metavar="REPO", default=[],
                   help="another repository of the registry whose blobs may be mounted instead of uploaded")
    p.add_argument("--max-manifest-bytes", type=int, default=DEFAULT_MAX_MANIFEST, metavar="N",
                   help="an image whose OCI manifest would be longer goes up as an OCI image index of part manifests "
                   f"(a registry refuses a manifest past its cap, 4 MiB for most; default {DEFAULT_MAX_MANIFEST})")
    add_registry_args(p)
    p = cmd("pull", cmd_pull, "pull an image from an OCI registry into a new or empty directory; its parents go "
            "into sibling directories", daemon=False)
    p.add_argument("ref", metavar="HOST/REPO[:TAG|@DIGEST]")
    p.add_argument("dir", metavar="IMAGE_DIR")
    add_registry_args(p)
    add_serve_args(p)  # --serve: vramd.cli.serve


def add_restore_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", metavar="DIR", help="with --image oci://...: where pulled images are kept and looked "
                   "for first (default: $XDG_CACHE_HOME/vramd/oci, else ~/.cache/vramd/oci)")
    p.add_argument("--no-cache", action="store_true", help="with --image oci://...: keep nothing: the image streams "
                   "through a temporary directory, removed afterwards")
    p.add_argument("--window", type=int, metavar="MIB", help="with --no-cache: the most MiB the temporary "
                   f"directory holds ahead of what the daemon read for good (default {WINDOW_MIB}; at least, and 0: "
                   "--concurrency x the largest blob; a chunk the daemon waits for is downloaded whatever it holds)")
    p.add_argument("--refresh-cache", action="store_true", help="with --image oci://...: drop the cache's copy of "
                   "the image (e.g. one the daemon found damaged) and download it again")
    add_registry_args(p)


def usage_error(ns: argparse.Namespace) -> str | None:
    """What is wrong with a push's, pull's or `restore --image oci://`'s arguments before anything is touched (a
    reference that is none, a digest to push to, a KEY=VALUE without '=', --concurrency 0, a --username without
    --password-stdin): vramctl's parser reports it as a usage error (exit 2); None if nothing is."""
    if getattr(ns, "window", None) is not None and not ns.no_cache:  # it would be ignored
        return "--window needs --no-cache (it bounds the temporary directory a --no-cache restore streams through)"
    if ns.command == "restore" and (why := _cache_flags_error(ns)) is not None:
        return why
    if ns.command == "push" or ns.command == "pull":
        ref_text = ns.ref
    elif ns.command == "restore" and ns.image.startswith(OCI_SCHEME):
        ref_text = ns.image
    else:
        return None
    what = {"push": "HOST/REPO[:TAG]", "pull": "HOST/REPO[:TAG|@DIGEST]"}.get(ns.command, "--image")
    try:
        ref = Reference.parse(ref_text)
    except RegistryError as e:
        return f"argument {what}: {e}"
    if ns.command == "push" and ref.digest:
        return f"argument {what}: {ref_text}: push to a tag (HOST/REPO:TAG), not to a digest"
    for repo in getattr(ns, "mount_from", []):
        if REPO.fullmatch(repo) is None:
            return f"argument --mount-from: {repo!r} is not a repository name (lowercase, digits, . _ - /)"
    try:
        _annotations(getattr(ns, "annotation", []))
    except Failure as e:
        return str(e)
    if ns.concurrency < 1:
        return f"argument --concurrency: {ns.concurrency}: must be at least 1"
    if getattr(ns, "max_manifest_bytes", MIN_MAX_MANIFEST) < MIN_MAX_MANIFEST:
        return f"argument --max-manifest-bytes: {ns.max_manifest_bytes}: must be at least {MIN_MAX_MANIFEST}"
    if getattr(ns, "max_manifest_bytes", MIN_MAX_MANIFEST) > MAX_MAX_MANIFEST:
        return f"argument --max-manifest-bytes: {ns.max_manifest_bytes}: must be at most {MAX_MAX_MANIFEST} (what a " \
            "pull reads)"
    if ns.password_stdin and not ns.username:
        return "--password-stdin needs --username"
    if ns.username and not ns.password_stdin:
        return "--username needs --password-stdin (a password is never taken from the command line)"
    return None


def _cache_flags_error(ns: argparse.Namespace) -> str | None:
    """restore's cache flags where one would be ignored: as --window without --no-cache, a usage error."""
    given = [f for f, on in (("--cache", ns.cache is not None), ("--no-cache", ns.no_cache),
                             ("--refresh-cache", ns.refresh_cache), ("--window", ns.window is not None)) if on]
    if given and not ns.image.startswith(OCI_SCHEME):
        return f"{given[0]} needs --image oci://... (a local image directory is restored as it is)"
    if ns.no_cache and ns.refresh_cache:  # the entry it would drop stays: --no-cache never looks at the cache
        return "--refresh-cache and --no-cache: --no-cache neither reads nor drops the cache's copy"
    if ns.window is not None and ns.window < 0:
        return f"argument --window: {ns.window}: must be at least 0"
    return None


def _registry(ns: argparse.Namespace, ref: Reference, actions: tuple[str, ...] = ("pull",)) -> Registry:
    if ns.concurrency < 1:
        raise Failure("--concurrency must be at least 1")
    if not hasattr(ns, "oci_credentials"):  # stdin is read once, however many registries a command opens
        explicit = None
        if ns.password_stdin:
            if not ns.username:
                raise Failure("--password-stdin needs --username")
            if sys.stdin is None:  # started with stdin closed (<&-): nothing to read the password from
                raise Failure("--password-stdin: stdin is closed: pipe the password in (e.g. vramctl ... "
                              "--password-stdin < FILE)")
            explicit = from_password_stdin(ns.username, sys.stdin)
        elif ns.username:
            raise Failure("--username needs --password-stdin (a password is never taken from the command line)")
        config = Path(ns.registry_config) if ns.registry_config else None
        ns.oci_credentials = find_credentials(ref.host, ref.repo, registry_config=config, explicit=explicit)
    trust = Trust(ca_file=Path(ns.ca_file) if ns.ca_file else None, plain_http=ns.plain_http)
    return Registry(ref.host, trust=trust, credentials=ns.oci_credentials, actions=actions,
                    concurrency=ns.concurrency)


def _annotations(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise Failure(f"--annotation {item!r}: expected KEY=VALUE")
        if key in COMPUTED_ANNOTATIONS:  # they describe the image: a value of the caller's would be a lie,
            raise Failure(f"--annotation {key}: vramctl sets it from the image itself")  # or make it unpullable
        try:  # bytes not UTF-8 in argv: no JSON carries them (an index's encoder failed untyped)
            item.encode()
        except UnicodeEncodeError:
            raise Failure(f"--annotation {item!r}: not UTF-8 text") from None
        out[key] = value
    return out


def cmd_push(ns: argparse.Namespace) -> int:
    ref = Reference.parse(ns.ref)
    if ref.digest:
        raise Failure(f"{ns.ref}: push to a tag (HOST/REPO:TAG), not to a digest")
    reg = _registry(ns, ref, ("pull", "push"))
    t0 = time.monotonic()
    warned: set[str] = set()

    def warn(text: str) -> None:  # once: the chain's images share the cache
        if text not in warned:
            warned.add(text)
            print(f"vramctl: warning: {text}", file=sys.stderr, flush=True)
    try:
        pushed = push_chain(Pusher(reg, ref.repo, concurrency=ns.concurrency, mount_from=ns.mount_from,
                                   max_manifest_bytes=ns.max_manifest_bytes), ns.dir,
                            ref.tag or "latest", first_parent=ns.parent, annotations=_annotations(ns.annotation),
                            cache=cache_root(ns), warn=warn)
    finally:
        reg.close()
    secs = time.monotonic() - t0
    st = reg.stats
    d = {"ok": True, "reference": str(ref), "digest": pushed[-1][1].digest, "seconds": round(secs, 6),
         "chain": [{"dir": p, "digest": desc.digest, "media_type": desc.media_type} for p, desc in pushed],
         "stats": st.to_dict()}
    emit(ns, d, f"pushed {ns.dir} to {ref} ({pushed[-1][1].digest}), {len(pushed)} image(s): uploaded "
                f"{st.blobs_uploaded} blob(s), {st.bytes_uploaded} bytes ({rate(st.bytes_uploaded, secs)}), "
                f"{st.blobs_present} already there, {st.blobs_mounted} mounted")
    return EXIT_OK


def _pull(ns: argparse.Namespace, text: str, dest: str, keep: str | None = None) -> tuple[Reference, Registry,
                                                                                        list[Pulled], float]:
    ref = Reference.parse(text)
    reg = _registry(ns, ref)
    t0 = time.monotonic()
    try:
        chain = pull_chain(Puller(reg, ref.repo, concurrency=ns.concurrency, keep=keep), ref.ref, dest)
    finally:
        reg.close()
    return ref, reg, chain, time.monotonic() - t0


def cmd_pull(ns: argparse.Namespace) -> int:
    if ns.serve:
        return cmd_serve(ns, _registry)
    ref, reg, chain, secs = _pull(ns, ns.ref, ns.dir)
    st = reg.stats
    d = {"ok": True, "reference": str(ref), "digest": chain[0].digest, "seconds": round(secs, 6),
         "chain": [{"dir": p.path, "digest": p.digest, "cached": p.cached, "link": p.link} for p in chain],
         "stats": st.to_dict()}
    links = "".join(f"; {os.path.join(p.path, p.link)} -> {os.readlink(os.path.join(p.path, p.link))}"
                    for p in chain if p.link is not None)
    emit(ns, d, f"pulled {ref} ({chain[0].digest}) into {ns.dir}, {len(chain)} image(s): downloaded "
                f"{st.blobs_downloaded} blob(s), {st.bytes_downloaded} bytes ({rate(st.bytes_downloaded, secs)})"
                f"{links}")
    return EXIT_OK


def cache_root(ns: argparse.Namespace) -> str:
    if ns.cache:
        return str(ns.cache)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "vramd", "oci")


NO_NOTES = "the daemon sends no supply notes (older than this vramctl): --no-cache keeps the whole image in TMPDIR"


def _sends_notes(ns: argparse.Namespace) -> bool:
    """Whether the daemon sends notes over a supply socket (HelloReply.supply_notes), which --no-cache's window
    waits on; one warning where it does not (older than this vramctl: the window would never lift)."""
    with connect(ns) as daemon:
        if daemon.supply_notes:
            return True
    print(f"vramctl: warning: {NO_NOTES}", file=sys.stderr, flush=True)
    return False


def cmd_restore_any(ns: argparse.Namespace) -> int:
    """vramctl restore: an image directory as before, or `oci://` a reference, restored while it downloads
    (vramd.oci.stream) into the cache (or, --no-cache, a temporary directory removed afterwards); a cache entry
    holding the image is restored as it is (the daemon checks every record it reads)."""
    if not ns.image.startswith(OCI_SCHEME):
        return cmd_restore(ns)
    ref = Reference.parse(ns.image)
    bounded = ns.no_cache and _sends_notes(ns)  # a window only where the daemon's notes will lift it
    reg = _registry(ns, ref)
    scratch = None
    try:
        # One directory per pulled child: its parents become its siblings there, as the child recorded them.
        # The artifact's digest names it, so a tag moved to another image gets a directory of its own.
        keep = None if ns.no_cache else os.path.join(cache_root(ns), "skeletons")
        puller = Puller(reg, ref.repo, concurrency=ns.concurrency, keep=keep)
        art = puller.artifact(ref.ref)  # fetched once: restore takes it as it is
        body_digest = art[1]
        if ns.no_cache:
            scratch = tempfile.mkdtemp(prefix="vramd-restore-")
            root = scratch
        else:
            root = os.path.join(cache_root(ns), ref.host.replace(":", "_"), ref.repo.replace("/", "_"),
                                body_digest.removeprefix("sha256:"))
            try:
                os.makedirs(root, mode=0o700, exist_ok=True)
            except OSError as e:
                raise Failure(f"cannot make the pull's cache directory {root}: {e.strerror}: give --cache a "
                              "directory you may write") from None
        entry = os.path.join(root, "image")
        shown = str(ref) if ns.no_cache else entry

        def run(image: str, parent: str | None, supply: SupplyPipe | None) -> None:
            ns.image = image
            if parent is not None and ns.parent is None:
                ns.parent = parent
            cmd_restore(ns, supply=None if supply is None else (supply.fd, supply.opened), shown=shown,
                        report=report)

        # parents (incremental images) are pulled whole first, their cached copies checked against the skeleton
        # kept beside them; the image itself streams
        report: list[tuple[dict[str, Any], str]] = []
        window = max(0, WINDOW_MIB if ns.window is None else ns.window) << 20 if bounded else None
        done = restore(puller, body_digest, entry, run, commit=not ns.no_cache, refresh=ns.refresh_cache,
                       artifact=art, window=window,
                       warn=lambda text: print(f"vramctl: warning: {text}", file=sys.stderr, flush=True))
    finally:
        reg.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    # what the registry sent, the image's blobs downloaded after the session ended (a tail it never read) included
    d, line = report[-1]
    st = reg.stats
    d.update(stats=st.to_dict(), digest=body_digest, warm=done.warm)
    if done.window is not None:
        d["window"] = done.window.to_dict()
    emit(ns, d, f"{line}; downloaded {st.blobs_downloaded} blob(s), {st.bytes_downloaded} bytes" +
         (" (the image from its cache entry)" if done.warm else ""))
    return EXIT_OK
