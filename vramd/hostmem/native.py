"""The optional C module vramd.hostmem._copy, and the one switch that sets it aside.

native/copy/ is built into a cffi API-mode module at install time where a
compiler and <xxhash.h> are present (native/copy_build.py).  The batch copier
(batchcopy.py) and the byte-plane transform (image/planes.py) use it where it
is there, and otherwise run the same loops in Python, with identical results.

`module()` answers at every call, not once at import, so `python_only()` can
set the module aside: while it is held, every caller, in every thread, takes
its pure-Python path.  That is how the tests run both paths against each other
(vramd.testing.python_copier); nothing else holds it.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

try:
    from . import _copy as _built  # type: ignore[attr-defined]  # built by native/copy_build.py
except ImportError:  # no compiler or no <xxhash.h> at install time
    _built = None

BUILT: bool = _built is not None  # the module is installed (whether or not it is set aside now)

_lock = threading.Lock()
_set_aside = 0  # python_only() blocks now open


def built() -> Any:
    """The installed module, or None (set aside or not: batchcopy checks its layout once, at import)."""
    return _built


def module() -> Any:
    """The module to call now, or None: run the pure-Python path (not installed, or `python_only()` holds)."""
    return None if _set_aside else _built


@contextmanager
def python_only() -> Iterator[None]:
    """While held, `module()` is None: the batch copier and the byte-plane transform run in Python."""
    global _set_aside
    with _lock:
        _set_aside += 1
    try:
        yield
    finally:
        with _lock:
            _set_aside -= 1
