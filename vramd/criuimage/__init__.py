"""CRIU's stock amdgpu plugin's image files, as vramctl import-criu and export-criu read and write them.

Client-side code (it opens names in a checkpoint directory): nothing the daemon runs imports it."""
from .stock import (
    BO_NAME,
    BO_NAME_PREFIX,
    HEADER,
    VRAMD_DIR,
    PagesFile,
    StockBo,
    StockLayout,
    check_pages_file,
    layout,
    open_plain,
)

__all__ = ["BO_NAME", "BO_NAME_PREFIX", "HEADER", "VRAMD_DIR", "PagesFile", "StockBo", "StockLayout",
           "check_pages_file", "layout", "open_plain"]
