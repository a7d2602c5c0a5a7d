#!/usr/bin/env python3
"""Generate the man pages and the shell completion from the commands' own argparse parsers.

    python contrib/generate.py            # rewrite contrib/man/vramd.8, vramctl.1, contrib/completion/vramctl.bash
    python contrib/generate.py --check    # exit 1 if the committed files drifted from the parsers, or
                                          # README.md's vramctl block lists a command or flag they lack

The parsers are the one source: a flag added to `vramd` or `vramctl` appears
in the man page and the completion when this is re-run, and
tests/test_packaging.py fails until it is.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["COLUMNS"] = "100"  # argparse wraps usage to the terminal: the same text on every machine

from vramd import __version__  # noqa: E402
from vramd.cli.vramctl import build_parser as vramctl_parser  # noqa: E402
from vramd.image.compression import MODES, compression_arg  # noqa: E402
from vramd.service.main import build_parser as vramd_parser  # noqa: E402

DATE = "2026-11"  # bump by hand with a release; generated files must not change with the clock


def _esc(text: str) -> str:
    return text.replace("\\", "\\e").replace("-", "\\-").replace("'", "\\(aq")


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"\\fI{_esc(action.metavar or action.dest).upper()}\\fR"
    names = ", ".join(f"\\fB{_esc(s)}\\fR" for s in action.option_strings)
    if action.nargs == 0:
        return names
    meta = action.metavar or (
        "{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper())
    return f"{names} \\fI{_esc(str(meta))}\\fR"


def _options(parser: argparse.ArgumentParser) -> Iterator[str]:
    for action in parser._actions:  # argparse keeps no public list
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        yield ".TP"
        yield _flags(action)
        yield _esc(action.help or "")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_of(parser: argparse.ArgumentParser, name: str) -> str:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name:
                    return choice.help or ""
    return ""


def man_page(parser: argparse.ArgumentParser, section: int, tail: list[str]) -> str:
    prog = parser.prog
    out = [f'.TH {prog.upper()} {section} "{DATE}" "vramd {__version__}" "vramd"',
           ".SH NAME", f"{prog} \\- {_esc(parser.description or '')}",
           ".SH SYNOPSIS", ".nf", _esc(parser.format_usage().removeprefix("usage: ").strip()), ".fi",
           ".SH OPTIONS", *_options(parser)]
    subs = _subcommands(parser)
    if subs:
        out.append(".SH COMMANDS")
        for name, sp in subs.items():
            out += [".SS " + name, _esc(_help_of(parser, name)), ".nf",
                    _esc(sp.format_usage().removeprefix("usage: ").strip()), ".fi", *_options(sp)]
    out += tail
    return "\n".join(out) + "\n"


VRAMD_TAIL = [
    ".SH SIGNALS",
    "SIGTERM and SIGINT drain running sessions for up to the drain timeout, cancel the rest (a cancelled dump "
    "commits no image) and exit 0.",
    "SIGHUP re-reads the configuration file and applies what can change at run time (log level, allowed uids and "
    "groups, connection limits, grace period, drain timeout, metrics file); other changes wait for a restart.",
    ".SH FILES",
    ".TP", "\\fI/etc/vramd/vramd.toml\\fR", "the configuration (every setting and its default: the vramd.toml vramd "
    "ships).",
    ".TP", "\\fI/run/vramd/vramd.sock\\fR", "the socket systemd creates (vramd.socket), and a daemon root "
    "starts by hand listens on without \\-\\-socket.  Clients prefer it whenever it exists, and use a socket only "
    "if its directories and its listener belong to root, themselves or the daemon user (vramctl(1), SOCKET).",
    ".SH EXIT STATUS", "0 after a drain or \\-\\-check\\-config; 2 for a bad configuration or a usage mistake, with "
    "one line naming the key or the flag; 1 where it cannot listen (one line naming the socket's path, and nothing "
    "left behind).  Of the socket's directories it makes only its runtime directories, \\fI/run/vramd\\fR (root) "
    "and \\fI$XDG_RUNTIME_DIR/vramd\\fR or \\fI/tmp/vramd\\-UID\\fR: a \\-\\-socket in a directory that does "
    "not exist is refused, not made.",
    ".SH SEE ALSO", "\\fBvramctl\\fR(1), \\fBsystemd.socket\\fR(5)",
]
VRAMCTL_TAIL = [
    ".SH EXIT STATUS", "0 success; 1 failure, with a one-line reason on stderr (and in the JSON with \\-\\-json): "
    "what failed, where, and what to do (where no daemon listens, the sockets looked for and "
    "\\fBsystemctl start vramd.socket\\fR; where the socket's mode keeps you out, its group); "
    "2 usage error (a flag's value the parser refuses, such as an unknown codec or size, or a dump with nothing to "
    "dump).",
    ".SH SOCKET",
    "Without \\-\\-socket, vramctl uses \\fB$VRAMD_SOCKET\\fR; else \\fI/run/vramd/vramd.sock\\fR if it exists "
    "(if it cannot be trusted, vramctl fails: it does not fall back); else your own daemon's, "
    "\\fI$XDG_RUNTIME_DIR/vramd/vramd.sock\\fR, or without XDG_RUNTIME_DIR "
    "\\fI/tmp/vramd\\-UID/vramd.sock\\fR, which root never uses.",
    "Before it sends anything, vramctl checks the socket: every directory on its path (symbolic links resolved) "
    "must belong to root, to you or to the daemon user and be writable by nobody else (a root-owned sticky "
    "directory such as /tmp only above the socket's own directory), and the process listening on it must run as "
    "one of those uids.  Otherwise it fails with PERMISSION_DENIED, naming the path and the uid that owns it.",
    ".SH STOCK CRIU IMAGES",
    "\\fBimport\\-criu\\fR reads a checkpoint directory made by CRIU's stock amdgpu plugin: the BO lists in "
    "\\fIamdgpu\\-kfd\\-ID.img\\fR and \\fIamdgpu\\-renderD\\-ID.img\\fR say which bytes of "
    "\\fIamdgpu\\-pages\\-ID\\-GPU.img\\fR and \\fIamdgpu\\-drm\\-pages\\-ID\\-MINOR\\-INDEX.img\\fR "
    "are which BO; each becomes a BO of the vramd image named \\fIcriu\\-amdgpu:kfd\\-ID:INDEX\\fR (or "
    "\\fIrenderD\\-ID:INDEX\\fR), copied a chunk at a time, checksummed, deduplicated and compressed as a dump is.  "
    "\\fBexport\\-criu\\fR writes those pages files back, byte for byte, into a directory that holds the same "
    "checkpoint's metadata files (a copy of the dump directory: the metadata cannot be made from a vramd image); "
    "each file is written under a temporary name and renamed over the old one.  Both refuse, naming the file and "
    "the BO, a pages file whose length or header disagrees with its BO entries, sizes no GPU has, a symbolic link "
    "or anything but a regular file, and an image whose BOs or sizes differ from the metadata's.",
    ".SH ENVIRONMENT", ".TP", "\\fBVRAMD_SOCKET\\fR", "the daemon's socket, when \\-\\-socket is not given.",
    ".TP", "\\fBVRAMD_DAEMON_USER\\fR", "the daemon user (a name or a uid) trusted besides root and you, when "
    "\\-\\-daemon\\-user is not given; default vramd (if no such user exists: only root and you).",
    ".SH SEE ALSO", "\\fBvramd\\fR(8)",
]


def _value_words(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Flag -> the words a shell offers after it: an option's choices, and for --compress (its type is
    compression_arg) the codec names compression.py accepts (a level goes after a colon: zstd:3)."""
    out: dict[str, list[str]] = {}
    for p in [parser, *_subcommands(parser).values()]:
        for action in p._actions:
            words = ([str(c) for c in action.choices] if action.choices and not isinstance(
                action, argparse._SubParsersAction) else list(MODES) if action.type is compression_arg else [])
            for flag in action.option_strings if words else ():
                out.setdefault(flag, words)
    return out


def bash_completion(parser: argparse.ArgumentParser) -> str:
    subs = _subcommands(parser)
    top = [s for a in parser._actions for s in a.option_strings]
    lines = ["# bash completion for vramctl (generated by contrib/generate.py from vramctl's parser)",
             "_vramctl() {",
             "    local cur cmd i",
             '    cur="${COMP_WORDS[COMP_CWORD]}"',
             '    cmd=""',
             "    for ((i = 1; i < COMP_CWORD; i++)); do",
             '        case "${COMP_WORDS[i]}" in',
             f"            {'|'.join(subs)}) cmd=\"${{COMP_WORDS[i]}}\"; break ;;",
             "        esac",
             "    done",
             '    case "$cmd" in']
    for name, sp in subs.items():
        opts = " ".join(s for a in sp._actions for s in a.option_strings)
        lines.append(f'        {name}) COMPREPLY=($(compgen -W "{opts}" -- "$cur")) ;;')
    lines += [f'        "") COMPREPLY=($(compgen -W "{" ".join(top)} {" ".join(subs)}" -- "$cur")) ;;',
              "    esac",
              "    case \"${COMP_WORDS[COMP_CWORD-1]}\" in",
              "        --image|--workdir|--socket) COMPREPLY=($(compgen -f -- \"$cur\")) ;;"]
    lines += [f'        {flag}) COMPREPLY=($(compgen -W "{" ".join(words)}" -- "$cur")) ;;'
              for flag, words in _value_words(parser).items()]
    lines += ["    esac",
              "}",
              "complete -o default -F _vramctl vramctl",
              ""]
    return "\n".join(lines)


def readme_drift(readme: str, parser: argparse.ArgumentParser) -> list[str]:
    """Where README.md's vramctl block (hand-written: it explains) has drifted from the parser: a command it does
    not list, or a flag it names that the command (or vramctl itself) does not take."""
    start = readme.find("## vramctl\n")
    if start < 0:
        return ["README.md has no vramctl section"]
    block = readme[start:].split("```sh\n", 1)[-1].split("```", 1)[0]
    subs = _subcommands(parser)
    top = {s for a in parser._actions for s in a.option_strings}
    listed: dict[str, set[str]] = {}
    name = ""
    for line in block.splitlines():
        if line.startswith("vramctl "):
            name = line.split()[1]
            listed.setdefault(name, set())
        if name:
            listed[name] |= set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", line))
    out = [f"README.md: vramctl {n} is not listed" for n in subs if n not in listed]
    for n, flags in listed.items():
        if n not in subs:
            out.append(f"README.md: vramctl {n}: no such command")
            continue
        takes = top | {s for a in subs[n]._actions for s in a.option_strings}
        out += [f"README.md: vramctl {n} {f}: no such flag" for f in sorted(flags - takes)]
    return out


def outputs() -> dict[Path, str]:
    return {
        ROOT / "contrib" / "man" / "vramd.8": man_page(vramd_parser(), 8, VRAMD_TAIL),
        ROOT / "contrib" / "man" / "vramctl.1": man_page(vramctl_parser(), 1, VRAMCTL_TAIL),
        ROOT / "contrib" / "completion" / "vramctl.bash": bash_completion(vramctl_parser()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    ap.add_argument("--root", type=Path, default=ROOT,
                    help="the tree whose files --check compares (default: this repository)")
    ns = ap.parse_args()
    drift = []
    for path, text in outputs().items():
        path = ns.root / path.relative_to(ROOT)
        if ns.check:
            if not path.exists() or path.read_text() != text:
                drift.append(str(path.relative_to(ns.root)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if drift:
        print("generated files drifted from the parsers; run python contrib/generate.py:", *drift, sep="\n  ")
    readme = ns.root / "README.md"
    by_hand = readme_drift(readme.read_text() if readme.exists() else "", vramctl_parser())
    if by_hand:
        print("README.md's vramctl commands drifted from the parser (edit it by hand):", *by_hand, sep="\n  ")
    return 1 if drift or by_hand else 0


if __name__ == "__main__":
    sys.exit(main())
