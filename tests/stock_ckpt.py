"""Checkpoint directories laid out as CRIU's stock amdgpu plugin writes them, made with our generated code
(vramd/pb/criu_amdgpu_pb2): amdgpu-kfd-<id>.img with its per-GPU amdgpu-pages-<id>-<gpu>.img, and
amdgpu-renderD-<id>.img with one amdgpu-drm-pages-<id>-<minor>-<index>.img per BO the plugin restores."""
from __future__ import annotations

import os
import random
import struct
from pathlib import Path

from vramd.pb import criu_amdgpu_pb2 as cpb

VRAM, GTT, USERPTR, DOORBELL, WRITABLE = 1, 2, 4, 8, 1 << 31
DOMAIN_GTT, DOMAIN_VRAM, DOMAIN_CPU = 2, 4, 1
SIZE_T = struct.Struct("<Q")


def write_img(path: Path, payload: bytes) -> None:
    """A plugin metadata file: the native size_t length, then the packed message."""
    path.write_bytes(SIZE_T.pack(len(payload)) + payload)


def bo_bytes(size: int, seed: int) -> bytes:
    """Random, a quarter zeros in the middle."""
    rng = random.Random(seed)
    return rng.randbytes(size // 2) + bytes(size // 4) + rng.randbytes(size - size // 2 - size // 4)


def kfd_checkpoint(d: Path, file_id: int, gpus: list[int], bos: list[tuple[int, int, int, int]]) -> dict:
    """amdgpu-kfd-<file_id>.img for a process on `gpus`, BOs (gpu_id, size, alloc_flags, seed: two BOs of
    one seed and size hold the same bytes) in bucket order, and its pages files; returns {key: contents} for
    every BO the plugin stores (VRAM or GTT), keyed "kfd-<id>:<index>"."""
    kfd = cpb.CriuKfd(pid=4242, num_of_gpus=len(gpus), num_of_cpus=1, num_of_bos=len(bos), num_of_objects=3,
                      shared_mem_size=0, shared_mem_magic=0, priv_data=os.urandom(256))
    kfd.device_entries.add(node_id=0, gpu_id=0)
    for n, g in enumerate(gpus, 1):
        kfd.device_entries.add(node_id=n, gpu_id=g, drm_render_minor=127 + n)
    contents: dict[str, bytes] = {}
    pages: dict[int, list[bytes]] = {g: [] for g in gpus}
    for i, (g, size, flags, seed) in enumerate(bos):
        kfd.bo_entries.add(addr=0x7F00_0000_0000 + i * (1 << 30), size=size, offset=i << 12, alloc_flags=flags,
                           gpu_id=g, handle=i + 1)
        if flags & (VRAM | GTT):
            data = bo_bytes(size, seed)
            contents[f"kfd-{file_id}:{i}"] = data
            pages[g].append(data)
    write_img(d / f"amdgpu-kfd-{file_id}.img", kfd.SerializeToString())
    for g, datas in pages.items():
        body = b"".join(datas)
        (d / f"amdgpu-pages-{file_id}-{g:04x}.img").write_bytes(SIZE_T.pack(len(body)) + body)
    return contents


def render_checkpoint(d: Path, file_id: int, gpu_id: int, minor: int, bos: list[tuple[int, int, int]],
                      seed: int) -> dict:
    """amdgpu-renderD-<file_id>.img with BOs (size, preferred_domains, num_of_vms) and a pages file per BO the
    plugin restores, each with the garbage header the plugin leaves; returns {key: contents}."""
    rd = cpb.CriuRenderNode(gpu_id=gpu_id, id=file_id, drm_render_minor=minor, num_of_bos=len(bos))
    rng = random.Random(seed)
    contents: dict[str, bytes] = {}
    for i, (size, domains, vms) in enumerate(bos):
        rd.bo_entries.add(addr=0x1_0000_0000 + i * (1 << 24), size=size, offset=i << 12, alloc_flags=0,
                          alignment=4096, preferred_domains=domains, handle=i + 1, is_import=0, num_of_vms=vms)
        if domains & (DOMAIN_VRAM | DOMAIN_GTT) and vms:
            data = rng.randbytes(size)
            contents[f"renderD-{file_id}:{i}"] = data
            (d / f"amdgpu-drm-pages-{file_id}-{minor}-{i:04x}.img").write_bytes(os.urandom(8) + data)
    write_img(d / f"amdgpu-renderD-{file_id}.img", rd.SerializeToString())
    return contents
