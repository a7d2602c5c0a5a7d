"""The files CRIU's stock amdgpu plugin writes, read as data: which BO lies where in which pages file.

The plugin writes, per KFD file id `<id>` of a dumped process:

- `amdgpu-kfd-<id>.img`: the BO list (`CriuKfd`, vramd/pb/criu_amdgpu_pb2, generated from our own
  proto/vramd/pb/criu_amdgpu.proto);
- `amdgpu-pages-<id>-<gpu_id %04x>.img`, one per GPU of the process: the contents of that GPU's VRAM and
  GTT BOs, whole, concatenated in the BO list's order;
- per render node file, `amdgpu-renderD-<id>.img` (`CriuRenderNode`) and one
  `amdgpu-drm-pages-<id>-<minor>-<index %04x>.img` per BO the plugin restores (a VRAM or GTT domain, mapped
  at least once): that one BO's contents.

Each of these files starts with an 8-byte native (little-endian here) size_t: the byte count that follows.
It is the packed message's length in a metadata file and the sum of the BO sizes in a KFD pages file; the
plugin leaves it uninitialised in `amdgpu-drm-pages-*`, so there the size comes from the BO entry only.
Nothing here trusts a name or a size read from a file: pages file names are built from numbers, every
file is opened without following a symbolic link and must be a regular file, and every size is checked
against the BO entries before a byte of content is read (`check_pages_file`).  Contents are never read
here: the caller hands (fd, offset, size) to the engine, which copies them a chunk at a time.
"""
from __future__ import annotations

import errno
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from ..errors import CorruptManifestError, ImageError, TruncatedDataError
from ..pb import criu_amdgpu_pb2 as cpb

HEADER = struct.Struct("<Q")  # the plugin's size_t, as x86-64 and arm64 (little-endian, 64-bit) write it
KFD_VRAM, KFD_GTT = 1 << 0, 1 << 1           # KFD_IOC_ALLOC_MEM_FLAGS_VRAM, _GTT
DOMAIN_GTT, DOMAIN_VRAM = 0x2, 0x4             # AMDGPU_GEM_DOMAIN_GTT, _VRAM
MAX_METADATA = 256 << 20  # a metadata file larger than this is refused before it is read
MAX_BO_SIZE = 1 << 48     # a BO entry claiming more is refused (no GPU has 256 TiB)
MAX_BOS = 1 << 20         # BO entries per metadata file
KFD_NAME = re.compile(r"amdgpu-kfd-(\d{1,10})\.img")
RENDER_NAME = re.compile(r"amdgpu-renderD-(\d{1,10})\.img")
VRAMD_DIR = re.compile(r"amdgpu-vramd-(\d{1,10})")  # the vramd plugin's image of amdgpu-kfd-<id>.img's BOs
BO_NAME = re.compile(r"criu-amdgpu:((?:kfd|renderD)-\d{1,10}:\d{1,7})")  # a vramd BO imported from a stock file
BO_NAME_PREFIX = "criu-amdgpu:"

M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class StockBo:
    """One BO whose contents the stock plugin stores: `key` names its entry ("kfd-<id>:<index>", or
    "renderD-<id>:<index>"), `file` the pages file, `offset` where its bytes start in it (after the header)."""

    key: str
    file: str
    offset: int
    size: int
    gpu_id: int
    va_addr: int
    alloc_flags: int

    @property
    def name(self) -> str:
        """The name a vramd image records for it (`vramctl export-criu` finds it back by this)."""
        return BO_NAME_PREFIX + self.key

    @property
    def index(self) -> int:
        """Its index in its metadata file's BO list (the KFD bucket index)."""
        return int(self.key.rpartition(":")[2])


@dataclass
class PagesFile:
    """One stock pages file: its BOs in order; `checked_header`: whether its header must equal `total`
    (KFD pages files), or is the plugin's uninitialised one (render-node pages files: written right on
    export, ignored on import)."""

    name: str
    checked_header: bool
    owner: str  # the metadata file's key: "kfd-<id>" or "renderD-<id>"
    bos: list[StockBo] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(b.size for b in self.bos)

    @property
    def length(self) -> int:
        return HEADER.size + self.total


@dataclass
class StockLayout:
    """Every pages file a stock checkpoint directory's metadata files describe, and those files' names."""

    metadata: list[str]
    files: list[PagesFile]

    @property
    def bos(self) -> list[StockBo]:
        return [b for f in self.files for b in f.bos]

    def only_kfd(self, file_id: int, where: str) -> StockLayout:
        """The pages files of amdgpu-kfd-<file_id>.img alone (refused if the directory has no such file)."""
        name = f"amdgpu-kfd-{file_id}.img"
        if name not in self.metadata:
            raise ImageError(f"{where} has no {name}")
        return StockLayout([name], [f for f in self.files if f.owner == f"kfd-{file_id}"])


def open_plain(dir_fd: int, name: str, where: str, flags: int = os.O_RDONLY) -> int:
    """`name` in the directory `dir_fd`, opened without following a symbolic link; refused unless it is a
    regular file (a FIFO or a device is never read from)."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ImageError(f"{where}/{name} is a symbolic link: a stock image's files are never followed") from None
        raise ImageError(f"cannot open {where}/{name}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ImageError(f"{where}/{name} is not a regular file")
    return fd


def read_header(fd: int, name: str) -> int:
    raw = os.pread(fd, HEADER.size, 0)
    if len(raw) != HEADER.size:
        raise TruncatedDataError(f"{name}: {len(raw)} byte(s), shorter than the 8-byte size header", offset=0)
    value: int = HEADER.unpack(raw)[0]
    return value


def read_message(dir_fd: int, name: str, cls: type[M], where: str) -> M:
    """A metadata file: its header (the message's length, which must be the rest of the file), then the
    message, parsed by our generated code."""
    fd = open_plain(dir_fd, name, where)
    try:
        size = os.fstat(fd).st_size
        length = read_header(fd, f"{where}/{name}")
        if length != size - HEADER.size:
            raise CorruptManifestError(f"{where}/{name}: its header says {length} byte(s) follow, the file holds "
                                       f"{size - HEADER.size}")
        if length > MAX_METADATA:
            raise CorruptManifestError(f"{where}/{name}: {length} bytes of metadata, more than the "
                                       f"{MAX_METADATA >> 20} MiB vramctl reads")
        raw = os.pread(fd, length, HEADER.size)
        if len(raw) != length:
            raise TruncatedDataError(f"{where}/{name}: ends at {HEADER.size + len(raw)} while read", offset=len(raw))
    finally:
        os.close(fd)
    msg = cls()
    try:
        msg.ParseFromString(raw)
    except DecodeError as e:
        raise CorruptManifestError(f"{where}/{name}: not a {cls.__name__} message ({e})") from None
    return msg


def _check_size(where: str, name: str, index: int, size: int) -> None:
    if not 0 < size <= MAX_BO_SIZE or size % 4096:
        raise CorruptManifestError(f"{where}/{name}: BO #{index} claims {size} bytes (not a page multiple up to "
                                   f"{MAX_BO_SIZE >> 40} TiB)")


def kfd_pages(where: str, name: str, file_id: int, kfd: cpb.CriuKfd) -> list[PagesFile]:
    """The pages files of one amdgpu-kfd-<id>.img: one per GPU node of the process, in its device order."""
    if kfd.num_of_bos != len(kfd.bo_entries) or len(kfd.bo_entries) > MAX_BOS:
        raise CorruptManifestError(f"{where}/{name}: num_of_bos is {kfd.num_of_bos}, it lists "
                                   f"{len(kfd.bo_entries)} BO entries")
    files: dict[int, PagesFile] = {}
    for d in kfd.device_entries:
        if d.gpu_id and d.gpu_id not in files:
            files[d.gpu_id] = PagesFile(f"amdgpu-pages-{file_id}-{d.gpu_id:04x}.img", True, f"kfd-{file_id}")
    for i, e in enumerate(kfd.bo_entries):
        if not e.alloc_flags & (KFD_VRAM | KFD_GTT):
            continue  # userptr memory is the process's own (CRIU dumps it); doorbells and MMIO hold no contents
        _check_size(where, name, i, e.size)
        pf = files.get(e.gpu_id)
        if pf is None:
            raise CorruptManifestError(f"{where}/{name}: BO #{i} is on GPU {e.gpu_id:#x}, which is not one of the "
                                       "process's devices")
        pf.bos.append(StockBo(f"kfd-{file_id}:{i}", pf.name, HEADER.size + pf.total, e.size, e.gpu_id, e.addr,
                              e.alloc_flags))
    return list(files.values())


def render_pages(where: str, name: str, file_id: int, rd: cpb.CriuRenderNode) -> list[PagesFile]:
    """The pages files of one amdgpu-renderD-<id>.img: one per BO the stock restore reads back."""
    if rd.num_of_bos != len(rd.bo_entries) or len(rd.bo_entries) > MAX_BOS:
        raise CorruptManifestError(f"{where}/{name}: num_of_bos is {rd.num_of_bos}, it lists "
                                   f"{len(rd.bo_entries)} BO entries")
    if rd.id != file_id:
        raise CorruptManifestError(f"{where}/{name}: its entry names file id {rd.id}, not {file_id}")
    files = []
    for i, e in enumerate(rd.bo_entries):
        if not e.preferred_domains & (DOMAIN_VRAM | DOMAIN_GTT) or e.num_of_vms == 0:
            continue
        _check_size(where, name, i, e.size)
        pf = PagesFile(f"amdgpu-drm-pages-{file_id}-{rd.drm_render_minor}-{i:04x}.img", False, f"renderD-{file_id}")
        pf.bos.append(StockBo(f"renderD-{file_id}:{i}", pf.name, HEADER.size, e.size, rd.gpu_id, e.addr,
                              e.alloc_flags & 0xFFFFFFFF))
        files.append(pf)
    return files


def layout(dir_fd: int, where: str) -> StockLayout:
    """Every stock metadata file in the directory and the pages files they describe (in id order)."""
    names = os.listdir(dir_fd)
    kfd = sorted((int(m[1]), n) for n in names if (m := KFD_NAME.fullmatch(n)))
    render = sorted((int(m[1]), n) for n in names if (m := RENDER_NAME.fullmatch(n)))
    if not kfd and not render:
        raise ImageError(f"{where} holds no amdgpu-kfd-*.img or amdgpu-renderD-*.img: not a checkpoint made by "
                         "CRIU's amdgpu plugin")
    files: list[PagesFile] = []
    for file_id, name in kfd:
        files += kfd_pages(where, name, file_id, read_message(dir_fd, name, cpb.CriuKfd, where))
    for file_id, name in render:
        files += render_pages(where, name, file_id, read_message(dir_fd, name, cpb.CriuRenderNode, where))
    return StockLayout([n for _, n in kfd + render], files)


def check_pages_file(fd: int, pf: PagesFile, where: str) -> None:
    """The pages file `fd` holds exactly what its BO entries say: its length is the header plus their sizes,
    and (a KFD pages file) its header is their sum.  Refused otherwise, naming the file and the BO cut."""
    path = f"{where}/{pf.name}"
    size = os.fstat(fd).st_size
    header = read_header(fd, path)
    if pf.checked_header and header != pf.total:
        raise CorruptManifestError(f"{path}: its header says {header} byte(s) of BO contents, its BO entries "
                                   f"add up to {pf.total}")
    if size < pf.length:
        cut = next(b for b in pf.bos if b.offset + b.size > size)
        raise TruncatedDataError(f"{path}: {size} bytes, its BO entries need {pf.length}; {cut.key} is cut short",
                                 offset=max(0, size - cut.offset))
    if size > pf.length:
        raise CorruptManifestError(f"{path}: {size} bytes, {size - pf.length} more than its BO entries need "
                                   f"({pf.length})")
