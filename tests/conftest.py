import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import open_dir  # noqa: E402


@pytest.fixture
def image_dir(tmp_path):
    """(path, fd) of an empty image directory; the fd is what the engine gets."""
    d = tmp_path / "image"
    d.mkdir()
    fd = open_dir(d)
    yield d, fd
    os.close(fd)
