"""libdrm_amdgpu as the SDMA backend and its GPUs call it: the loaded binding and what a call's result means.

Both the backend (backend.py) and each GPU it drives (device.py) make libdrm
calls; they share one `Driver`, below both, so neither reaches into the
other for its error handling.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from ...errors import BackendError

if TYPE_CHECKING:
    from ._amdgpu import _FFI, _Lib

log = logging.getLogger("vramd.backends.sdma")


class Driver:
    """The binding (`ffi`, `lib`) one backend calls, and whether it is the software model."""

    def __init__(self, ffi: _FFI, lib: _Lib, *, model: bool) -> None:
        self.ffi, self.lib, self.model = ffi, lib, model

    def rc(self, rc: int, call: str, *, bo_id: int | None = None, offset: int | None = None) -> None:
        """A libdrm call's return code: nothing when it succeeded, else a BackendError naming the call."""
        if rc:
            raise BackendError(f"{call} failed: {os.strerror(-rc) if rc < 0 else rc} ({rc})"
                               f"{' [software model]' if self.model else ''}", bo_id=bo_id, offset=offset)

    @staticmethod
    def cleanup(rc: int, call: str) -> None:
        """A failing teardown call is logged, never raised: it must not replace the error that got us here."""
        if rc:
            log.warning("sdma cleanup: %s failed (%d)", call, rc)
