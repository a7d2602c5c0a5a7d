"""A pull that serves a streamed restore: `vramctl pull --serve REF DIR` (#35, CRIU's plugin restoring from a
registry while the image downloads).

It checks the artifact, its config (manifest.vrdm) and skeleton as `vramctl pull` does before a file is made,
pulls an incremental image's parents whole into their sibling directories (vramd.oci.pull), then lays DIR out
as a streamed restore needs it: manifest.vrdm, each data file under its final name at its full length (the
skeleton's literal runs written, the payloads still holes), and the link to its first parent where the image
recorded its parent as a plain name (`parent`, as CRIU's plugin does: vramd.oci.pull's link_parent), and each
parent's mark of its child (vramd.oci.marks, as `vramctl pull` makes them).  It
listens on a unix stream socket in DIR,
SOCKET_NAME (bound through /proc/self/fd, so DIR's length does not matter), mode 0600, and only then is it
ready: the caller may start the restore.  The downloads start at once (vramd.oci.fill's writer); the first
connection whose peer is root or this process's own uid (SO_PEERCRED; another is closed and the wait goes on)
is the restore's supply: the listener is closed (the socket file stays until the files are whole, so a server
that dies after a restore connected leaves a socket nobody answers, never a directory that looks complete), each
data file's checked prefix is sent as supply messages (vramd.image.supply; the ends done before the connection
came go first), and the end of the connection says that nothing more comes.  Bytes the daemon sends back on it
are read and dropped.

No connection within `timeout` seconds: WaitTimeoutError.  Any failure (that, a blob that fails its digest, a
local write, a signal the caller turns into an exception) removes manifest.vrdm first, then the data files, the
parent link, the socket and DIR itself where the serve made it: never an image that looks complete with holes in
it.  (A server killed outright, before or after a restore connected, leaves DIR and its socket; a restore
connecting to that socket is refused, and the daemon checks every record it reads, so the holes are never
restored as data.)  When it ends well, DIR is the ordinary image `vramctl pull` would have made, fsynced, the
socket removed last, whether or not the restore read every record.
"""
from __future__ import annotations

import math
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ImageError, WaitTimeoutError
from ..image.fileio import image_os_error
from ..image.names import MANIFEST_NAME, SERVE_SOCKET_NAME
from ..image.supply import encode
from .fill import Filler
from .pull import Pulled, Puller, link_chain, lock_parent, prepare, pull_chain, pull_parents
from .push import open_dir

SOCKET_NAME = SERVE_SOCKET_NAME
_UCRED = struct.Struct("iII")  # pid, uid, gid
Warn = Callable[[str], None]


@dataclass(frozen=True)
class Served:
    digest: str  # of the OCI manifest
    chain: list[Pulled]  # the image (DIR), then its parents
    connected: bool  # a restore connected (False: DIR held the image already, nothing was served)


class Server:
    def __init__(self, puller: Puller, ref: str, dest: str, *, timeout: float, warn: Warn = lambda _t: None,
                 wake: int = -1) -> None:
        """`wake`: the read end of the caller's signal.set_wakeup_fd pipe (non-blocking): the waits in `serve` end
        when a signal comes, so its handler runs then (a blocking accept or join could miss it: see `_wait`)."""
        self.puller, self.ref, self.dest, self.timeout, self.warn = puller, ref, dest, timeout, warn
        self.wake = wake
        self.socket_path = os.path.join(dest, SOCKET_NAME)
        self._made_dir = False
        self._created: list[str] = []  # in DIR, manifest.vrdm first
        self._dfd = -1
        self._listener: socket.socket | None = None
        self._conn: socket.socket | None = None
        self._filler: Filler | None = None
        self._fill_thread: threading.Thread | None = None
        self._filled = -1  # readable (hung up) once the fill thread has ended: it closes the pipe's other end
        self._failed: list[BaseException] = []
        self._send_lock = threading.Lock()
        self._broken = False  # the daemon closed its end (its session ended): ends are no longer sent
        self._chain: list[Pulled] = []
        self._digest = ""

    def open(self) -> bool:
        """Check the artifact, pull the parents, lay DIR out and listen; the downloads start.  False where DIR
        held the image already (checked as `vramctl pull` checks it): nothing to serve."""
        if os.path.isfile(os.path.join(self.dest, MANIFEST_NAME)):
            self._chain = pull_chain(self.puller, self.ref, self.dest)  # the very image (checked) or ImageError
            self._digest = self._chain[0].digest
            return False
        art, digest = self.puller.artifact(self.ref)
        config, manifest = self.puller.config(art, digest)
        sk = self.puller.skeleton(art, digest, manifest)
        child = Pulled(self.dest, digest, manifest, art.parent, False)
        self._chain = [child, *pull_parents(self.puller, self.ref, child)]
        self._digest = digest
        lock = lock_parent(self.dest)  # against a pull into DIR meanwhile; released once DIR is laid out
        try:
            self._made_dir, empty = prepare(self.dest)
            if not empty:
                raise ImageError(f"{self.dest} holds another image; serve into a new or empty directory")
            self._dfd = open_dir(self.dest)
            self._write_manifest(bytes(config))
            self._filler = Filler(self.puller.reg, self.puller.repo, sk, manifest,
                                  concurrency=self.puller.concurrency, on_supply=self._send, where=self.dest)
            self._filler.hold()
            self._filler.create(self._dfd, "", self._created)
            # linked to its first parent (pull_chain's), before it listens: a restore finds the chain
            # (abandon() removes the link, never what it names)
            self._chain = link_chain(child, self._chain[1:], made=self._created)
            self._listen()
        except OSError as e:
            raise image_os_error(e, f"cannot lay out {self.dest}") from None
        finally:
            os.close(lock)
        self._filled, end = os.pipe2(os.O_CLOEXEC)
        self._fill_thread = threading.Thread(target=self._fill, args=(end,), name="vramd-serve-fill", daemon=True)
        self._fill_thread.start()
        return True

    def serve(self) -> Served:
        """Wait for the restore's connection, supply it, finish the files (after open() returned True)."""
        assert self._filler is not None and self._fill_thread is not None
        conn = self._accept()
        self._conn = conn
        threading.Thread(target=self._drain, args=(conn,), name="vramd-serve-drain", daemon=True).start()
        self._filler.release()  # the ends done so far, then each as it comes
        while not self._wait(self._filled, None):  # the fill thread's end, or a signal (its handler raises)
            pass
        self._fill_thread.join()
        if self._failed:
            raise self._failed[0]
        with self._send_lock:  # the supply's end: nothing more comes
            conn.close()
            self._conn = None
        self._filler.sync()
        try:
            os.unlink(SOCKET_NAME, dir_fd=self._dfd)  # the files are whole: the directory is the image now
        except FileNotFoundError:  # removed by hand meanwhile: nothing to undo (was: abandon removed the image)
            pass
        os.fsync(self._dfd)
        self._close_fds()
        return Served(self._digest, self._chain, True)

    def chain(self) -> list[Pulled]:
        return self._chain

    def abandon(self) -> None:
        """After a failure: stop the downloads, end the supply, remove what the serve made (manifest first)."""
        if self._filler is not None:
            self._filler.stop()
        conn = self._conn
        if conn is not None:  # a writer blocked on a daemon that stopped reading returns (EPIPE): never a hang
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._fill_thread is not None:
            self._fill_thread.join()
        with self._send_lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            if self._listener is not None:
                self._listener.close()
                self._listener = None
        names = [*self._created, SOCKET_NAME]
        for name in names if self._dfd >= 0 else []:
            try:
                os.unlink(name, dir_fd=self._dfd)
            except FileNotFoundError:
                pass
            except OSError as e:
                self.warn(f"cannot remove {self.dest}/{name}: {e.strerror}")
        self._close_fds()
        if self._made_dir:
            try:
                os.rmdir(self.dest)
            except OSError as e:
                self.warn(f"cannot remove {self.dest}: {e.strerror}")

    # --- the pieces ---------------------------------------------------------------------------------------

    def _write_manifest(self, config: bytes) -> None:
        fd = os.open(MANIFEST_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self._dfd)
        self._created.append(MANIFEST_NAME)
        try:
            os.write(fd, config)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _listen(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            old = os.umask(0o177)  # the socket file is 0600 from the start
            try:
                s.bind(f"/proc/self/fd/{self._dfd}/{SOCKET_NAME}")
            finally:
                os.umask(old)
            s.listen(4)
            s.setblocking(False)  # accepted once `_wait` saw a connection
        except BaseException:
            s.close()
            raise
        self._listener = s

    def _accept(self) -> socket.socket:
        """The first connection of root or our own uid within the timeout; the listener is closed after it (its
        socket file stays: a restore connecting later is refused until the files are whole)."""
        assert self._listener is not None
        deadline = time.monotonic() + self.timeout
        me = os.geteuid()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeoutError(f"no restore connected to {self.socket_path} within {self.timeout:g} s")
            if not self._wait(self._listener.fileno(), left):
                continue
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:  # the peer gave up meanwhile, or a download failed (_fill shut the listener)
                if self._failed:
                    raise self._failed[0] from None
                continue
            except OSError:
                if self._failed:  # a download failed meanwhile (_fill woke the accept): its error is the one
                    raise self._failed[0] from None
                raise
            pid, uid, _gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            if uid in (0, me):
                break
            conn.close()
            self.warn(f"refused a connection to {self.socket_path} from pid {pid}, uid {uid} (only root or uid "
                      f"{me} may restore from it)")
        conn.setblocking(True)
        with self._send_lock:
            self._listener.close()
            self._listener = None
        return conn

    def _send(self, index: int, end: int) -> None:
        with self._send_lock:
            if self._conn is None or self._broken:
                return
            try:
                self._conn.sendall(encode(index, end))
            except (BrokenPipeError, ConnectionResetError):
                self._broken = True  # the session ended: the files are still finished

    def _drain(self, conn: socket.socket) -> None:
        """Read and drop what the daemon sends back (its messages are for writers that pace themselves)."""
        try:
            while conn.recv(4096):
                pass
        except OSError:
            pass

    def _fill(self, end: int) -> None:
        assert self._filler is not None
        try:
            self._filler.run()
        except OSError as e:
            self._failed.append(image_os_error(e, f"cannot write the image's files in {self.dest}"))
        except BaseException as e:
            self._failed.append(e)
        if self._failed:
            with self._send_lock:  # no restore connected yet: the wait for one ends now
                if self._listener is not None:
                    try:
                        self._listener.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
        os.close(end)  # `serve`'s wait for this thread ends

    def _wait(self, fd: int, timeout: float | None) -> bool:
        """Whether `fd` turned readable within `timeout` (None: no bound); False too where a signal came first.
        A signal's C-level handler only flags it where it lands just before the main thread blocks, or in another
        thread: a blocking accept or join (or this poll without `wake`) would go on until its own end, the
        handler not run.  Its wakeup fd ends this poll, and the handler runs as it returns (raising, in vramctl)."""
        p = select.poll()
        p.register(fd, select.POLLIN)
        if self.wake >= 0:
            p.register(self.wake, select.POLLIN)
        ready = {f for f, _ in p.poll(None if timeout is None else math.ceil(timeout * 1000))}
        if self.wake in ready:
            try:
                while os.read(self.wake, 512):
                    pass
            except BlockingIOError:
                pass
        return fd in ready

    def _close_fds(self) -> None:
        if self._filler is not None:
            self._filler.close()
        if self._dfd >= 0:
            os.close(self._dfd)
            self._dfd = -1
        if self._filled >= 0:
            os.close(self._filled)
            self._filled = -1

