"""Mapping a checkpoint's GPUs onto the GPUs present at restore, and the report when none exists."""
from __future__ import annotations

import logging

from ..errors import TopologyMismatchError
from .model import Topology
from .search import CHECK_ENV, MAX_SEARCH_STEPS, Checks, Exhausted, Mapper, hive_sizes, max_matching

log = logging.getLogger("vramd.topology")


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
    mapper = Mapper(checkpoint, present, checks, max_steps)
    if len(mapper.src_hives) > len(mapper.dst_hives):
        raise TopologyMismatchError("\n".join([
            head, f"the checkpoint has {len(mapper.src_hives)} XGMI hive(s) (sizes {hive_sizes(mapper.src_hives)}), "
                  f"here {len(mapper.dst_hives)} (sizes {hive_sizes(mapper.dst_hives)})", *notes]))
    try:
        result = mapper.search()
    except Exhausted:
        raise TopologyMismatchError("\n".join([
            head, f"gave up after {max_steps} placements without finding a mapping", *notes])) from None
    if result is not None:
        log.info("gpu map: %s", ", ".join(f"{s:#06x}->{d:#06x}" for s, d in sorted(result.items())))
        return result
    raise _mismatch(checkpoint, present, checks, mapper, head, notes, max_steps)



def _mismatch(checkpoint: Topology, present: Topology, checks: Checks, mapper: Mapper,
              head: str, notes: list[str], max_steps: int) -> TopologyMismatchError:
    lines = [head]
    unplaced: dict[int, dict[int, list[str]]] = {}
    owner = max_matching(checkpoint.gpus, present.gpus, lambda s, d: not mapper.problems(s, d))
    matched = set(owner.values())
    stuck = [s for s in checkpoint.gpus if s.index not in matched]
    if stuck:
        # Even ignoring NUMA and hives, some GPU has no candidate left.
        for s in stuck:
            lines.append(f"{s.label()} cannot be placed:")
            unplaced[s.gpu_id] = {}
            for d in present.gpus:
                reasons = mapper.problems(s, d) or [
                    f"compatible, but needed by gpu {checkpoint.gpu_at(owner[d.index]).gpu_id:#06x}"]
                unplaced[s.gpu_id][d.gpu_id] = list(reasons)
                lines.append(f"  candidate {d.gpu_id:#06x} (node {d.index}): {'; '.join(reasons)}")
    hints = _hints(checkpoint, present, checks, max_steps)
    if not stuck:
        _, deepest, why = mapper.deepest
        numa_alone = any("KFD_NUMA_CHECK" in h for h in hints)
        if mapper.src_hives and not numa_alone:
            lines.append(f"each checkpoint XGMI hive (sizes {hive_sizes(mapper.src_hives)}) must fit in one hive "
                         f"here (sizes {hive_sizes(mapper.dst_hives)})")
        if checks.numa:
            lines.append("each checkpoint CPU node must map to one CPU node here (KFD_NUMA_CHECK); GPUs per CPU node: "
                         f"checkpoint {_numa_shape(checkpoint)}, here {_numa_shape(present)}")
        if deepest is not None:
            lines.append(f"{deepest.label()} cannot be placed:")
            unplaced[deepest.gpu_id] = {}
            for d in present.gpus:
                reason = why.get(d.index, "outside the hive being filled")
                unplaced[deepest.gpu_id][d.gpu_id] = [reason]
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
            if Mapper(checkpoint, present, checks.replace(**{attr: False}), budget).search() is not None:
                hints.append(f"hint: a mapping exists with {var}=0")
        except Exhausted:
            pass
    return hints
