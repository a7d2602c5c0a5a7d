"""libdrm_amdgpu through the cffi binding (vramd.backends.sdma._amdgpu), library chosen at run time.

The binding is compiled against the real <amdgpu.h> and linked against
libdrm_amdgpu.so.1.  Which library serves the calls is decided when the
binding is first loaded, without code changes:

    VRAMD_AMDGPU_LIBRARY unset or ""   the system's libdrm_amdgpu (real GPUs)
    VRAMD_AMDGPU_LIBRARY=model         vramd's software model of libdrm_amdgpu + SDMA
    VRAMD_AMDGPU_LIBRARY=/path/lib.so  any library with soname libdrm_amdgpu.so.1

A library other than the system's is loaded first, RTLD_GLOBAL: the dynamic
linker then resolves the binding's libdrm_amdgpu.so.1 to it.  Everything
measured through the model is a model number, never a hardware one.
"""
from __future__ import annotations

import ctypes
import importlib
import os
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._amdgpu import _FFI, _Lib

LIBRARY_ENV = "VRAMD_AMDGPU_LIBRARY"
BINDING = "vramd.backends.sdma._amdgpu"
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_PATH = os.path.join(_PACKAGE_ROOT, "_model", "libdrm_amdgpu_model.so")

_lock = threading.Lock()
_loaded: dict[str, Any] = {}


class Unavailable(Exception):
    """The binding or the library cannot be used here; the message says why and what to install."""


def resolve(library: str | None) -> str:
    choice = os.environ.get(LIBRARY_ENV, "") if library is None else library
    return MODEL_PATH if choice == "model" else choice


def load(library: str | None = None) -> tuple[_FFI, _Lib, str]:
    """(ffi, lib, path) for the chosen library (typed by _amdgpu.pyi); raises Unavailable with the reason."""
    path = resolve(library)
    with _lock:
        if "lib" in _loaded:
            if _loaded["path"] != path:
                raise Unavailable(f"libdrm_amdgpu already loaded from {_loaded['path'] or 'the system'}; "
                                  f"cannot switch to {path or 'the system library'} in the same process")
            return _loaded["ffi"], _loaded["lib"], path
        if BINDING in sys.modules:
            raise Unavailable(f"{BINDING} was imported directly, bound to an unknown library; "
                              "use vramd.backends.sdma.binding.load()")
        if path:
            if not os.path.exists(path):
                hint = " (build it: pip install -e . with libdrm-dev installed)" if path == MODEL_PATH else ""
                raise Unavailable(f"{path} does not exist{hint}")
            try:
                ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
            except OSError as e:
                raise Unavailable(f"cannot load {path}: {e}") from None
        try:  # by name: the compiled module only, never this package's modules above the binding
            amdgpu = importlib.import_module(BINDING)
        except ImportError as e:
            raise Unavailable(
                f"the libdrm_amdgpu binding is not usable: {e}. Install libdrm-dev (Debian; provides "
                "amdgpu.h and libdrm_amdgpu.pc) and reinstall vramd to build it") from None
        ffi: _FFI = amdgpu.ffi
        lib: _Lib = amdgpu.lib
        _loaded.update(ffi=ffi, lib=lib, path=path)
        return ffi, lib, path


def is_model(path: str) -> bool:
    return os.path.abspath(path) == MODEL_PATH if path else False
