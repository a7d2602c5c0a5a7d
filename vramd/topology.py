"""KFD topology: which GPUs and CPUs a machine has, and where checkpointed GPUs go on restore.

Reads the tree the amdkfd driver exposes under /sys/class/kfd/kfd/topology/nodes (one
numbered directory per node: `gpu_id`, `name`, `properties`, `mem_banks/K/properties`,
`io_links/K/properties`, `p2p_links/K/properties`; every `properties` file is "key value"
lines). A `Topology` round-trips through a plain dict, so an image can carry the
checkpoint machine's topology, and `map_gpus()` maps its GPUs onto the GPUs present at
restore with the rules and switches of CRIU's amdgpu plugin (docs/topology.md).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Iterator, Mapping

from .errors import VramdError
from .units import format_size

log = logging.getLogger(__name__)

DEFAULT_ROOT = "/sys/class/kfd/kfd/topology/nodes"

FORMAT = "vramd.kfd-topology"
FORMAT_VERSION = 1

# io link types: CRAT_IOLINK_TYPE_* in the kernel's amdkfd/kfd_crat.h
IOLINK_TYPE_PCIE = 2
IOLINK_TYPE_XGMI = 11
IOLINK_TYPE_NAMES = {
    0: "undefined", 1: "HyperTransport", 2: "PCIe", 3: "AMBA", 4: "MIPI", 5: "QPI",
    8: "RapidIO", 9: "InfiniBand", 11: "XGMI", 12: "XGOP", 13: "GZ",
    14: "Ethernet-RDMA", 15: "RDMA-other", 16: "other",
}
# Only these take part in mapping, as in CRIU (other kinds, e.g. CPU-CPU links, are kept but ignored).
MAPPED_LINK_TYPES = (IOLINK_TYPE_PCIE, IOLINK_TYPE_XGMI)

# mem_banks heap types (HSA_MEM_HEAP_TYPE_*)
HEAP_TYPE_SYSTEM = 0
HEAP_TYPE_FB_PUBLIC = 1
HEAP_TYPE_FB_PRIVATE = 2

# Node properties CRIU saves in its image (kfd_device_entry) and compares; we keep every key,
# these are the ones the mapping looks at.
EXACT_MATCH_KEYS = (
    "simd_count", "mem_banks_count", "io_links_count", "max_waves_per_simd", "lds_size_in_kb",
    "wave_front_size", "array_count", "simd_arrays_per_engine", "cu_per_simd_array", "simd_per_cu",
    "max_slots_scratch_cu", "vendor_id", "device_id", "num_sdma_engines", "num_sdma_xgmi_engines",
    "num_sdma_queues_per_engine", "num_cp_queues",
)
_HEX_KEYS = frozenset({"vendor_id", "device_id", "capability"})

# Checks field -> the CRIU environment variable that switches it.
CHECK_ENV = {
    "fw_version": "KFD_FW_VER_CHECK",
    "sdma_fw_version": "KFD_SDMA_FW_VER_CHECK",
    "caches_count": "KFD_CACHES_COUNT_CHECK",
    "num_gws": "KFD_NUM_GWS_CHECK",
    "vram_size": "KFD_VRAM_SIZE_CHECK",
    "numa": "KFD_NUMA_CHECK",
    "capability": "KFD_CAPABILITY_CHECK",
}

MAX_SEARCH_STEPS = 200_000


class TopologyError(VramdError):
    """The topology could not be read, or a saved one is malformed."""

    code = "TOPOLOGY_ERROR"


class TopologyMismatchError(TopologyError):
    """The checkpoint's GPUs cannot be mapped onto the GPUs present; the message says why.

    `unplaced` maps each checkpoint gpu_id that could not be placed to {candidate gpu_id:
    [reasons]} (empty where the failure is not about single GPUs, e.g. unequal counts).
    """

    code = "TOPOLOGY_MISMATCH"
    unplaced: Mapping[int, Mapping[int, list[str]]] = MappingProxyType({})

    def __init__(self, message: str, *, unplaced: Mapping[int, Mapping[int, list[str]]] | None = None, **kw):
        if unplaced is not None:
            self.unplaced = unplaced
        super().__init__(message, **kw)


# --- model ------------------------------------------------------------------

@dataclass
class IoLink:
    """One `io_links/K` (or `p2p_links/K`) entry: a directed link node_from -> node_to."""

    node_from: int
    node_to: int
    type: int
    properties: dict[str, int] = field(default_factory=dict)
    p2p: bool = False  # from p2p_links/ (PCIe peer access); not used for mapping, as in CRIU

    @classmethod
    def from_properties(cls, props: dict[str, int], owner: int, *, p2p: bool = False) -> IoLink:
        if "node_to" not in props:
            raise ValueError("no node_to")
        return cls(props.get("node_from", owner), props["node_to"], props.get("type", 0), dict(props), p2p)

    @property
    def type_name(self) -> str:
        return IOLINK_TYPE_NAMES.get(self.type, f"type {self.type}")

    @property
    def is_xgmi(self) -> bool:
        return self.type == IOLINK_TYPE_XGMI

    @property
    def is_pcie(self) -> bool:
        return self.type == IOLINK_TYPE_PCIE

    @property
    def weight(self) -> int:
        return self.properties.get("weight", 0)

    @property
    def min_bandwidth(self) -> int:
        return self.properties.get("min_bandwidth", 0)

    @property
    def max_bandwidth(self) -> int:
        return self.properties.get("max_bandwidth", 0)

    @property
    def recommended_sdma_engine_id_mask(self) -> int | None:
        """SDMA engines the driver recommends for copies over this link (None: kernel too old)."""
        return self.properties.get("recommended_sdma_engine_id_mask")


@dataclass
class Node:
    """One topology node: `index` is its directory number under nodes/."""

    index: int
    gpu_id: int
    properties: dict[str, int] = field(default_factory=dict)
    mem_banks: list[dict[str, int]] = field(default_factory=list)
    io_links: list[IoLink] = field(default_factory=list)
    p2p_links: list[IoLink] = field(default_factory=list)
    name: str = ""

    @property
    def is_gpu(self) -> bool:
        return self.gpu_id != 0

    def prop(self, key: str, default: int = 0) -> int:
        return self.properties.get(key, default)

    @property
    def cpu_cores_count(self) -> int:
        return self.prop("cpu_cores_count")

    def to_dict(self) -> dict:
        return {
            "node": self.index, "gpu_id": self.gpu_id, "name": self.name,
            "properties": dict(self.properties),
            "mem_banks": [dict(b) for b in self.mem_banks],
            "io_links": [dict(link.properties) for link in self.io_links],
            "p2p_links": [dict(link.properties) for link in self.p2p_links],
        }


@dataclass
class Cpu(Node):
    """A CPU node (gpu_id 0); GPUs hang off it through PCIe links."""


@dataclass
class Gpu(Node):
    """A GPU node. VRAM comes from mem_banks (the `local_mem_size` property is always 0)."""

    @property
    def node(self) -> int:
        return self.index

    @property
    def render_minor(self) -> int:
        return self.prop("drm_render_minor")

    @property
    def hive_id(self) -> int:
        return self.prop("hive_id")

    @property
    def vendor_id(self) -> int:
        return self.prop("vendor_id")

    @property
    def device_id(self) -> int:
        return self.prop("device_id")

    @property
    def location_id(self) -> int:
        return self.prop("location_id")

    @property
    def domain(self) -> int:
        return self.prop("domain")

    @property
    def unique_id(self) -> int:
        return self.prop("unique_id")

    @property
    def num_sdma_engines(self) -> int:
        return self.prop("num_sdma_engines")

    @property
    def num_sdma_xgmi_engines(self) -> int:
        return self.prop("num_sdma_xgmi_engines")

    @property
    def num_sdma_queues_per_engine(self) -> int:
        return self.prop("num_sdma_queues_per_engine")

    def _vram_bank(self) -> dict[str, int] | None:
        # CRIU's rule: the first bank whose heap is frame buffer (public or private).
        for bank in self.mem_banks:
            if bank.get("heap_type") in (HEAP_TYPE_FB_PUBLIC, HEAP_TYPE_FB_PRIVATE):
                return bank
        return None

    @property
    def vram_bytes(self) -> int:
        bank = self._vram_bank()
        return bank.get("size_in_bytes", 0) if bank else 0

    @property
    def vram_public(self) -> bool:
        """True when all VRAM is CPU-visible (large BAR: heap FB_PUBLIC)."""
        bank = self._vram_bank()
        return bool(bank) and bank.get("heap_type") == HEAP_TYPE_FB_PUBLIC

    @property
    def recommended_sdma_engine_id_mask(self) -> dict[int, int]:
        """Peer node index -> recommended SDMA engine mask, from this GPU's io links.

        The kernel publishes the mask per link, not per GPU: on the link to a CPU it names
        the PCIe engines, on XGMI links to peers it may name a single engine per peer.
        """
        return {link.node_to: link.recommended_sdma_engine_id_mask for link in self.io_links
                if link.recommended_sdma_engine_id_mask is not None}

    def sdma_engine_mask(self, to_node: int) -> int | None:
        """The recommended SDMA engine mask for copies towards node `to_node`, if published."""
        return self.recommended_sdma_engine_id_mask.get(to_node)

    def label(self) -> str:
        return f"gpu {self.gpu_id:#06x} (node {self.index})"


def _make_node(index: int, gpu_id: int, **kw) -> Node:
    return (Gpu if gpu_id else Cpu)(index, gpu_id, **kw)


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


@dataclass
class SkippedNode:
    """A node directory that could not be read (cgroup device masking, or a half-gone device)."""

    index: int
    reason: str


@dataclass
class Topology:
    """Every readable node of one machine, in node-index order."""

    nodes: list[Node] = field(default_factory=list)
    skipped: list[SkippedNode] = field(default_factory=list)
    source: str = ""
    _by_index: dict[int, Node] = field(init=False, repr=False, compare=False)
    _by_gpu_id: dict[int, Gpu] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.nodes = sorted(self.nodes, key=lambda n: n.index)
        self._by_index = {}
        self._by_gpu_id = {}
        for n in self.nodes:
            if n.index in self._by_index:
                raise TopologyError(f"node {n.index} appears twice")
            self._by_index[n.index] = n
            if isinstance(n, Gpu):
                if n.gpu_id in self._by_gpu_id:
                    raise TopologyError(f"gpu_id {n.gpu_id:#06x} on nodes {self._by_gpu_id[n.gpu_id].index} and {n.index}")
                self._by_gpu_id[n.gpu_id] = n

    # -- lookups

    @property
    def gpus(self) -> list[Gpu]:
        return [n for n in self.nodes if isinstance(n, Gpu)]

    @property
    def cpus(self) -> list[Cpu]:
        return [n for n in self.nodes if isinstance(n, Cpu)]

    @property
    def links(self) -> list[IoLink]:
        """Every io link (not p2p link) of every readable node."""
        return [link for n in self.nodes for link in n.io_links]

    def node(self, index: int) -> Node | None:
        return self._by_index.get(index)

    def gpu(self, gpu_id: int) -> Gpu:
        try:
            return self._by_gpu_id[gpu_id]
        except KeyError:
            raise KeyError(f"no gpu {gpu_id:#06x}") from None

    def valid_links(self, node: Node) -> list[IoLink]:
        """`node`'s PCIe/XGMI io links whose far end is a readable node (CRIU's valid links)."""
        return [link for link in node.io_links
                if link.type in MAPPED_LINK_TYPES and link.node_to != node.index and link.node_to in self._by_index]

    def is_bidirectional(self, link: IoLink) -> bool:
        """The far node has a link of the same type back."""
        peer = self._by_index.get(link.node_to)
        return peer is not None and any(
            back.node_to == link.node_from and back.type == link.type for back in peer.io_links)

    def hives(self) -> list[list[Gpu]]:
        """XGMI hives: GPUs joined by two-way XGMI links (groups of two or more)."""
        parent = {g.index: g.index for g in self.gpus}

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for g in self.gpus:
            for link in self.valid_links(g):
                if link.is_xgmi and link.node_to in parent and self.is_bidirectional(link):
                    parent[root(link.node_to)] = root(g.index)
        groups: dict[int, list[Gpu]] = {}
        for g in self.gpus:
            groups.setdefault(root(g.index), []).append(g)
        return sorted((grp for grp in groups.values() if len(grp) > 1), key=lambda grp: grp[0].index)

    def cpu_of(self, gpu: Gpu) -> list[int]:
        """Indexes of the CPU nodes `gpu` has a valid link to (its NUMA node(s))."""
        return sorted({link.node_to for link in self.valid_links(gpu) if isinstance(self.node(link.node_to), Cpu)})

    def summary(self) -> str:
        hives = self.hives()
        parts = [f"{len(self.gpus)} GPU(s)", f"{len(self.cpus)} CPU node(s)"]
        if hives:
            parts.append(f"XGMI hives of {'+'.join(str(len(h)) for h in hives)}")
        if self.skipped:
            parts.append(f"{len(self.skipped)} node(s) unreadable: {', '.join(str(s.index) for s in self.skipped)}")
        return ", ".join(parts)

    def describe(self) -> str:
        """A multi-line listing for logs."""
        lines = [f"topology ({self.source or 'saved'}): {self.summary()}"]
        for n in self.nodes:
            if isinstance(n, Gpu):
                lines.append(
                    f"  node {n.index}: gpu {n.gpu_id:#06x} {n.name or '?'} device {n.device_id:#06x} "
                    f"renderD{n.render_minor} vram {format_size(n.vram_bytes)} "
                    f"sdma {n.num_sdma_engines}+{n.num_sdma_xgmi_engines} xgmi hive {n.hive_id:#x}")
            else:
                lines.append(f"  node {n.index}: cpu, {n.cpu_cores_count} cores")
            valid = self.valid_links(n)
            for link in n.io_links:
                note = ("" if self.is_bidirectional(link) else " (one-way)") if link in valid else \
                    (" (not visible)" if link.node_to not in self._by_index else " (ignored type)")
                lines.append(f"    -> node {link.node_to} {link.type_name}{note}")
        for s in self.skipped:
            lines.append(f"  node {s.index}: skipped: {s.reason}")
        return "\n".join(lines)

    # -- serialisation

    def to_dict(self) -> dict:
        """A JSON-able dict (ints, strings, lists, dicts) holding everything that was read."""
        return {
            "format": FORMAT, "version": FORMAT_VERSION, "source": self.source,
            "nodes": [n.to_dict() for n in self.nodes],
            "skipped": [{"node": s.index, "reason": s.reason} for s in self.skipped],
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> Topology:
        try:
            if d.get("format") != FORMAT:
                raise TopologyError(f"not a saved topology (format {d.get('format')!r})")
            if d.get("version") != FORMAT_VERSION:
                raise TopologyError(f"saved topology version {d.get('version')!r}, this vramd reads {FORMAT_VERSION}")
            nodes = []
            for nd in d["nodes"]:
                index = _as_int(nd["node"])
                nodes.append(_make_node(
                    index, _as_int(nd["gpu_id"]), name=str(nd.get("name", "")),
                    properties=_int_dict(nd.get("properties", {})),
                    mem_banks=[_int_dict(b) for b in nd.get("mem_banks", [])],
                    io_links=[IoLink.from_properties(_int_dict(p), index) for p in nd.get("io_links", [])],
                    p2p_links=[IoLink.from_properties(_int_dict(p), index, p2p=True) for p in nd.get("p2p_links", [])],
                ))
            skipped = [SkippedNode(_as_int(s["node"]), str(s["reason"])) for s in d.get("skipped", [])]
            return cls(nodes, skipped, str(d.get("source", "")))
        except TopologyError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise TopologyError(f"malformed saved topology: {type(e).__name__}: {e}") from None


def _as_int(v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"expected an integer, got {v!r}")
    return v


def _int_dict(d: Mapping) -> dict[str, int]:
    return {str(k): _as_int(v) for k, v in d.items()}


# --- reading sysfs ------------------------------------------------------------

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


def parse_topology(root: str | os.PathLike = DEFAULT_ROOT) -> Topology:
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
        nodes.append(_make_node(
            index, gpu_id, name=name, properties=props,
            mem_banks=_read_entries(path / "mem_banks"),
            io_links=_links(_read_entries(path / "io_links"), index, path / "io_links", False),
            p2p_links=_links(_read_entries(path / "p2p_links"), index, path / "p2p_links", True),
        ))
    return Topology(nodes, skipped, str(root))


# --- restore-time mapping -----------------------------------------------------

def _env_bool(value: str) -> bool | None:
    """CRIU's getenv_bool: "0"/"no" off, "1"/"yes" on (case-insensitive words); else None."""
    if value == "0" or value.lower() == "no":
        return False
    if value == "1" or value.lower() == "yes":
        return True
    return None


@dataclass(frozen=True)
class Checks:
    """Which relaxable checks `map_gpus` applies; all on by default, as in CRIU."""

    fw_version: bool = True       # present fw_version >= checkpoint's
    sdma_fw_version: bool = True  # present sdma_fw_version >= checkpoint's
    caches_count: bool = True     # present caches_count >= checkpoint's
    num_gws: bool = True          # present num_gws >= checkpoint's
    vram_size: bool = True        # present VRAM >= checkpoint's
    numa: bool = True             # checkpoint CPU nodes map one-to-one onto present ones
    capability: bool = True       # capability equal

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Checks:
        """Read CRIU's KFD_*_CHECK variables: 0/no switch a check off, 1/yes on; other values are ignored."""
        environ = os.environ if environ is None else environ
        values = {}
        for attr, var in CHECK_ENV.items():
            raw = environ.get(var)
            if raw is None:
                continue
            parsed = _env_bool(raw)
            if parsed is None:
                log.warning("ignoring %s=%r: expected 0/1/yes/no", var, raw)
                continue
            values[attr] = parsed
        return cls(**values)

    def replace(self, **kw) -> Checks:
        return dataclasses.replace(self, **kw)

    def disabled(self) -> list[str]:
        """The environment variables of the checks that are off."""
        return [var for attr, var in CHECK_ENV.items() if not getattr(self, attr)]


def _fmt(key: str, v: int) -> str:
    return f"{v:#x}" if key in _HEX_KEYS else str(v)


def compare_gpus(src: Gpu, dst: Gpu, checks: Checks = Checks()) -> list[str]:
    """Why `dst` cannot stand in for checkpoint GPU `src`, by properties alone ([] if it can)."""
    problems = []
    for key in EXACT_MATCH_KEYS:
        a, b = src.prop(key), dst.prop(key)
        if a != b:
            problems.append(f"{key} {_fmt(key, b)} != {_fmt(key, a)}")
    if src.vram_public != dst.vram_public:
        kind = {True: "public (large BAR)", False: "private"}
        problems.append(f"vram heap {kind[dst.vram_public]} != {kind[src.vram_public]}")
    if checks.capability and src.prop("capability") != dst.prop("capability"):
        problems.append(f"capability {dst.prop('capability'):#x} != {src.prop('capability'):#x} (KFD_CAPABILITY_CHECK)")
    if checks.vram_size and dst.vram_bytes < src.vram_bytes:
        problems.append(f"vram {format_size(dst.vram_bytes)} < {format_size(src.vram_bytes)} (KFD_VRAM_SIZE_CHECK)")
    for attr, key in (("num_gws", "num_gws"), ("caches_count", "caches_count"),
                      ("fw_version", "fw_version"), ("sdma_fw_version", "sdma_fw_version")):
        if getattr(checks, attr) and dst.prop(key) < src.prop(key):
            problems.append(f"{key} {dst.prop(key)} < {src.prop(key)} ({CHECK_ENV[attr]})")
    return problems


class _Exhausted(Exception):
    pass


class _Mapper:
    """Backtracking search for a placement of checkpoint GPUs on present GPUs.

    State: gpu_map (src index -> dst index), cpu_map (src CPU index -> dst CPU index, NUMA
    check only) and the dst nodes already used. Checkpoint hives are placed first, each
    inside one present hive at least as large; the other GPUs may go anywhere left.
    """

    def __init__(self, src: Topology, dst: Topology, checks: Checks, max_steps: int):
        self.src, self.dst, self.checks, self.max_steps = src, dst, checks, max_steps
        self.steps = 0
        self.gpu_map: dict[int, int] = {}
        self.used: set[int] = set()
        self.cpu_map: dict[int, int] = {}
        self.used_cpu: set[int] = set()
        self.used_hives: set[int] = set()
        self._problems: dict[tuple[int, int], list[str]] = {}
        self.src_valid = {g.index: src.valid_links(g) for g in src.gpus}
        self.dst_valid = {g.index: dst.valid_links(g) for g in dst.gpus}
        self.src_cpu_links = {i: [lk for lk in links if isinstance(src.node(lk.node_to), Cpu)]
                              for i, links in self.src_valid.items()}
        self.src_hives = src.hives()
        self.dst_hives = dst.hives()
        self.deepest: tuple[int, Gpu | None, dict[int, str]] = (-1, None, {})

    # -- per pair

    def _link_ok(self, sl: IoLink, dl: IoLink) -> bool:
        """CRIU's iolink_match: can present link dl stand in for checkpoint link sl?"""
        if isinstance(self.src.node(sl.node_to), Gpu) != isinstance(self.dst.node(dl.node_to), Gpu):
            return False
        if sl.is_xgmi and dl.is_pcie:
            return False
        if self.src.is_bidirectional(sl) and not self.dst.is_bidirectional(dl):
            return False
        return True

    def problems(self, s: Gpu, d: Gpu) -> list[str]:
        key = (s.index, d.index)
        if key not in self._problems:
            p = compare_gpus(s, d, self.checks)
            ns, nd = len(self.src_valid[s.index]), len(self.dst_valid[d.index])
            if ns > nd:
                p.append(f"{nd} usable io links < {ns}")
            for sl in self.src_cpu_links[s.index]:
                if not any(self._link_ok(sl, dl) for dl in self.dst_valid[d.index]):
                    p.append(f"no link to a CPU that can replace the {sl.type_name}"
                             f"{'' if self.src.is_bidirectional(sl) else ' one-way'} link to CPU node {sl.node_to}")
            self._problems[key] = p
        return self._problems[key]

    def _cpu_options(self, s: Gpu, d: Gpu) -> Iterator[dict[int, int]]:
        """The CPU-map extensions under which d can replace s (NUMA check on)."""
        if not self.checks.numa:
            yield {}
            return
        links = self.src_cpu_links[s.index]
        dlinks = self.dst_valid[d.index]

        def rec(i: int, added: dict[int, int]) -> Iterator[dict[int, int]]:
            if i == len(links):
                yield dict(added)
                return
            sl = links[i]
            target = self.cpu_map.get(sl.node_to, added.get(sl.node_to))
            if target is not None:
                if any(dl.node_to == target and dl.type == sl.type and self._link_ok(sl, dl) for dl in dlinks):
                    yield from rec(i + 1, added)
                return
            seen = set()
            for dl in dlinks:
                x = dl.node_to
                if x in seen or x in self.used_cpu or x in added.values() or not self._link_ok(sl, dl):
                    continue
                seen.add(x)
                added[sl.node_to] = x
                yield from rec(i + 1, added)
                del added[sl.node_to]

        yield from rec(0, {})

    def _numa_reason(self, s: Gpu, d: Gpu) -> str:
        for sl in self.src_cpu_links[s.index]:
            c = sl.node_to
            if c in self.cpu_map:
                return (f"checkpoint CPU node {c} already maps to CPU node {self.cpu_map[c]} here, "
                        f"which this GPU has no matching link to (KFD_NUMA_CHECK)")
        reach = sorted({dl.node_to for dl in self.dst_valid[d.index] if isinstance(self.dst.node(dl.node_to), Cpu)})
        taken = {x: c for c, x in self.cpu_map.items()}
        held = ", ".join(f"CPU node {x} stands for checkpoint CPU node {taken[x]}" for x in reach if x in taken)
        return f"its CPU node(s) {reach} are taken: {held} (KFD_NUMA_CHECK)"

    # -- search

    def _tick(self) -> None:
        self.steps += 1
        if self.steps > self.max_steps:
            raise _Exhausted

    def _ordered(self, s: Gpu, pool: list[Gpu]) -> list[Gpu]:
        # Same gpu_id first, then same PCI location, then same node index: identity where possible.
        return sorted(pool, key=lambda d: (d.gpu_id != s.gpu_id, (d.domain, d.location_id) != (s.domain, s.location_id),
                                           d.index != s.index, d.index))

    def _assign(self, srcs: list[Gpu], pool: list[Gpu], then: Callable[[], bool]) -> bool:
        if not srcs:
            return then()
        s, rest = srcs[0], srcs[1:]
        why: dict[int, str] = {}
        for d in self._ordered(s, pool):
            if d.index in self.used:
                owner = next(si for si, di in self.gpu_map.items() if di == d.index)
                why[d.index] = f"compatible, but taken by gpu {self.src.node(owner).gpu_id:#06x}" \
                    if not self.problems(s, d) else "; ".join(self.problems(s, d))
                continue
            if self.problems(s, d):
                why[d.index] = "; ".join(self.problems(s, d))
                continue
            tried = False
            for added in self._cpu_options(s, d):
                tried = True
                self._tick()
                self.gpu_map[s.index] = d.index
                self.used.add(d.index)
                self.cpu_map.update(added)
                self.used_cpu.update(added.values())
                if self._assign(rest, pool, then):
                    return True
                for c, x in added.items():
                    del self.cpu_map[c]
                    self.used_cpu.discard(x)
                self.used.discard(d.index)
                del self.gpu_map[s.index]
            why[d.index] = ("placeable, but then the remaining GPUs could not be placed" if tried
                            else self._numa_reason(s, d))
        depth = len(self.gpu_map)
        if depth > self.deepest[0]:
            self.deepest = (depth, s, why)
        return False

    def _place_hives(self, i: int, then: Callable[[], bool]) -> bool:
        if i == len(self.src_hives):
            return then()
        sh = self.src_hives[i]
        for j, dh in enumerate(self.dst_hives):
            if j in self.used_hives or len(dh) < len(sh):
                continue
            self.used_hives.add(j)
            if self._assign(sh, dh, lambda: self._place_hives(i + 1, then)):
                return True
            self.used_hives.discard(j)
        return False

    def search(self) -> dict[int, int] | None:
        in_hive = {g.index for h in self.src_hives for g in h}
        loose = [g for g in self.src.gpus if g.index not in in_hive]
        if self._place_hives(0, lambda: self._assign(loose, self.dst.gpus, lambda: True)):
            return {self.src.node(s).gpu_id: self.dst.node(d).gpu_id for s, d in self.gpu_map.items()}
        return None


def _max_matching(src: list[Gpu], dst: list[Gpu], ok: Callable[[Gpu, Gpu], bool]) -> dict[int, int]:
    """Maximum bipartite matching (dst index -> src index) of the pairwise-compatible pairs."""
    owner: dict[int, int] = {}
    by_index = {s.index: s for s in src}

    def augment(s: Gpu, seen: set[int]) -> bool:
        for d in dst:
            if d.index in seen or not ok(s, d):
                continue
            seen.add(d.index)
            if d.index not in owner or augment(by_index[owner[d.index]], seen):
                owner[d.index] = s.index
                return True
        return False

    for s in src:
        augment(s, set())
    return owner


def _hive_sizes(hives: list[list[Gpu]]) -> str:
    return ", ".join(str(len(h)) for h in hives) or "none"


def map_gpus(checkpoint: Topology, present: Topology, checks: Checks | None = None, *,
             max_steps: int = MAX_SEARCH_STEPS) -> dict[int, int]:
    """Map every checkpoint gpu_id to a present gpu_id, following CRIU's amdgpu plugin rules.

    Raises TopologyMismatchError with a report when no mapping exists.
    """
    checks = Checks() if checks is None else checks
    src_gpus, dst_gpus = checkpoint.gpus, present.gpus
    head = f"cannot map the checkpoint's {len(src_gpus)} GPU(s) onto the {len(dst_gpus)} GPU(s) here"
    notes = [f"checkpoint: {checkpoint.summary()}", f"here: {present.summary()}"]
    if len(src_gpus) != len(dst_gpus):
        raise TopologyMismatchError("\n".join([head, "the GPU counts must be equal", *notes]))
    mapper = _Mapper(checkpoint, present, checks, max_steps)
    if len(mapper.src_hives) > len(mapper.dst_hives):
        raise TopologyMismatchError("\n".join([
            head, f"the checkpoint has {len(mapper.src_hives)} XGMI hive(s) (sizes {_hive_sizes(mapper.src_hives)}), "
                  f"here {len(mapper.dst_hives)} (sizes {_hive_sizes(mapper.dst_hives)})", *notes]))
    try:
        result = mapper.search()
    except _Exhausted:
        raise TopologyMismatchError("\n".join([
            head, f"gave up after {max_steps} placements without finding a mapping", *notes])) from None
    if result is not None:
        log.info("gpu map: %s", ", ".join(f"{s:#06x}->{d:#06x}" for s, d in sorted(result.items())))
        return result
    raise _mismatch(checkpoint, present, checks, mapper, head, notes, max_steps)


def _mismatch(checkpoint: Topology, present: Topology, checks: Checks, mapper: _Mapper,
              head: str, notes: list[str], max_steps: int) -> TopologyMismatchError:
    lines = [head]
    unplaced: dict[int, dict[int, list[str]]] = {}
    owner = _max_matching(checkpoint.gpus, present.gpus, lambda s, d: not mapper.problems(s, d))
    matched = set(owner.values())
    stuck = [s for s in checkpoint.gpus if s.index not in matched]
    if stuck:
        # Even ignoring NUMA and hives, some GPU has no candidate left.
        for s in stuck:
            lines.append(f"{s.label()} cannot be placed:")
            unplaced[s.gpu_id] = {}
            for d in present.gpus:
                reasons = mapper.problems(s, d) or [
                    f"compatible, but needed by gpu {checkpoint.node(owner[d.index]).gpu_id:#06x}"]
                unplaced[s.gpu_id][d.gpu_id] = list(reasons)
                lines.append(f"  candidate {d.gpu_id:#06x} (node {d.index}): {'; '.join(reasons)}")
    hints = _hints(checkpoint, present, checks, max_steps)
    if not stuck:
        _, s, why = mapper.deepest
        numa_alone = any("KFD_NUMA_CHECK" in h for h in hints)
        if mapper.src_hives and not numa_alone:
            lines.append(f"each checkpoint XGMI hive (sizes {_hive_sizes(mapper.src_hives)}) must fit in one hive "
                         f"here (sizes {_hive_sizes(mapper.dst_hives)})")
        if checks.numa:
            lines.append("each checkpoint CPU node must map to one CPU node here (KFD_NUMA_CHECK); GPUs per CPU node: "
                         f"checkpoint {_numa_shape(checkpoint)}, here {_numa_shape(present)}")
        if s is not None:
            lines.append(f"{s.label()} cannot be placed:")
            unplaced[s.gpu_id] = {}
            for d in present.gpus:
                reason = why.get(d.index, "outside the hive being filled")
                unplaced[s.gpu_id][d.gpu_id] = [reason]
                lines.append(f"  candidate {d.gpu_id:#06x} (node {d.index}): {reason}")
    lines += hints
    lines += notes
    return TopologyMismatchError("\n".join(lines), unplaced=unplaced)


def _numa_shape(t: Topology) -> str:
    """How many GPUs hang off each CPU node, e.g. "{0: 4, 1: 4}"."""
    per: dict[int, int] = {c.index: 0 for c in t.cpus}
    for g in t.gpus:
        for c in t.cpu_of(g):
            per[c] += 1
    return "{" + ", ".join(f"{c}: {n}" for c, n in per.items()) + "}"


def _hints(checkpoint: Topology, present: Topology, checks: Checks, max_steps: int) -> list[str]:
    """Which single check, switched off, would let a mapping exist."""
    hints = []
    budget = max(1, max_steps // 10)
    for attr, var in CHECK_ENV.items():
        if not getattr(checks, attr):
            continue
        try:
            if _Mapper(checkpoint, present, checks.replace(**{attr: False}), budget).search() is not None:
                hints.append(f"hint: a mapping exists with {var}=0")
        except _Exhausted:
            pass
    return hints
