#!/usr/bin/env python3
"""The growth rule of libvramd's size-versioned input structs, checked on two abidw XML files (check.sh).

libabigail's suppression `has_data_member_inserted_at = end` also matches a struct whose members were
reordered or retyped without any insertion (tests/test_libvramd_abi.py found it), so check.sh does not rely
on it alone: here every size-versioned struct of the baseline must be an exact prefix of the new one, member
by member (name, offset in bits, type spelled out), and a member may only be appended.

    members.py BASELINE.abi NEW.abi    exit 0, or 1 naming each struct that breaks the rule
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

GROWING = ("vramd_options", "vramd_open_args", "vramd_bo", "vramd_criu_config", "vramd_criu_bo")


def members(path: str) -> dict[str, list[tuple[str, str, str]]]:
    """Each size-versioned struct's members: (name, offset in bits, type) in order."""
    root = ET.parse(path).getroot()
    by_id = {e.get("id"): e for e in root.iter() if e.get("id")}

    def spell(type_id: str | None, depth: int = 0) -> str:
        e = by_id.get(type_id)
        if e is None or depth > 20:
            return "?"
        inner = e.get("type-id")
        if e.tag == "pointer-type-def":
            return spell(inner, depth + 1) + "*"
        if e.tag == "qualified-type-def":
            quals = " ".join(q for q in ("const", "volatile", "restrict") if e.get(q) == "yes")
            return f"{quals} {spell(inner, depth + 1)}"
        if e.tag == "array-type-def":
            return f"{spell(inner, depth + 1)}[{e.get('size-in-bits')} bits]"
        if e.tag == "typedef-decl":  # the name and what it stands for: a retyped typedef changes the ABI too
            return f"{e.get('name')}={spell(inner, depth + 1)}"
        return f"{e.tag}:{e.get('name')}:{e.get('size-in-bits')}"

    out: dict[str, list[tuple[str, str, str]]] = {}
    for cls in root.iter("class-decl"):
        name = cls.get("name")
        if name in GROWING and cls.get("is-declaration-only") != "yes" and name not in out:
            out[name] = [(dm.find("var-decl").get("name"), dm.get("layout-offset-in-bits"),
                          spell(dm.find("var-decl").get("type-id")))
                         for dm in cls.findall("data-member")]
    return out


def main(baseline: str, new: str) -> int:
    old, cur = members(baseline), members(new)
    bad = 0
    for name in GROWING:
        a, b = old.get(name), cur.get(name)
        if a is None:
            continue  # not in the baseline: nothing to keep
        if b is None:
            print(f"struct {name}: missing from the new library")
            bad += 1
        elif b[:len(a)] != a:
            first = next(i for i, (x, y) in enumerate(zip(a, b + [None] * len(a))) if x != y)
            print(f"struct {name}: member #{first} was {a[first]}, is {b[first] if first < len(b) else 'gone'}: "
                  "a size-versioned struct may only grow at its end")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
