#!/usr/bin/env bash
# The whole setup on a fresh Debian 12 machine, and the two things it is for.
#   ./dev.sh demo [demo args]   install what is missing, then run the end-to-end demo
#   ./dev.sh test [pytest args] install what is missing, then run the test suite
#   ./dev.sh check              the gates CI runs before the tests: ruff, mypy, the layer
#                               contract, the SDMA and KFD models' C tests (plain, ASan+UBSan, TSan),
#                               libvramd's ABI against its baseline (native/client/abi/check.sh)
#   ./dev.sh fuzz [args]        the fuzz harness's long mode (not in CI): over a million inputs,
#                               counted (tests/fuzz/README.md)
# Installs apt packages only when something is missing (as root, or via sudo),
# keeps the virtual environment in .venv (rebuilt when pyproject.toml changes),
# and builds libvramd, the C client, into build/libvramd (rebuilt when
# native/client or proto/ change; Meson + protoc-c).
set -euo pipefail
cd "$(dirname "$0")"

APT_PACKAGES=(python3 python3-venv python3-dev gcc pkg-config libdrm-dev libxxhash-dev
              meson ninja-build libprotobuf-c-dev protobuf-c-compiler valgrind libfuse2 abigail-tools
              docker-registry skopeo apache2-utils)  # the OCI tests' real registry, its peer, htpasswd -B

have_python() {
    command -v python3 >/dev/null &&
        python3 -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null
}

have_libdrm() {  # headers and .pc for the SDMA binding and its software model
    command -v pkg-config >/dev/null && pkg-config --exists libdrm_amdgpu
}

have_xxhash() {  # <xxhash.h> for the batch copier (vramd.hostmem._copy)
    [ -f /usr/include/xxhash.h ]
}

have_c_client_tools() {  # libvramd: Meson, protoc-c, libprotobuf-c; valgrind for its tests
    command -v meson >/dev/null && command -v ninja >/dev/null && command -v protoc-c >/dev/null &&
        command -v valgrind >/dev/null && command -v pkg-config >/dev/null && pkg-config --exists libprotobuf-c
}

have_abigail() {  # abidw/abidiff (libabigail) for libvramd's ABI check
    command -v abidiff >/dev/null && command -v abidw >/dev/null
}

have_fuse() {  # libfuse 2 for tests/eiofs.py (the fault matrix's EIO: a FUSE file system that fails I/O)
    ldconfig -p 2>/dev/null | grep -q 'libfuse\.so\.2 '
}

have_registry() {  # the real registry the OCI tests run (vramd/testing/registry.py), skopeo, bcrypt htpasswd
    command -v docker-registry >/dev/null && command -v skopeo >/dev/null && command -v htpasswd >/dev/null
}

ensure_system() {
    have_python && have_libdrm && have_xxhash && have_c_client_tools && have_fuse && have_abigail && have_registry &&
        return 0
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    echo "dev.sh: installing ${APT_PACKAGES[*]} with apt-get" >&2
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${APT_PACKAGES[@]}" >/dev/null
    have_python || { echo "dev.sh: need Python >= 3.11 with venv" >&2; exit 1; }
    have_libdrm || echo "dev.sh: libdrm_amdgpu headers still missing: the SDMA backend will be unavailable" >&2
    have_xxhash || echo "dev.sh: xxhash.h still missing: the batch copier runs in Python" >&2
    have_fuse || echo "dev.sh: libfuse2 still missing: the EIO tests (tests/test_io_errors.py) will skip" >&2
    have_c_client_tools || { echo "dev.sh: need meson, ninja, protoc-c, libprotobuf-c and valgrind for libvramd" >&2; exit 1; }
    have_abigail || { echo "dev.sh: need abigail-tools (abidw, abidiff) for libvramd's ABI check" >&2; exit 1; }
    have_registry || { echo "dev.sh: need docker-registry, skopeo and apache2-utils for the registry tests" >&2; exit 1; }
}

ensure_libvramd() {
    local dir=build/libvramd out
    if [ ! -f "$dir/build.ninja" ]; then
        rm -rf "$dir"
        out=$(meson setup "$dir" native/client 2>&1) || { echo "$out" >&2; echo "dev.sh: meson setup failed" >&2; exit 1; }
    fi
    # ninja rebuilds what changed in native/client or proto/vramd/pb/rpc.proto (and reconfigures itself)
    out=$(meson compile -C "$dir" 2>&1) || { echo "$out" >&2; echo "dev.sh: building libvramd failed" >&2; exit 1; }
}

ensure_venv() {
    local stamp=.venv/.installed extras=test
    # rebuilt when the packaging or the native sources the package builds change (binding, copy loop, SDMA
    # model; not native/client, libvramd, which meson builds: ensure_libvramd)
    if [ -f "$stamp" ] &&
        [ -z "$(find pyproject.toml setup.py native -path native/client -prune -o -newer "$stamp" -print -quit)" ] &&
        .venv/bin/python -c 'import vramd' 2>/dev/null; then
        return 0
    fi
    # a venv that had the bench extra (bench/README.md) gets it again
    if [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch' 2>/dev/null; then
        extras=test,bench
    fi
    rm -rf .venv
    python3 -m venv .venv
    .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
    # the SDMA software model too: the tests verify the SDMA backend against it
    VRAMD_BUILD_MODEL=1 .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$extras]"
    touch "$stamp"
}

check() {
    local py=.venv/bin/python out
    out=$(mktemp -d)
    trap "rm -rf '$out'" RETURN EXIT   # EXIT too: a failing gate exits the script (set -e) without RETURN
    echo "== ruff";          .venv/bin/ruff check vramd tests bench proto contrib
    echo "== mypy";          .venv/bin/mypy                      # the whole package; --strict where pyproject says
    echo "== mypy --strict"; .venv/bin/mypy --strict vramd  # all of it
    echo "== layers";        .venv/bin/lint-imports
    echo "== libvramd ABI";  ensure_libvramd; native/client/abi/check.sh
    if have_libdrm; then
        for flavour in "" --asan --tsan; do
            echo "== SDMA + KFD model C tests ${flavour:-(plain)}"
            $py native/model/build.py --test $flavour "$out" | tail -3
        done
        echo "== KFD model C tests under valgrind"
        $py native/model/build.py --valgrind "$out" | tail -1
    fi
}

cmd="${1:-}"
shift || true
case "$cmd" in
    demo) ensure_system; ensure_venv; ensure_libvramd; exec .venv/bin/python -m vramd.cli.demo "$@" ;;
    test) ensure_system; ensure_venv; ensure_libvramd; exec .venv/bin/python -m pytest "$@" ;;
    check) ensure_system; ensure_venv; check ;;
    fuzz) ensure_system; ensure_venv; exec .venv/bin/python tests/fuzz/long.py "$@" ;;
    *) sed -n '2,12p' "$0" >&2; exit 2 ;;
esac
