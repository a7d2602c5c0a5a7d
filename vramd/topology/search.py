"""The search behind GPU mapping: which checkpoint GPU may go where, by the rules of CRIU's amdgpu plugin.

CRIU's switches (KFD_*_CHECK) are `Checks`; `Mapper` places hives, NUMA
nodes and GPUs with backtracking, within a step budget.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from ..units import format_size
from .model import _HEX_KEYS, EXACT_MATCH_KEYS, Cpu, Gpu, IoLink, Topology

log = logging.getLogger("vramd.topology")

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

    def replace(self, **kw: bool) -> Checks:
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


class Exhausted(Exception):
    pass


class Mapper:
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
            raise Exhausted

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
                why[d.index] = f"compatible, but taken by gpu {self.src.gpu_at(owner).gpu_id:#06x}" \
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
            return {self.src.gpu_at(s).gpu_id: self.dst.gpu_at(d).gpu_id for s, d in self.gpu_map.items()}
        return None


def max_matching(src: list[Gpu], dst: list[Gpu], ok: Callable[[Gpu, Gpu], bool]) -> dict[int, int]:
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


def hive_sizes(hives: list[list[Gpu]]) -> str:
    return ", ".join(str(len(h)) for h in hives) or "none"
