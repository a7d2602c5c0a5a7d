"""SDMA packets: the COPY_LINEAR layout and the per-family limits, as pure functions.

Packet facts (opcode, sub-opcode, the 7-dword COPY_LINEAR layout, the count
field's encoding per family, 8-dword IB alignment with NOP padding) are
those of the kernel's SDMA engines; docs/sdma.md gives them with sources.
"""
from __future__ import annotations

import array
from collections.abc import Iterable

GPU_PAGE = 4096  # the GPU VM's page: VA ranges and the BOs mapped there align to it
SDMA_OP_NOP = 0
SDMA_OP_COPY = 1
SDMA_SUBOP_COPY_LINEAR = 0
COPY_LINEAR_DWORDS = 7
IB_ALIGN_DWORDS = 8
IB_SLOT_BYTES = 64 << 10   # one submission's IB: up to 2,340 COPY_LINEAR packets
IB_SLOTS_PER_RING = 64
TIMEOUT_INFINITE = 0xFFFFFFFFFFFFFFFF
KERNEL_DMA_RINGS = 2  # DMA ring slots per context (amdgpu_ctx_num_entities[AMDGPU_HW_IP_DMA])


def family_is_ai_or_later(family: int, ai: int) -> bool:
    return family >= ai


def max_copy_bytes(family: int, ai: int) -> int:
    """Bytes one COPY_LINEAR packet may move (the kernel's copy_max_bytes per SDMA generation).

    SDMA v4 and later (AMDGPU_FAMILY_AI on): 4 MiB.  Before AI the limit differs inside a
    family (CIK and Iceland 0x1fffff, Tonga/Fiji/Polaris 0x3fffe0) and the family id cannot
    tell them apart, so the smallest, valid on all of them, is used.
    """
    return 0x400000 if family_is_ai_or_later(family, ai) else 0x1FFFFF


def copy_linear_packets(copies: Iterable[tuple[int, int, int]], family: int, ai: int) -> array.array[int]:
    """An IB of COPY_LINEAR packets for (src_va, dst_va, nbytes) copies, NOP-padded to 8 dwords."""
    limit = max_copy_bytes(family, ai)
    minus_one = 1 if family_is_ai_or_later(family, ai) else 0
    header = (SDMA_SUBOP_COPY_LINEAR << 8) | SDMA_OP_COPY
    ib = array.array("I")
    for src, dst, n in copies:
        done = 0
        while done < n:
            step = min(limit, n - done)
            s, d = src + done, dst + done
            ib.extend((header, step - minus_one, 0, s & 0xFFFFFFFF, s >> 32, d & 0xFFFFFFFF, d >> 32))
            done += step
    while len(ib) % IB_ALIGN_DWORDS:
        ib.append(SDMA_OP_NOP)
    return ib
