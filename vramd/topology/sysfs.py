"""KFD topology, read from the tree the amdkfd driver exposes under /sys/class/kfd/kfd/topology/nodes.

One numbered directory per node: `gpu_id`, `name`, `properties`,
`mem_banks/K/properties`, `io_links/K/properties`, `p2p_links/K/properties`;
every `properties` file is "key value" lines.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from ..errors import TopologyError
from .model import Gpu, IoLink, Node, SkippedNode, Topology, make_node

log = logging.getLogger("vramd.topology")

DEFAULT_ROOT = "/sys/class/kfd/kfd/topology/nodes"


def render_node(gpu: Gpu) -> str:
    """The DRM render node of a GPU, "/dev/dri/renderD<minor>".

    A name for logs and worker-pool keys; vramd opens render nodes itself (for SDMA), never
    a path a client names. Minors below 128 are not render nodes (CRIU also caps at 255;
    no upper bound is enforced here).
    """
    if not isinstance(gpu, Gpu):
        raise TopologyError(f"node {getattr(gpu, 'index', gpu)!r} is not a GPU: it has no render node")
    minor = gpu.render_minor
    if minor < 128:
        raise TopologyError(f"drm_render_minor {minor} is not a render node minor (>= 128)")
    return f"/dev/dri/renderD{minor}"



def parse_properties(text: str, where: str = "properties") -> dict[str, int]:
    """Parse a KFD `properties` file: one "key value" line each, value a decimal integer.

    A line that does not have that shape is logged and left out (CRIU rejects the file).
    """
    props: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) == 2 and parts[1].isascii() and parts[1].isdigit():
            props[parts[0]] = int(parts[1])
        else:
            log.warning("%s:%d: not a 'key value' line, ignored: %r", where, lineno, line)
    return props


def _read(path: Path) -> str:
    with open(path, encoding="ascii", errors="replace") as f:
        return f.read()


def _numeric_dirs(path: Path) -> list[tuple[int, Path]]:
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return []
    return sorted((int(n), path / n) for n in names if n.isdigit())


def _read_entries(path: Path) -> list[dict[str, int]]:
    """properties of every numbered subdirectory of `path` (mem_banks, io_links, p2p_links)."""
    out = []
    for _, sub in _numeric_dirs(path):
        try:
            out.append(parse_properties(_read(sub / "properties"), str(sub / "properties")))
        except OSError as e:  # e.g. a link to a device this cgroup may not see
            log.info("skipping %s: %s", sub, e.strerror or e)
    return out


def _links(entries: list[dict[str, int]], owner: int, where: Path, p2p: bool) -> list[IoLink]:
    links = []
    for props in entries:
        try:
            links.append(IoLink.from_properties(props, owner, p2p=p2p))
        except ValueError:
            log.warning("%s: a link without node_to, ignored", where)
    return links


def parse_topology(root: str | os.PathLike[str] = DEFAULT_ROOT) -> Topology:
    """Read the KFD topology under `root` (a `.../topology/nodes` directory).

    A node whose directory, `gpu_id` or `properties` cannot be read is skipped and recorded
    in `Topology.skipped`: that is what cgroup device masking looks like (the kernel answers
    EPERM for GPUs the cgroup hides), and CRIU skips such nodes too.
    """
    root = Path(root)
    try:
        entries = _numeric_dirs(root) if root.is_dir() else None
    except OSError as e:
        raise TopologyError(f"cannot list {root}: {e.strerror or e}") from None
    if entries is None:
        raise TopologyError(f"no KFD topology at {root} (amdkfd not loaded?)")
    nodes: list[Node] = []
    skipped: list[SkippedNode] = []
    for index, path in entries:
        try:
            if not path.is_dir():
                raise NotADirectoryError(f"{path} is not a directory")
            gpu_id_text = _read(path / "gpu_id").strip()
            if not (gpu_id_text.isascii() and gpu_id_text.isdigit()):
                raise ValueError(f"gpu_id {gpu_id_text!r} is not a number")
            gpu_id = int(gpu_id_text)
            props = parse_properties(_read(path / "properties"), str(path / "properties"))
        except (OSError, ValueError) as e:
            reason = (f"{e.strerror}: {e.filename}" if isinstance(e, OSError) and e.strerror else str(e))
            log.info("skipping topology node %s: %s", path, reason)
            skipped.append(SkippedNode(index, reason))
            continue
        try:
            name = _read(path / "name").strip()
        except OSError:
            name = ""
        nodes.append(make_node(
            index, gpu_id, name=name, properties=props,
            mem_banks=_read_entries(path / "mem_banks"),
            io_links=_links(_read_entries(path / "io_links"), index, path / "io_links", False),
            p2p_links=_links(_read_entries(path / "p2p_links"), index, path / "p2p_links", True),
        ))
    return Topology(nodes, skipped, str(root))
