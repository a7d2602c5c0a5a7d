"""The SDMA backend: packets (pure), binding (libdrm_amdgpu through cffi), device (one GPU), backend.

Importing this package loads no library: the binding is loaded when the
backend is created (`SdmaBackend.create`), so machines without libdrm_amdgpu
import it fine and list the backend as unavailable, with the reason.
"""
from .backend import SdmaBackend

__all__ = ["SdmaBackend"]
