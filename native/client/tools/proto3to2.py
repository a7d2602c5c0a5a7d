#!/usr/bin/env python3
"""Rewrite a proto3 file as the proto2 file with the same wire format, for protoc-c.

    proto3to2.py IN.proto OUT.proto

protobuf-c 1.4 (Debian 12) refuses proto3 files with `optional` fields, and
rpc.proto has them (Error.bo_id, Bo.gpu_id, Wait.timeout_ms, ...).  On the
wire a proto3 field and a proto2 `optional` field with the same number and
type are the same bytes; proto3 packs repeated scalars by default, which
proto2 does with [packed = true].  So every singular field outside a oneof
becomes `optional`, repeated scalars get [packed = true], and nothing else
changes: names, numbers and types are kept (`reserved` numbers and names too,
which read the same in proto2), and the C code gets has_* flags
(presence) for every scalar.  The C code treats "absent" and "zero" alike
except for the fields that were `optional` in the proto3 source.

Only the subset of the language that rpc.proto uses is handled; anything
else is an error rather than a silent mistranslation.
"""
import re
import sys

SCALARS = {"double", "float", "int32", "int64", "uint32", "uint64", "sint32", "sint64", "fixed32", "fixed64",
           "sfixed32", "sfixed64", "bool"}
FIELD = re.compile(r"^(\s*)(optional\s+|repeated\s+)?([A-Za-z_][\w.]*)\s+([A-Za-z_]\w*)\s*=\s*(\d+)\s*(\[[^\]]*\])?\s*;\s*$")


def convert(text: str) -> str:
    out, stack = [], []  # stack of block kinds: message, enum, oneof
    enums = set(re.findall(r"^\s*enum\s+(\w+)", text, re.M))
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("//", 1)[0].rstrip()
        if not line.strip():
            continue
        s = line.strip()
        if s.startswith("syntax"):
            if s != 'syntax = "proto3";':
                raise SystemExit(f"line {lineno}: expected a proto3 file")
            out.append('syntax = "proto2";')
            continue
        if s.startswith(("package ", "option ", "import ")):
            out.append(s)
            continue
        m = re.match(r"^(message|enum|oneof)\s+(\w+)\s*\{\s*(\})?$", s)
        if m:
            out.append(s)
            if not m.group(3):
                stack.append(m.group(1))
            continue
        if s == "}":
            if not stack:
                raise SystemExit(f"line {lineno}: unbalanced }}")
            stack.pop()
            out.append(s)
            continue
        # a one-line message such as `message Start { string token = 1; }`
        m = re.match(r"^message\s+(\w+)\s*\{(.*)\}$", s)
        if m:
            fields = [f.strip() + ";" for f in m.group(2).split(";") if f.strip()]
            out.append(f"message {m.group(1)} {{")
            out.extend(field(f, "message", enums, lineno) for f in fields)
            out.append("}")
            continue
        if not stack:
            raise SystemExit(f"line {lineno}: unexpected {s!r}")
        if re.match(r"^reserved\s", s):
            # `reserved 2;`, `reserved 2, 5 to 7;`, `reserved "old_name";`: the same in proto2
            if not RESERVED.match(s):
                raise SystemExit(f"line {lineno}: cannot translate {s!r}")
            out.append("  " + s)
            continue
        if stack[-1] == "enum":
            if not re.match(r"^\w+\s*=\s*-?\d+\s*;$", s):
                raise SystemExit(f"line {lineno}: unexpected enum line {s!r}")
            out.append("  " + s)
            continue
        out.append(field(s, stack[-1], enums, lineno))
    if stack:
        raise SystemExit("unterminated block")
    return "\n".join(out) + "\n"


RESERVED = re.compile(r'^reserved\s+(?:\d+(?:\s+to\s+(?:\d+|max))?(?:\s*,\s*\d+(?:\s+to\s+(?:\d+|max))?)*'
                      r'|"\w+"(?:\s*,\s*"\w+")*)\s*;$')
MAP = re.compile(r"^map\s*<\s*(\w+)\s*,\s*([\w.]+)\s*>\s+([A-Za-z_]\w*)\s*=\s*(\d+)\s*;$")


def field(s: str, block: str, enums: set, lineno: int) -> str:
    m = MAP.match(s)
    if m:  # a map field reads the same in proto2 (a repeated entry message on the wire)
        if block != "message":
            raise SystemExit(f"line {lineno}: a map outside a message")
        key, value, name, num = m.groups()
        return f"  map<{key}, {value}> {name} = {num};"
    m = FIELD.match(s)
    if not m:
        raise SystemExit(f"line {lineno}: cannot translate {s!r}")
    _, label, typ, name, num, opts = m.groups()
    if opts:
        raise SystemExit(f"line {lineno}: field options are not handled: {s!r}")
    label = (label or "").strip()
    if block == "oneof":
        if label:
            raise SystemExit(f"line {lineno}: label in a oneof")
        return f"    {typ} {name} = {num};"
    if label == "repeated":
        packed = " [packed = true]" if typ in SCALARS or typ in enums else ""
        return f"  repeated {typ} {name} = {num}{packed};"
    return f"  optional {typ} {name} = {num};"


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    with open(sys.argv[1], encoding="utf-8") as f:
        text = convert(f.read())
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        f.write("// generated by native/client/tools/proto3to2.py from " + sys.argv[1].rsplit("/", 1)[-1] +
                "; do not edit\n" + text)


if __name__ == "__main__":
    main()
