"""KFD topology, the model: the nodes (CPUs, GPUs) of one machine and their links, as plain values.

A `Topology` round-trips through a plain dict, so an image can carry the
checkpoint machine's topology (sysfs.py reads one from the kernel;
mapping.py maps a checkpoint's GPUs onto the present ones).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import TopologyError
from ..units import format_size

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

    def to_dict(self) -> dict[str, Any]:
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
        return bank.get("size_in_bytes", 0) if bank is not None else 0

    @property
    def vram_public(self) -> bool:
        """True when all VRAM is CPU-visible (large BAR: heap FB_PUBLIC)."""
        bank = self._vram_bank()
        return bank is not None and bank.get("heap_type") == HEAP_TYPE_FB_PUBLIC

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


def make_node(index: int, gpu_id: int, **kw: Any) -> Node:
    return (Gpu if gpu_id else Cpu)(index, gpu_id, **kw)


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
                    raise TopologyError(
                        f"gpu_id {n.gpu_id:#06x} on nodes {self._by_gpu_id[n.gpu_id].index} and {n.index}")
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

    def gpu_at(self, index: int) -> Gpu:
        """The GPU that is node `index` (which must be one of this topology's GPUs)."""
        node = self._by_index[index]
        assert isinstance(node, Gpu), f"node {index} is not a GPU"
        return node

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

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (ints, strings, lists, dicts) holding everything that was read."""
        return {
            "format": FORMAT, "version": FORMAT_VERSION, "source": self.source,
            "nodes": [n.to_dict() for n in self.nodes],
            "skipped": [{"node": s.index, "reason": s.reason} for s in self.skipped],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Topology:
        try:
            if d.get("format") != FORMAT:
                raise TopologyError(f"not a saved topology (format {d.get('format')!r})")
            if d.get("version") != FORMAT_VERSION:
                raise TopologyError(f"saved topology version {d.get('version')!r}, this vramd reads {FORMAT_VERSION}")
            nodes = []
            for nd in d["nodes"]:
                index = _as_int(nd["node"])
                nodes.append(make_node(
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


def _as_int(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"expected an integer, got {v!r}")
    return v


def _int_dict(d: Mapping[str, object]) -> dict[str, int]:
    return {str(k): _as_int(v) for k, v in d.items()}
