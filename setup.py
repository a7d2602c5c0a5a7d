"""Build hooks pyproject.toml cannot express: the cffi modules and the SDMA model.

- vramd.hostmem._copy (native/copy_build.py): the CPU backends' per-batch copy loop in
  C (copy, zero scan, xxh3 in one call without the GIL).  Built wherever a C compiler,
  the Python headers and <xxhash.h> (Debian: libxxhash-dev) exist; without it vramd
  runs the same loop in Python (vramd.hostmem.batchcopy).  VRAMD_BUILD_NATIVE=0 skips
  it too.

- vramd.backends.sdma._amdgpu (native/amdgpu_build.py): built when pkg-config finds
  libdrm_amdgpu (Debian: libdrm-dev).  Without it vramd installs and runs,
  and the SDMA backend reports itself unavailable with the reason.
  VRAMD_BUILD_NATIVE=0 skips it on purpose.
- vramd/_model/libdrm_amdgpu_model.so (native/model/): the software model of
  libdrm_amdgpu + SDMA that the backend is verified against here.  Not part
  of a production build: built only when VRAMD_BUILD_MODEL=1 (dev.sh and CI
  set it) and the same headers are present.
"""
import importlib.util
import os
import subprocess

from setuptools import setup
from setuptools.command.build_ext import build_ext


def have_libdrm_amdgpu() -> bool:
    try:
        return subprocess.run(["pkg-config", "--exists", "libdrm_amdgpu"]).returncode == 0
    except FileNotFoundError:
        return False


def have_header(name: str) -> bool:
    """True when the C compiler finds <name> (it preprocesses an #include of it)."""
    cc = os.environ.get("CC", "cc").split()
    try:
        return subprocess.run([*cc, "-E", "-x", "c", "-o", os.devnull, "-"], input=f"#include <{name}>\n".encode(),
                              stderr=subprocess.DEVNULL).returncode == 0
    except FileNotFoundError:
        return False


BUILD = os.environ.get("VRAMD_BUILD_NATIVE", "1") != "0"
NATIVE = BUILD and have_libdrm_amdgpu()
COPY = BUILD and have_header("xxhash.h")
MODEL = NATIVE and os.environ.get("VRAMD_BUILD_MODEL") == "1"


class BuildExtWithModel(build_ext):
    def run(self):
        super().run()
        if not MODEL:
            return
        spec = importlib.util.spec_from_file_location("vramd_model_build", "native/model/build.py")
        model_build = importlib.util.module_from_spec(spec)  # not `import build`: PyPA's build may be loaded
        spec.loader.exec_module(model_build)
        base = "." if self.inplace or getattr(self, "editable_mode", False) else self.build_lib
        model_build.build(os.path.join(base, "vramd", "_model"))


setup(
    cffi_modules=(["native/amdgpu_build.py:ffibuilder"] if NATIVE else [])
    + (["native/copy_build.py:ffibuilder"] if COPY else []),
    cmdclass={"build_ext": BuildExtWithModel},
)
