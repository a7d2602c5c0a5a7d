"""A registry reference, HOST[:PORT]/REPO[:TAG][@sha256:...], parsed and checked before anything is asked of a
registry (vramctl's usage errors come from here)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import RegistryError
from .layout import DIGEST

REPO = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
HOST = re.compile(r"[A-Za-z0-9.-]+(?::[0-9]{1,5})?|\[[0-9a-fA-F:]+\](?::[0-9]{1,5})?")


@dataclass(frozen=True)
class Reference:
    """HOST[:PORT]/REPO[:TAG][@sha256:...], the form docker, podman and skopeo name an image with."""

    host: str
    repo: str
    tag: str | None = None
    digest: str | None = None

    @classmethod
    def parse(cls, text: str) -> Reference:
        rest = text.removeprefix("oci://")
        host, sep, rest = rest.partition("/")
        if "@" in host:  # user:password@host: never echoed, a message may be logged
            raise RegistryError("a reference holds no credentials (USER[:PASSWORD]@ before the host): give them with "
                                "--username and --password-stdin, or in a config.json")
        if not sep or HOST.fullmatch(host) is None:
            raise RegistryError(f"{text!r} is not a reference HOST[:PORT]/REPOSITORY[:TAG|@DIGEST]")
        if "." not in host and ":" not in host and host != "localhost":  # docker's rule for a first component
            raise RegistryError(f"{text!r}: name the registry: HOST[:PORT]/{text.removeprefix('oci://')} (no "
                                "default registry is assumed)")
        digest = None
        if "@" in rest:
            rest, digest = rest.split("@", 1)
            if DIGEST.fullmatch(digest) is None:
                raise RegistryError(f"{text!r}: the digest is not sha256:<64 hex>")
        tag = None
        if ":" in rest:
            rest, tag = rest.rsplit(":", 1)
            if TAG.fullmatch(tag) is None:
                raise RegistryError(f"{text!r}: {tag!r} is not a tag")
        if REPO.fullmatch(rest) is None:
            raise RegistryError(f"{text!r}: {rest!r} is not a repository name (lowercase, digits, . _ - /)")
        return cls(host, rest, tag, digest)

    @property
    def ref(self) -> str:
        """The manifest reference: the digest where there is one, else the tag (default latest)."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        return f"{self.host}/{self.repo}" + (f":{self.tag}" if self.tag else "") + (
            f"@{self.digest}" if self.digest else "")
