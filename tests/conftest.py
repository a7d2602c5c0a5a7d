import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import open_dir
from registry_fixtures import (  # noqa: F401
    htpasswd_registry,
    make_registry,
    other_pki,
    registry,
    registry_pki,
    tls_registry,
    token_registry,
)


@pytest.fixture(scope="session", autouse=True)
def _private_cache_home(tmp_path_factory):
    """The tests' vramctl (push's skeleton cache, restore oci://'s pull cache) caches under a directory of this
    run's, never the user's ~/.cache: a test that names no --cache must not leave files there."""
    old = os.environ.get("XDG_CACHE_HOME")
    d = tmp_path_factory.mktemp("xdg-cache")
    os.chmod(d, 0o1777)  # as /tmp: the unprivileged users some tests run vramctl as
    os.environ["XDG_CACHE_HOME"] = str(d)
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture
def image_dir(tmp_path):
    """(path, fd) of an empty image directory; the fd is what the engine gets."""
    d = tmp_path / "image"
    d.mkdir()
    fd = open_dir(d)
    yield d, fd
    os.close(fd)


@pytest.fixture
def run_dir():
    """A short directory for sockets (sun_path is 108 bytes), others may enter."""
    import shutil
    import tempfile
    d = tempfile.mkdtemp(prefix="vramd-t", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(run_dir):
    """A running daemon with a short grace period and small budget."""
    from vramd.testing import DaemonProcess
    with DaemonProcess(run_dir, "--grace-period", "0.3", "--staging-budget", "64M", "--chunk-size", "1M") as d:
        yield d
