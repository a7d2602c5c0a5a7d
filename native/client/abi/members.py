#!/usr/bin/env python3
"""The parts of libvramd's ABI rules that abidiff cannot be trusted with, checked on two abidw XML files
(check.sh).

1. The growth rule of the size-versioned input structs.  libabigail's suppression
   `has_data_member_inserted_at = end` also matches a struct whose members were reordered or retyped without
   any insertion (tests/test_libvramd_abi.py found it): every size-versioned struct of the baseline must be an
   exact prefix of the new one, member by member (name, offset in bits, type spelled out), and a member may
   only be appended.
2. Every exported function's signature, its types spelled out in depth (the members of each struct it
   reaches, enums with their values).  abidw (libabigail 2.2) writes a function whose first declaration it
   meets in another translation unit (vramd_wait, declared in criu.c, defined in session.c) without its ELF
   symbol, so abidiff reading the baseline sees no exported function there and reports no change of its
   parameters at all.  Here a function is found by name, declaration or definition.  A struct only reached
   through a pointer the library hands out or takes opaque (vramd_conn, vramd_criu_table) is not looked
   into; struct vramd_limits, the library's own, may grow at its end too.
3. The constants of the public headers: every `VRAMD_* = N` enumerator and integer `#define VRAMD_*` of the
   baseline list (libvramd-1.0.consts, written by `check.sh --update`) keeps its value (enums a caller passes
   as int never appear in the library's debug information, so abidiff cannot see them renumbered).

    members.py BASELINE.abi NEW.abi [BASELINE.consts INCLUDE_DIR]    exit 0, or 1 naming what breaks a rule
    members.py --consts INCLUDE_DIR                                  print INCLUDE_DIR's constants
"""
from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

GROWING = ("vramd_options", "vramd_open_args", "vramd_bo", "vramd_criu_config", "vramd_criu_bo")
LIBRARY_OWNED = ("vramd_limits",)  # read through a pointer the library returns: may grow at its end
OPAQUE = ("vramd_conn", "vramd_criu_table")

Member = tuple[str, str, str]


class Abi:
    """One abidw XML file: its types by id, structs by name, functions by name, exported function names."""

    def __init__(self, path: str) -> None:
        root = ET.parse(path).getroot()
        self.by_id = {e.get("id"): e for e in root.iter() if e.get("id")}
        self.structs: dict[str, ET.Element] = {}
        for cls in root.iter("class-decl"):
            name = cls.get("name")
            if name and cls.get("is-declaration-only") != "yes" and name not in self.structs:
                self.structs[name] = cls
        self.functions: dict[str, ET.Element] = {}
        for fn in root.iter("function-decl"):
            name = fn.get("name")
            if name and (name not in self.functions or fn.get("elf-symbol-id")):
                self.functions[name] = fn
        syms = root.find("elf-function-symbols")
        self.exported = sorted(s.get("name") for s in syms.iter("elf-symbol")) if syms is not None else []

    def spell(self, type_id: str | None, deep: set[str] | None = None, depth: int = 0) -> str:
        """A type as text: with `deep` (the structs being spelled), a struct's members and an enum's values."""
        e = self.by_id.get(type_id)
        if e is None or depth > 40:
            return "?"
        inner = e.get("type-id")
        if e.tag == "pointer-type-def":
            return self.spell(inner, deep, depth + 1) + "*"
        if e.tag == "qualified-type-def":
            quals = " ".join(q for q in ("const", "volatile", "restrict") if e.get(q) == "yes")
            return f"{quals} {self.spell(inner, deep, depth + 1)}"
        if e.tag == "array-type-def":
            return f"{self.spell(inner, deep, depth + 1)}[{e.get('size-in-bits')} bits]"
        if e.tag == "typedef-decl":  # the name and what it stands for: a retyped typedef changes the ABI too
            return f"{e.get('name')}={self.spell(inner, deep, depth + 1)}"
        if e.tag == "function-type":
            params = ", ".join(self.spell(p.get("type-id"), deep, depth + 1) for p in e.findall("parameter"))
            return f"fn({params})->{self.spell(e.find('return').get('type-id'), deep, depth + 1)}"
        name = e.get("name")
        if e.tag == "enum-decl" and deep is not None:
            values = ",".join(f"{v.get('name')}={v.get('value')}" for v in e.findall("enumerator"))
            return f"enum {name}{{{values}}}"
        if e.tag == "class-decl" and name in OPAQUE + GROWING + LIBRARY_OWNED:
            return f"struct {name}"  # opaque, or held to the prefix rule on its own
        if e.tag == "class-decl" and deep is not None:
            if name in deep:
                return f"struct {name}"
            cls = self.structs.get(name, e)
            fields = ";".join(f"{m}@{off}:{t}" for m, off, t in self.members(cls, deep | {name}, depth + 1))
            return f"struct {name}:{cls.get('size-in-bits')}{{{fields}}}"
        return f"{e.tag}:{name}:{e.get('size-in-bits')}"

    def members(self, cls: ET.Element, deep: set[str] | None = None, depth: int = 0) -> list[Member]:
        """A struct's members: (name, offset in bits, type) in order."""
        return [(dm.find("var-decl").get("name"), dm.get("layout-offset-in-bits"),
                 self.spell(dm.find("var-decl").get("type-id"), deep, depth))
                for dm in cls.findall("data-member")]

    def signature(self, name: str) -> str | None:
        fn = self.functions.get(name)
        if fn is None:
            return None
        params = ", ".join(self.spell(p.get("type-id"), set()) for p in fn.findall("parameter")
                           if p.get("is-variadic") != "yes")
        variadic = ", ..." if any(p.get("is-variadic") == "yes" for p in fn.findall("parameter")) else ""
        return f"{self.spell(fn.find('return').get('type-id'), set())} {name}({params}{variadic})"


def prefix_rule(old: Abi, new: Abi) -> list[str]:
    """Each growing struct of the baseline is a prefix of the new one, its members' types spelled in depth."""
    bad = []
    for name in GROWING + LIBRARY_OWNED:
        a_cls, b_cls = old.structs.get(name), new.structs.get(name)
        if a_cls is None:
            continue  # not in the baseline: nothing to keep
        if b_cls is None:
            bad.append(f"struct {name}: missing from the new library")
            continue
        a, b = old.members(a_cls, {name}), new.members(b_cls, {name})
        if b[:len(a)] != a:
            first = next(i for i, (x, y) in enumerate(zip(a, b + [None] * len(a))) if x != y)
            bad.append(f"struct {name}: member #{first} was {a[first]}, is {b[first] if first < len(b) else 'gone'}: "
                       "a size-versioned struct may only grow at its end")
    return bad


def signature_rule(old: Abi, new: Abi) -> list[str]:
    bad = []
    for name in old.exported:
        was = old.signature(name)
        if was is None:
            bad.append(f"function {name}: exported, but the baseline has no declaration of it")
            continue
        now = new.signature(name) if name in new.exported else None
        if now is None:
            bad.append(f"function {name}: removed")
        elif now != was:
            i = next((i for i, (x, y) in enumerate(zip(was, now)) if x != y), min(len(was), len(now)))
            start = max(0, i - 80)
            bad.append(f"function {name} changed (its parameters, return type or a type they reach):\n"
                       f"  was ...{was[start:i + 80]}...\n  is  ...{now[start:i + 80]}...")
    return bad


CONST_RE = re.compile(r"^\s*(VRAMD_[A-Z0-9_]+)\s*=\s*(-?\d+)\s*,?"
                      r"|^#define\s+(VRAMD_[A-Z0-9_]+)\s+\(?(-?\d+)\)?\s*(?:/\*.*)?$")


NOT_ABI = ("VRAMD_PROTOCOL_VERSION",)  # the wire protocol's version: a later library may speak a newer one


def consts(include: str) -> dict[str, int]:
    """The enumerators and integer macros of the public headers (but NOT_ABI)."""
    out: dict[str, int] = {}
    for header in sorted(Path(include).glob("vramd/*.h")):
        for line in header.read_text().splitlines():
            m = CONST_RE.match(line)
            if m and (m[1] or m[3]) not in NOT_ABI:
                out[m[1] or m[3]] = int(m[2] or m[4])
    return out


def const_rule(baseline: str, include: str) -> list[str]:
    now = consts(include)
    bad = []
    for line in Path(baseline).read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, value = line.split()
        if name not in now:
            bad.append(f"constant {name}: removed from the headers")
        elif now[name] != int(value):
            bad.append(f"constant {name}: was {value}, is {now[name]}: enum values and constants are never changed")
    return bad


def main(argv: list[str]) -> int:
    if argv[0] == "--consts":
        print("# libvramd's public constants (members.py --consts; check.sh --update): never renumbered")
        for name, value in consts(argv[1]).items():
            print(name, value)
        return 0
    old, new = Abi(argv[0]), Abi(argv[1])
    bad = prefix_rule(old, new) + signature_rule(old, new)
    if len(argv) > 2:
        bad += const_rule(argv[2], argv[3])
    for line in bad:
        print(line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
