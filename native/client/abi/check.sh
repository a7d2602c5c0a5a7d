#!/usr/bin/env bash
# libvramd's ABI check (include/vramd/client.h, "ABI 1.0"): libabigail's abidiff between the committed
# baseline, libvramd-1.0.abi, and a build of the library.  Any change abidiff reports that the suppressions
# (libvramd.suppr: members appended to the size-versioned input structs, the opaque handles) do not allow
# fails the check: a removed, reordered, inserted or retyped member, a removed or changed function, a new
# function (a 1.x adds functions in a version node of its own, and the baseline is regenerated with it).
# members.py holds the size-versioned structs to the growth rule member by member (the suppression alone
# would let a reordered member through), compares every exported function's signature with its types
# spelled out (abidiff reading the baseline misses the functions abidw wrote without their symbol), and
# keeps the headers' enum values and constants (libvramd-1.0.consts) as they were.
#
#   native/client/abi/check.sh [LIB [INCLUDE]]  compare LIB (default: build/libvramd/libvramd.so.1, what
#                                               ./dev.sh builds) and the headers in INCLUDE (default:
#                                               native/client/include) with the baseline; exit 0 when compatible
#   native/client/abi/check.sh --update [LIB [INCLUDE]]   regenerate the baseline from LIB and INCLUDE: only
#                                               for a reviewed change (a new 1.x symbol, or soname 2)
# Run by `./dev.sh check` (so by CI's .ci/run); tests/test_libvramd_abi.py checks that it can fail.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
baseline="$here/libvramd-1.0.abi"
update=false
if [ "${1:-}" = "--update" ]; then
    update=true
    shift
fi
consts="$here/libvramd-1.0.consts"
lib="${1:-$root/build/libvramd/libvramd.so.1}"
include="${2:-$root/native/client/include}"
for tool in abidw abidiff; do
    command -v "$tool" >/dev/null || { echo "abi check: $tool is missing (Debian: abigail-tools; ./dev.sh installs it)" >&2; exit 2; }
done
[ -f "$lib" ] || { echo "abi check: no library at $lib (build it: ./dev.sh test, or meson compile -C build/libvramd)" >&2; exit 2; }

if $update; then
    # no paths, no source locations: the baseline depends on the ABI only, not on where or from what lines it was built
    abidw --no-corpus-path --no-comp-dir-path --no-show-locs "$lib" > "$baseline.tmp"
    mv "$baseline.tmp" "$baseline"
    python3 "$here/members.py" --consts "$include" > "$consts"
    echo "abi check: baseline $baseline regenerated from $lib"
    exit 0
fi
rc=0
report=$(abidiff --suppressions "$here/libvramd.suppr" --no-show-locs "$baseline" "$lib") || rc=$?
if [ -n "$report" ]; then
    echo "$report"
fi
# the suppression of appended members also lets reordered or retyped ones through: members.py holds the
# size-versioned structs to "the baseline's members are a prefix of the new ones"
new_abi=$(mktemp)
trap 'rm -f "$new_abi"' EXIT
abidw --no-corpus-path --no-comp-dir-path --no-show-locs "$lib" > "$new_abi"
python3 "$here/members.py" "$baseline" "$new_abi" "$consts" "$include" || rc=$((rc | 8))
if [ "$rc" -ne 0 ]; then
    echo "abi check: FAILED: $lib is not ABI-compatible with $baseline (abidiff exit $rc; see include/vramd/client.h," \
         "\"ABI 1.0\"; a reviewed addition: native/client/abi/check.sh --update)" >&2
    exit 1
fi
echo "abi check: $lib is compatible with libvramd ABI 1.0"
