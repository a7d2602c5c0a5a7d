"""pytest fixtures for the real registry (vramd/testing/registry.py); tests/conftest.py imports them.

- `registry_pki` (session): a CA made for this test session; `other_pki` (session): a second, unrelated CA
  (a certificate from it must be refused);
- `make_registry` (function): a factory, `make_registry(tls=True, auth="htpasswd", users=..., ...)`;
  every registry it made is stopped (and its tmpfs unmounted) at the test's end;
- `registry` (plain HTTP), `tls_registry`, `htpasswd_registry` (TLS + bcrypt users), `token_registry`
  (TLS + our token server): one fresh registry each, users `REGISTRY_USERS`.
dev.sh installs docker-registry, skopeo and htpasswd: a machine without them fails these tests loudly.
"""
from __future__ import annotations

import itertools
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from vramd.testing.pki import Pki
from vramd.testing.registry import Registry

REGISTRY_USERS = {"alice": "correct-horse-battery-staple-7f3a", "bob": "hunter2-but-longer-91c0"}


@pytest.fixture(scope="session")
def registry_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    for tool in ("docker-registry", "openssl", "htpasswd"):
        assert shutil.which(tool), f"{tool} is missing: ./dev.sh installs it (docker-registry, apache2-utils)"
    return Pki(tmp_path_factory.mktemp("pki"), "vramd test CA")


@pytest.fixture(scope="session")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("other-pki"), "some other CA")


@pytest.fixture
def make_registry(tmp_path_factory: pytest.TempPathFactory, registry_pki: Pki) -> Iterator[Any]:
    made: list[Registry] = []
    counter = itertools.count()

    def make(*, tls: bool = False, pki: Pki | None = None, **kw: Any) -> Registry:
        reg = Registry(tmp_path_factory.mktemp(f"registry{next(counter)}"),
                       pki=pki or (registry_pki if tls or kw.get("auth") == "token" else None), **kw)
        made.append(reg)
        return reg

    yield make
    for reg in made:
        reg.close()


@pytest.fixture
def registry(make_registry: Any) -> Registry:
    return make_registry()


@pytest.fixture
def tls_registry(make_registry: Any) -> Registry:
    return make_registry(tls=True)


@pytest.fixture
def htpasswd_registry(make_registry: Any) -> Registry:
    return make_registry(tls=True, auth="htpasswd", users=REGISTRY_USERS)


@pytest.fixture
def token_registry(make_registry: Any) -> Registry:
    return make_registry(tls=True, auth="token", users=REGISTRY_USERS)
