"""`vramctl`: a thin client of the daemon, plus offline image tools.

    vramctl [--socket S] status [--json]
    vramctl [--socket S] sessions [--all] [--json]      (--all: every uid's, for root and the daemon's uid)
    vramctl [--socket S] cancel TOKEN|ID [--reason TEXT] [--json]
    vramctl [--socket S] dump [--pid PID --range ADDR:LEN [--range ...]] [--bo-file PATH[:OFF:LEN] ...]
                              --image DIR [--compress none|zstd|bplanes|auto[:LEVEL]] [--json]
    vramctl [--socket S] restore --pid PID --image DIR [--json]
    vramctl [--socket S] restore --pid PID --image oci://HOST/REPO[:TAG] [--cache DIR] [registry options]
    vramctl push IMAGE_DIR HOST/REPO[:TAG] [registry options]   (an OCI registry: cli/oci.py)
    vramctl pull HOST/REPO[:TAG|@DIGEST] IMAGE_DIR [registry options]
    vramctl [--socket S] dump ... --parent PARENT_DIR    (an incremental image)
    vramctl verify DIR [--parent DIR] [--json]          (offline: no daemon)
    vramctl inspect DIR [--json]                        (offline: no daemon)
    vramctl flatten DIR OUT [--parent DIR] [--json]     (offline: a self-contained copy)
    vramctl rm DIR [--parent DIR] [--json]              (offline: an image no child needs)
    vramctl gc DIR [--json]                             (offline: interrupted dumps' temporaries, stale marks)
    vramctl [--socket S] selftest [--size 64M] [--json]
    vramctl [--socket S] import-criu CRIU_DIR IMAGE_DIR [--compress ...] [--kfd ID] [--force] [--offline] [--json]
    vramctl [--socket S] export-criu IMAGE_DIR CRIU_DIR [--kfd ID] [--parent DIR] [--offline] [--json]

vramctl opens /proc/PID/mem and the BO files, and opens and creates the
image's files in the image directory itself, with the caller's rights (it
also commits a dump); it passes the fds, and the daemon never gets the
directory and never opens a path.  --socket may come
before or after the command.  Rates are in GB/s (decimal: 1 GB = 10^9
bytes).  Exit codes: 0 success; 1 failure, with a one-line reason on stderr
(and in the JSON with --json); 2 usage error; output cut short by a closed
pipe (`vramctl ... | head`) ends quietly with 141, as SIGPIPE would.

This module is the parser and main; the commands live by group: transfer.py
(dump, restore), images.py (the offline verify, inspect, rm, gc, flatten),
admin.py (status, sessions, cancel, selftest); interop.py (import-criu, export-criu: CRIU's stock
amdgpu plugin's files) drives sessions as transfer.py does; all over imagedir.py (the image
directories vramctl opens) and common.py (exit codes, argument types, output).
"""
from __future__ import annotations

import argparse
import json
import os
import select
import sys
from typing import Any

from .. import __version__
from ..errors import VramdError
from ..image.compression import compression_arg
from ..units import size_arg
from .admin import cmd_cancel, cmd_selftest, cmd_sessions, cmd_status
from .common import (
    EXIT_FAILURE,
    EXIT_PIPE,
    Failure,
    parse_bo_file,
    parse_bo_target,
    parse_range,
    parse_session_ref,
    rate,
    session_dict,
)
from .imagedir import read_manifest_offline
from .images import cmd_flatten, cmd_gc, cmd_inspect, cmd_rm, cmd_verify
from .interop import cmd_export_criu, cmd_import_criu
from .oci import add_oci_commands, add_restore_args, cmd_restore_any
from .oci import usage_error as oci_usage_error
from .transfer import cmd_dump

# What scripts imported from this module before vramctl was split by command group: still here.
__all__ = ["build_parser", "main", "rate", "read_manifest_offline", "session_dict"]

PARENT_HELP = ("an incremental image's parent directory, where it is not where the image recorded it (its own "
               "parents are then found where it recorded them)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vramctl", description="Control the vramd VRAM checkpoint daemon.",
                                 epilog="exit codes: 0 success, 1 failure (reason on stderr), 2 usage error")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    socket_help = ("daemon socket (default: $VRAMD_SOCKET, else /run/vramd/vramd.sock if it exists, else your own "
                   "daemon's; used only if its directories and its listener belong to root, you or the daemon user)")
    user_help = ("the daemon user trusted besides root and you, a name or a uid (default: $VRAMD_DAEMON_USER, "
                 "else vramd)")
    ap.add_argument("--socket", help=socket_help)
    ap.add_argument("--daemon-user", metavar="USER", help=user_help)
    sub = ap.add_subparsers(dest="command", required=True)

    def cmd(name: str, fn: Any, help_text: str, *, daemon: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--json", action="store_true", help="print one JSON document")
        if daemon:  # also after the command; SUPPRESS keeps a --socket given before it
            p.add_argument("--socket", default=argparse.SUPPRESS, help=socket_help)
            p.add_argument("--daemon-user", metavar="USER", default=argparse.SUPPRESS, help=user_help)
        p.set_defaults(fn=fn)
        return p

    cmd("status", cmd_status, "daemon status and metrics (of the whole daemon for root and the daemon's uid; "
        "any other uid: its own connections and sessions)")
    p = cmd("sessions", cmd_sessions, "sessions the daemon holds")
    p.add_argument("--all", action="store_true",
                   help="every session the daemon shows you (root and the daemon's uid: every uid's) with uid, "
                        "client and target pids, rate (GB/s), age and error; default: your uid's")
    p = cmd("cancel", cmd_cancel, "cancel a session: by its token (its holders) or by its id (root and the "
            "daemon's uid); it shows as cancelling until its copies have stopped, then cancelled")
    p.add_argument("session", type=parse_session_ref, metavar="TOKEN|ID")
    p.add_argument("--reason", help="recorded as the session's error message")
    p = cmd("dump", cmd_dump, "dump memory ranges of a process and/or files into an image")
    p.add_argument("--pid", type=int, help="the process of the --range addresses (needed with --range)")
    p.add_argument("--range", type=parse_range, action="append", metavar="ADDR:LEN",
                   help="address range in PID (hex or sizes with K/M/G), repeatable")
    p.add_argument("--bo-file", type=parse_bo_file, action="append", metavar="PATH[:OFF:LEN]",
                   help="a file (memfd, dmabuf, regular file) holding a BO, repeatable")
    p.add_argument("--image", required=True, metavar="DIR")
    p.add_argument("--compress", type=compression_arg, metavar="none|zstd|bplanes|auto[:LEVEL]",
                   help="default: the daemon's (auto: compressed only where that makes the dump faster)")
    p.add_argument("--force", action="store_true", help="replace an image the directory already holds")
    p.add_argument("--parent", metavar="DIR",
                   help="an incremental image: chunks DIR's image (and its parents) holds are referred to")
    p.add_argument("--no-dedup", action="store_true", help="store every chunk, even one the image holds already")
    p.add_argument("--replace-parent", action="store_true",
                   help="with --force: replace an image even though incremental images need it (they break)")
    p = cmd("restore", cmd_restore_any, "write an image back: ranges into PID at their addresses, file BOs into the "
            "files you name")
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--image", required=True, metavar="DIR|oci://HOST/REPO[:TAG|@DIGEST]")
    add_restore_args(p)
    p.add_argument("--bo-file", type=parse_bo_target, action="append", metavar="ID=PATH",
                   help="write the image's file BO ID into PATH, repeatable (the image's recorded paths are never "
                        "opened unless --to-recorded-paths)")
    p.add_argument("--to-recorded-paths", action="store_true",
                   help="write file BOs to the paths the image recorded (only for images you trust)")
    p.add_argument("--parent", metavar="DIR", help=PARENT_HELP)
    p = cmd("verify", cmd_verify, "check every chunk of an image (offline); exit 1 on any damage", daemon=False)
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--parent", metavar="DIR", help=PARENT_HELP)
    p = cmd("rm", cmd_rm, "remove an image: an incremental one also unmarks itself in its parents (offline); "
            "an image incremental images need is kept", daemon=False)
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--parent", metavar="DIR", help=PARENT_HELP)
    p = cmd("gc", cmd_gc, "remove what interrupted dumps left in an image directory, and its stale marks (their "
            "child is gone or holds another image; offline; refused while a dump writes into it)", daemon=False)
    p.add_argument("dir", metavar="DIR")
    p = cmd("flatten", cmd_flatten, "copy an image into a self-contained one: no parents needed (offline)",
            daemon=False)
    p.add_argument("dir", metavar="DIR")
    p.add_argument("out", metavar="OUT", help="an empty or new directory for the self-contained copy")
    p.add_argument("--parent", metavar="DIR", help=PARENT_HELP)
    p = cmd("selftest", cmd_selftest, "round-trip known data through every backend, per GPU; GB/s")
    p.add_argument("--size", type=size_arg, default=64 << 20, help="bytes per BO (default 64M)")
    p.add_argument("--workdir", default="/var/tmp", help="where the temporary images go")
    p = cmd("inspect", cmd_inspect, "describe an image (offline)", daemon=False)
    p.add_argument("dir", metavar="DIR")
    offline_help = "run the session in this process (the daemon's session path), without a daemon"
    p = cmd("import-criu", cmd_import_criu, "turn the BO contents of a checkpoint made by CRIU's stock amdgpu plugin "
            "(amdgpu-pages-*, amdgpu-drm-pages-*, as its amdgpu-kfd-*.img and amdgpu-renderD-*.img lay them out) "
            "into a vramd image")
    p.add_argument("criu_dir", metavar="CRIU_DIR", help="the stock checkpoint directory (criu dump -D)")
    p.add_argument("image", metavar="IMAGE_DIR")
    p.add_argument("--compress", type=compression_arg, metavar="none|zstd|bplanes|auto[:LEVEL]",
                   help="default: the daemon's (auto: compressed only where that makes the dump faster)")
    p.add_argument("--force", action="store_true", help="replace an image the directory already holds")
    p.add_argument("--offline", action="store_true", help=offline_help)
    p.add_argument("--kfd", type=int, metavar="ID", help="only amdgpu-kfd-ID.img's BOs, as the vramd plugin lays "
                   "them out (BO id = KFD bucket index, one image per KFD file: IMAGE_DIR amdgpu-vramd-ID)")
    p.set_defaults(pid=None)
    p = cmd("export-criu", cmd_export_criu, "write the stock plugin's pages files from a vramd image that "
            "import-criu made, into a stock checkpoint directory holding the metadata files of the same checkpoint "
            "(a copy of the dump directory); refused where the BOs' entries and sizes disagree")
    p.add_argument("image", metavar="IMAGE_DIR")
    p.add_argument("criu_dir", metavar="CRIU_DIR", help="a copy of the stock checkpoint directory: its "
                   "amdgpu-kfd-*.img and amdgpu-renderD-*.img say which pages files to write (replaced atomically)")
    p.add_argument("--parent", metavar="DIR", help=PARENT_HELP)
    p.add_argument("--offline", action="store_true", help=offline_help)
    p.add_argument("--kfd", type=int, metavar="ID", help="the image holds amdgpu-kfd-ID.img's BOs: only its pages "
                   "files are written; unnamed BOs (the vramd plugin's image) go by id = bucket index (default: ID "
                   "of an IMAGE_DIR named amdgpu-vramd-ID)")
    p.set_defaults(pid=None)
    add_oci_commands(cmd)
    return ap


def stdout_closed() -> bool:
    """Whether stdout is a pipe nobody reads any more (poll reports an error on its write end)."""
    try:
        p = select.poll()
        p.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _fd, ev in p.poll(0))
    except (OSError, ValueError):
        return False


def quiet_broken_pipe() -> int:
    """stdout's reader went away (`vramctl ... | head`): no traceback, no message; 141 as for SIGPIPE.
    stdout now points at /dev/null, so the interpreter's last flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return EXIT_PIPE


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # the output, the --help text or the error report met a closed pipe
        return quiet_broken_pipe()


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)  # exits 2 on usage errors
    if ns.command == "dump" and ns.range and ns.pid is None:
        parser.error("dump: --range needs --pid (the process the addresses are in)")
    if ns.command == "dump" and not ns.range and not ns.bo_file:
        parser.error("dump: nothing to dump: give --range ADDR:LEN (the addresses in --pid's memory to dump) "
                     "and/or --bo-file PATH" if ns.pid is not None else
                     "dump: nothing to dump: give --pid PID --range ADDR:LEN and/or --bo-file PATH")
    if (oci_usage := oci_usage_error(ns)) is not None:
        parser.error(oci_usage)
    try:
        rc: int = ns.fn(ns)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return rc
    except (Failure, VramdError, OSError) as e:
        if isinstance(e, BrokenPipeError) and stdout_closed():
            raise  # not a failure to report: main ends quietly (a daemon that hung up is reported)
        err: dict[str, Any]
        if isinstance(e, VramdError):
            reason, err = f"{e.code}: {e.describe()}", e.to_dict()
        else:
            reason, err = str(e), {"code": "FAILURE", "message": str(e)}
        if getattr(ns, "json", False):
            print(json.dumps({"ok": False, "error": err}, indent=2, sort_keys=True))
        print(f"vramctl: {reason}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("vramctl: interrupted", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
