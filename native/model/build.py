"""Build (and test) the SDMA SOFTWARE MODEL: libdrm_amdgpu_model.so.

THIS IS A MODEL of libdrm_amdgpu + the SDMA engine, not a GPU; numbers
measured with it are model numbers, never hardware numbers
(docs/sdma-model.md).

    build(out_dir) -> path of libdrm_amdgpu_model.so
    run_tests(out_dir) -> the test program's exit status

CLI:
    python native/model/build.py OUT_DIR            build the library
    python native/model/build.py --test OUT_DIR     build it and run test_model.c, then
                                                    test_kfd.c (the KFD model, docs/kfd-model.md)
                                                    and test_kfd_shim.c (its identity emulation)
    add --tsan (ThreadSanitizer) or --asan (AddressSanitizer + UBSan) to either
    for an instrumented build (own file names)
    python native/model/build.py --valgrind OUT_DIR the KFD model's tests under valgrind

The library has SONAME libdrm_amdgpu.so.1: a process that dlopen()s it with
RTLD_GLOBAL before loading an extension linked against libdrm_amdgpu.so.1
gets the model's functions instead of the real library's.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = [HERE / "amdgpu_model.c"]
HEADERS = [HERE / "vramd_model.h"]
TEST_SOURCE = HERE / "test_model.c"
KFD_SOURCES = [HERE / "kfd_model.c"]
KFD_HEADERS = [HERE / "kfd_model.h"]
KFD_TEST_SOURCE = HERE / "test_kfd.c"
KFD_SHIM_SOURCES = [HERE / "kfd_model.c", HERE / "kfd_shim.c"]
KFD_SHIM_TEST_SOURCE = HERE / "test_kfd_shim.c"
KFD_LIB_NAME = "libvramd_kfd_model.so"
KFD_CORE_LIB_NAME = "libvramd_kfd_core.so"
KFD_WORKLOAD_SOURCE = HERE / "kfd_workload.c"
LIB_NAME = "libdrm_amdgpu_model.so"
SONAME = "libdrm_amdgpu.so.1"
CFLAGS = ["-std=gnu11", "-O2", "-g", "-pthread", "-Wall", "-Wextra", "-Werror"]
SANITIZERS = {
    None: [],
    "thread": ["-fsanitize=thread"],
    "address": ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
                "-fno-sanitize-recover=undefined"],
}


class ModelBuildError(RuntimeError):
    """The model cannot be built here (no gcc, no libdrm headers, compile error)."""


def _gcc() -> str:
    gcc = shutil.which("gcc")
    if not gcc:
        raise ModelBuildError("gcc not found on PATH; the SDMA model needs gcc to build")
    return gcc


def libdrm_cflags() -> list[str]:
    """`pkg-config --cflags libdrm_amdgpu`, checked to really reach amdgpu.h."""
    pkg = shutil.which("pkg-config")
    if not pkg:
        raise ModelBuildError("pkg-config not found; install pkg-config and libdrm-dev")
    proc = subprocess.run([pkg, "--cflags", "libdrm_amdgpu"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelBuildError("pkg-config cannot find libdrm_amdgpu (install libdrm-dev): "
                              + (proc.stderr.strip() or proc.stdout.strip()))
    flags = shlex.split(proc.stdout)
    dirs = [f[2:] for f in flags if f.startswith("-I")] + ["/usr/include", "/usr/local/include"]
    if not any(Path(d, "amdgpu.h").is_file() and Path(d, "amdgpu_drm.h").is_file() for d in dirs):
        raise ModelBuildError(f"amdgpu.h / amdgpu_drm.h not found in {dirs} (install libdrm-dev)")
    return flags


def _suffix(sanitize: str | None) -> str:
    return "" if sanitize is None else f"-{sanitize}"


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelBuildError(f"command failed ({proc.returncode}): {shlex.join(cmd)}\n"
                              f"{proc.stdout}{proc.stderr}")


def _up_to_date(out: Path, inputs: list[Path]) -> bool:
    try:
        t = out.stat().st_mtime_ns
    except FileNotFoundError:
        return False
    return all(p.stat().st_mtime_ns <= t for p in inputs)


def _compile_into(out: Path, cmd: list[str], sources: list[Path]) -> None:
    """Run `cmd -o <temporary> sources` in out's directory, then rename the result to `out`: concurrent
    builders never see half a file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{out.stem}-", suffix=out.suffix, dir=out.parent)
    os.close(fd)
    try:
        _run([*cmd, "-o", tmp, *map(str, sources)])
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build(out_dir: str | os.PathLike, sanitize: str | None = None, force: bool = False) -> str:
    """Compiles the model into OUT_DIR/libdrm_amdgpu_model.so (or
    libdrm_amdgpu_model-thread.so with sanitize="thread"); returns its path.
    Rebuilds only when a source is newer, unless force. Raises ModelBuildError."""
    if sanitize not in SANITIZERS:
        raise ValueError(f"sanitize must be one of {list(SANITIZERS)}")
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / LIB_NAME.replace(".so", f"{_suffix(sanitize)}.so")
    inputs = SOURCES + HEADERS + [Path(__file__).resolve()]
    if not force and _up_to_date(out, inputs):
        return str(out)
    cmd = [_gcc(), *CFLAGS, *SANITIZERS[sanitize], "-fPIC", "-shared", "-fvisibility=hidden",
           *libdrm_cflags(), f"-I{HERE}", f"-Wl,-soname,{SONAME}", "-Wl,--no-undefined"]
    _compile_into(out, cmd, SOURCES)
    return str(out)


def build_test(out_dir: str | os.PathLike, sanitize: str | None = None) -> str:
    """Builds the library and test_model.c; returns the test program's path.
    The program finds the model as libdrm_amdgpu.so.1 through its RUNPATH."""
    lib = Path(build(out_dir, sanitize))
    out_dir = lib.parent
    libdir = out_dir / f"model-test-lib{_suffix(sanitize)}"
    libdir.mkdir(exist_ok=True)
    link = libdir / SONAME
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(lib)
    exe = out_dir / f"test_model{_suffix(sanitize)}"
    _run([_gcc(), *CFLAGS, *SANITIZERS[sanitize], *libdrm_cflags(), f"-I{HERE}",
          "-o", str(exe), str(TEST_SOURCE), str(link), f"-Wl,-rpath,{libdir}"])
    return str(exe)


def kfd_cflags(out_dir: str | os.PathLike) -> list[str]:
    """Flags to compile against the system's <linux/kfd_ioctl.h>, which includes
    <drm/drm.h>: Debian's linux-libc-dev has no drm/ directory, libdrm-dev has
    the header as <libdrm/drm.h>; a one-line forwarding header in OUT_DIR fills
    the gap where needed."""
    if not Path("/usr/include/linux/kfd_ioctl.h").is_file():
        raise ModelBuildError("<linux/kfd_ioctl.h> not found (install linux-libc-dev)")
    if Path("/usr/include/drm/drm.h").is_file():
        return []
    inc = Path(out_dir).resolve() / "kfd-include"
    (inc / "drm").mkdir(parents=True, exist_ok=True)
    fwd = inc / "drm" / "drm.h"
    text = "#include <libdrm/drm.h>\n"
    if not fwd.is_file() or fwd.read_text() != text:
        fwd.write_text(text)
    return [f"-I{inc}"]


def build_kfd_test(out_dir: str | os.PathLike, sanitize: str | None = None) -> str:
    """Builds test_kfd.c with the KFD model, linked to the SDMA model (as
    libdrm_amdgpu.so.1, like build_test); returns the program's path."""
    build_test(out_dir, sanitize)
    out_dir = Path(out_dir).resolve()
    link = out_dir / f"model-test-lib{_suffix(sanitize)}" / SONAME
    exe = out_dir / f"test_kfd{_suffix(sanitize)}"
    _run([_gcc(), *CFLAGS, *SANITIZERS[sanitize], *libdrm_cflags(), *kfd_cflags(out_dir), f"-I{HERE}",
          "-o", str(exe), str(KFD_TEST_SOURCE), *map(str, KFD_SOURCES), str(link),
          f"-Wl,-rpath,{link.parent}"])
    return str(exe)


def build_kfd_lib(out_dir: str | os.PathLike, sanitize: str | None = None, force: bool = False) -> str:
    """Compiles the KFD model and its identity emulation (kfd_shim.c) into
    OUT_DIR/libvramd_kfd_model.so, the library to LD_PRELOAD into criu and the
    emulated process (docs/kfd-model.md); returns its path."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / KFD_LIB_NAME.replace(".so", f"{_suffix(sanitize)}.so")
    inputs = KFD_SHIM_SOURCES + KFD_HEADERS + [Path(__file__).resolve()]
    if not force and _up_to_date(out, inputs):
        return str(out)
    _compile_into(out, [_gcc(), *CFLAGS, *SANITIZERS[sanitize], "-fPIC", "-shared", *libdrm_cflags(),
                        *kfd_cflags(out_dir), f"-I{HERE}", "-Wl,--no-undefined"], KFD_SHIM_SOURCES)
    return str(out)


def build_kfd_core_lib(out_dir: str | os.PathLike) -> str:
    """Compiles the KFD model alone (no identity emulation, nothing interposed) into
    OUT_DIR/libvramd_kfd_core.so, for a process that calls kfdm_* itself (a test,
    through ctypes); returns its path."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / KFD_CORE_LIB_NAME
    if not _up_to_date(out, KFD_SOURCES + KFD_HEADERS + [Path(__file__).resolve()]):
        _compile_into(out, [_gcc(), *CFLAGS, "-fPIC", "-shared", *libdrm_cflags(), *kfd_cflags(out_dir), f"-I{HERE}",
                            "-Wl,--no-undefined"], KFD_SOURCES)
    return str(out)


def build_kfd_shim_test(out_dir: str | os.PathLike, sanitize: str | None = None) -> str:
    """Builds test_kfd_shim.c linked to libvramd_kfd_model.so (whose stat,
    open and ioctl then come before libc's); returns the program's path."""
    lib = Path(build_kfd_lib(out_dir, sanitize))
    exe = lib.parent / f"test_kfd_shim{_suffix(sanitize)}"
    _run([_gcc(), *CFLAGS, *SANITIZERS[sanitize], *libdrm_cflags(), *kfd_cflags(lib.parent), f"-I{HERE}",
          "-o", str(exe), str(KFD_SHIM_TEST_SOURCE), str(lib), f"-Wl,-rpath,{lib.parent}"])
    return str(exe)


def build_kfd_workload(out_dir: str | os.PathLike) -> str:
    """Builds the emulated GPU process (kfd_workload.c; links nothing of the
    model: it gets the model through LD_PRELOAD); returns its path."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    exe = out_dir / "kfd_workload"
    if not _up_to_date(exe, [KFD_WORKLOAD_SOURCE, Path(__file__).resolve()]):
        _run([_gcc(), *CFLAGS, *kfd_cflags(out_dir), "-o", str(exe), str(KFD_WORKLOAD_SOURCE)])
    return str(exe)


VALGRIND = ["valgrind", "-q", "--error-exitcode=9", "--trace-children=yes"]


def run_kfd_valgrind(out_dir: str | os.PathLike, timeout: float = 600) -> int:
    """Runs the KFD model's two test programs (plain build) under valgrind's
    memcheck; returns the first non-zero exit status."""
    if not shutil.which("valgrind"):
        raise ModelBuildError("valgrind not found on PATH")
    base = str(Path(out_dir).resolve())
    for exe in (build_kfd_test(out_dir), build_kfd_shim_test(out_dir)):
        proc = subprocess.run([*VALGRIND, exe, base], timeout=timeout)
        if proc.returncode:
            return proc.returncode
    print("KFD MODEL TESTS PASSED under valgrind")
    return 0


def run_tests(out_dir: str | os.PathLike, sanitize: str | None = None, timeout: float = 600) -> int:
    """Builds and runs test_model.c, then test_kfd.c and test_kfd_shim.c;
    returns the first non-zero exit status (0 = all passed)."""
    exe = build_test(out_dir, sanitize)
    kfd_exe = build_kfd_test(out_dir, sanitize)
    # ThreadSanitizer's own stat/open interceptors cannot sit in front of the
    # shim's (it crashes); the shim has no threads of its own to check
    shim_exe = build_kfd_shim_test(out_dir, sanitize) if sanitize != "thread" else None
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("VRAMD_SDMA_MODEL_"):
            del env[k]
    if sanitize == "thread":
        env.setdefault("TSAN_OPTIONS", "halt_on_error=1 second_deadlock_stack=1")
    if sanitize == "address":
        env.setdefault("ASAN_OPTIONS", "detect_leaks=1 abort_on_error=1")
    proc = subprocess.run([exe], env=env, timeout=timeout)
    if proc.returncode:
        return proc.returncode
    # the KFD model's state directory (sparse arenas) goes under OUT_DIR
    proc = subprocess.run([kfd_exe, str(Path(out_dir).resolve())], env=env, timeout=timeout)
    if proc.returncode:
        return proc.returncode
    if shim_exe is None:
        print("KFD SHIM TESTS SKIPPED under ThreadSanitizer (run plain and with --asan)")
        return 0
    for k in ("VRAMD_KFD_STATE", "VRAMD_KFD_MAJOR"):
        env.pop(k, None)
    proc = subprocess.run([shim_exe, str(Path(out_dir).resolve())], env=env, timeout=timeout)
    return proc.returncode


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    opts = {a for a in argv if a.startswith("--")}
    unknown = opts - {"--test", "--tsan", "--asan", "--force", "--valgrind"}
    if len(args) != 1 or unknown:
        print(__doc__, file=sys.stderr)
        return 2
    if {"--tsan", "--asan"} <= opts:
        print("error: --tsan and --asan cannot be combined", file=sys.stderr)
        return 2
    sanitize = "thread" if "--tsan" in opts else "address" if "--asan" in opts else None
    try:
        if "--valgrind" in opts:
            return run_kfd_valgrind(args[0])
        if "--test" in opts:
            return run_tests(args[0], sanitize)
        print(build(args[0], sanitize, force="--force" in opts))
        return 0
    except ModelBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
