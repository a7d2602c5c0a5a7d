"""vramctl import-criu / export-criu on checkpoints laid out as CRIU's stock amdgpu plugin writes them (made
here with our generated code, tests/stock_ckpt.py): real daemon, real files, byte comparisons, refusals."""
from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import subprocess
import sys

import pytest
from helpers import ROOT, vramctl
from stock_ckpt import (
    DOMAIN_CPU,
    DOMAIN_GTT,
    DOMAIN_VRAM,
    DOORBELL,
    GTT,
    USERPTR,
    VRAM,
    WRITABLE,
    kfd_checkpoint,
    render_checkpoint,
    write_img,
)

from vramd.pb import criu_amdgpu_pb2 as cpb

G1, G2 = 0x1A2B, 0x3C4D
MIB = 1 << 20


def stock_dir(d):
    """Two GPUs, VRAM and GTT BOs (two holding the same bytes), BOs with no stored contents, a render node."""
    d.mkdir()
    want = kfd_checkpoint(d, 7, [G1, G2], [
        (G1, 2 * MIB, VRAM | WRITABLE, 1), (G2, 3 * MIB + 8192, VRAM, 2), (G1, 4096, USERPTR, 3),
        (G1, 8192, DOORBELL, 4), (G1, 64 << 10, GTT | WRITABLE, 5), (G2, 2 * MIB, VRAM, 1)])
    want.update(render_checkpoint(d, 9, G1, 128, [(1 << 16, DOMAIN_VRAM, 1), (8192, DOMAIN_CPU, 1),
                                                  (4096, DOMAIN_GTT, 0), (12288, DOMAIN_GTT, 2)], 6))
    return want


def metadata_copy(src, dst):
    """What export-criu writes into: the dump directory's metadata files, without the pages files."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name.startswith(("amdgpu-kfd-", "amdgpu-renderD-")):
            shutil.copy(f, dst / f.name)


def pages_files(d):
    return sorted(f.name for f in d.iterdir() if "pages" in f.name)


def test_import_verify_restore_export(daemon, tmp_path):
    ck, img = tmp_path / "ck", tmp_path / "img"
    want = stock_dir(ck)
    assert sorted(want) == ["kfd-7:0", "kfd-7:1", "kfd-7:4", "kfd-7:5", "renderD-9:0", "renderD-9:3"]
    r = vramctl("import-criu", str(ck), str(img), "--compress", "zstd:3", "--json", socket=daemon.socket)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] and out["state"] == "done" and out["image"]["bo_count"] == 6
    assert out["bytes"] == sum(map(len, want.values()))
    assert out["pages_files"] == ["amdgpu-pages-7-1a2b.img", "amdgpu-pages-7-3c4d.img",
                                  "amdgpu-drm-pages-9-128-0000.img", "amdgpu-drm-pages-9-128-0003.img"]

    assert vramctl("verify", str(img)).returncode == 0
    info = json.loads(vramctl("inspect", str(img), "--json").stdout)
    assert info["compression"] == "zstd:3"
    names = {b["name"]: b for b in info["bos"]}
    assert {n.removeprefix("criu-amdgpu:"): b["size"] for n, b in names.items()} == {k: len(v) for k, v in
                                                                                     want.items()}
    # kfd-7:0 and kfd-7:5 hold the same bytes on two GPUs: stored once; the zeros in every BO compress
    assert info["totals"]["deduplicated_bytes"] == 2 * MIB
    assert info["totals"]["stored_bytes"] < out["bytes"] - 2 * MIB - MIB  # 1.26 MiB of zeros
    assert names["criu-amdgpu:kfd-7:4"]["alloc_flags"] == GTT | WRITABLE

    # restore every BO into a file of its own through the daemon (at the offset it had in its pages file, as
    # `vramctl restore` writes a file BO): the stock files' bytes, BO by BO
    targets = []
    for b in names.values():
        t = tmp_path / f"bo{b['id']}"
        t.write_bytes(b"\xee" * (b["source_offset"] + b["size"]))
        targets += ["--bo-file", f"{b['id']}={t}"]
    r = vramctl("restore", "--pid", str(os.getpid()), "--image", str(img), *targets, socket=daemon.socket)
    assert r.returncode == 0, r.stderr
    for n, b in names.items():
        got = (tmp_path / f"bo{b['id']}").read_bytes()
        assert got[b["source_offset"]:] == want[n.removeprefix("criu-amdgpu:")], n

    # export into a copy of the dump directory that holds its metadata: the very pages files the plugin wrote
    out_dir = tmp_path / "ck2"
    metadata_copy(ck, out_dir)
    r = vramctl("export-criu", str(img), str(out_dir), "--json", socket=daemon.socket)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["bytes"] == sum(map(len, want.values()))
    assert pages_files(out_dir) == pages_files(ck)
    for name in pages_files(ck):
        a, b = (ck / name).read_bytes(), (out_dir / name).read_bytes()
        if name.startswith("amdgpu-drm-pages-"):  # the plugin's header there is garbage; ours is the size
            assert b[8:] == a[8:] and struct.unpack("<Q", b[:8])[0] == len(a) - 8, name
        else:
            assert a == b, name
    assert sorted(os.listdir(out_dir)) == sorted(os.listdir(ck))  # no temporaries left


def test_offline_export_replaces_stale_longer_files(tmp_path):
    """No daemon (--offline: the daemon's session path in vramctl); the plugin opens pages files without
    O_TRUNC, so a longer stale file in the directory would keep its tail: export replaces it whole."""
    ck, img = tmp_path / "ck", tmp_path / "img"
    stock_dir(ck)
    r = vramctl("import-criu", str(ck), str(img), "--offline", "--compress", "none")
    assert r.returncode == 0, r.stderr
    out_dir = tmp_path / "ck2"
    metadata_copy(ck, out_dir)
    stale = out_dir / "amdgpu-pages-7-1a2b.img"
    stale.write_bytes(b"\x5a" * (8 * MIB))
    for _ in range(2):  # a second export over the first replaces it as well
        r = vramctl("export-criu", str(img), str(out_dir), "--offline")
        assert r.returncode == 0, r.stderr
        assert stale.read_bytes() == (ck / stale.name).read_bytes()
        assert "exported 6 BO(s)" in r.stdout
    r = vramctl("import-criu", str(ck), str(img), "--offline")
    assert r.returncode == 1 and "already holds an image" in r.stderr


def test_memory_stays_bounded(tmp_path):
    """A 2 GiB BO (sparse, so the test is quick) goes through import and export with vramctl's resident
    memory far below its size: nothing reads a pages file or a BO whole."""
    ck, img, out_dir = tmp_path / "ck", tmp_path / "img", tmp_path / "ck2"
    ck.mkdir()
    size = 2 << 30
    kfd = cpb.CriuKfd(pid=1, num_of_gpus=1, num_of_cpus=1, num_of_bos=1)
    kfd.device_entries.add(node_id=1, gpu_id=G1)
    kfd.bo_entries.add(addr=1 << 40, size=size, offset=0, alloc_flags=VRAM, gpu_id=G1, handle=1)
    write_img(ck / "amdgpu-kfd-3.img", kfd.SerializeToString())
    with open(ck / "amdgpu-pages-3-1a2b.img", "wb") as f:
        f.write(struct.pack("<Q", size))
        f.seek(8 + size - 4096)
        f.write(b"tail" * 1024)
    metadata_copy(ck, out_dir)
    for args in (["import-criu", str(ck), str(img)], ["export-criu", str(img), str(out_dir)]):
        code = ("import resource, sys; from vramd.cli.vramctl import main; rc = main(sys.argv[1:]); "
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(rc)")
        r = subprocess.run([sys.executable, "-c", code, *args, "--offline"], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        maxrss_kib = int(r.stderr.split()[-1])
        assert maxrss_kib * 1024 < size // 4, (args[0], maxrss_kib)
    with open(out_dir / "amdgpu-pages-3-1a2b.img", "rb") as f:
        assert f.read(8) == struct.pack("<Q", size)
        f.seek(8 + size - 4096)
        assert f.read() == b"tail" * 1024
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < size  # nor did this test read it


def _truncate(ck):
    p = ck / "amdgpu-pages-7-3c4d.img"
    os.truncate(p, p.stat().st_size - 5000)


def _header(ck):
    p = ck / "amdgpu-pages-7-1a2b.img"
    with open(p, "r+b") as f:
        f.write(struct.pack("<Q", 12345))


def _longer(ck):
    with open(ck / "amdgpu-pages-7-1a2b.img", "ab") as f:
        f.write(b"x")


def _hostile_bo(ck):
    kfd = cpb.CriuKfd()
    kfd.ParseFromString((ck / "amdgpu-kfd-7.img").read_bytes()[8:])
    kfd.bo_entries[1].size = 1 << 62
    write_img(ck / "amdgpu-kfd-7.img", kfd.SerializeToString())


def _hostile_header(ck):
    with open(ck / "amdgpu-kfd-7.img", "r+b") as f:
        f.write(struct.pack("<Q", (1 << 64) - 9))


def _count(ck):
    kfd = cpb.CriuKfd()
    kfd.ParseFromString((ck / "amdgpu-kfd-7.img").read_bytes()[8:])
    kfd.num_of_bos = 1 << 40
    write_img(ck / "amdgpu-kfd-7.img", kfd.SerializeToString())


def _garbage(ck):
    write_img(ck / "amdgpu-kfd-7.img", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01")


def _symlink(ck):
    p = ck / "amdgpu-pages-7-1a2b.img"
    os.rename(p, ck / "elsewhere")
    os.symlink("elsewhere", p)


def _fifo(ck):
    p = ck / "amdgpu-drm-pages-9-128-0003.img"
    p.unlink()
    os.mkfifo(p)


def _render_id(ck):
    os.rename(ck / "amdgpu-renderD-9.img", ck / "amdgpu-renderD-8.img")


@pytest.mark.parametrize("damage, code, words", [
    (_truncate, "TRUNCATED_DATA", ["amdgpu-pages-7-3c4d.img", "kfd-7:5 is cut short"]),
    (_header, "CORRUPT_MANIFEST", ["amdgpu-pages-7-1a2b.img", "header says 12345"]),
    (_longer, "CORRUPT_MANIFEST", ["amdgpu-pages-7-1a2b.img", "1 more than its BO entries need"]),
    (_hostile_bo, "CORRUPT_MANIFEST", ["amdgpu-kfd-7.img", "BO #1 claims 4611686018427387904 bytes"]),
    (_hostile_header, "CORRUPT_MANIFEST", ["amdgpu-kfd-7.img", "header says 18446744073709551607"]),
    (_count, "CORRUPT_MANIFEST", ["amdgpu-kfd-7.img", "num_of_bos is 1099511627776"]),
    (_garbage, "CORRUPT_MANIFEST", ["amdgpu-kfd-7.img", "not a CriuKfd message"]),
    (_symlink, "IMAGE_ERROR", ["amdgpu-pages-7-1a2b.img is a symbolic link"]),
    (_fifo, "IMAGE_ERROR", ["amdgpu-drm-pages-9-128-0003.img is not a regular file"]),
    (_render_id, "CORRUPT_MANIFEST", ["amdgpu-renderD-8.img", "names file id 9"]),
])
def test_import_refuses(tmp_path, damage, code, words):
    ck, img = tmp_path / "ck", tmp_path / "new" / "img"
    stock_dir(ck)
    damage(ck)
    r = vramctl("import-criu", str(ck), str(img), "--offline", "--json")
    assert r.returncode == 1, r.stderr
    err = json.loads(r.stdout)["error"]
    assert err["code"] == code, err
    for w in words:
        assert w in err["message"], err
    assert not (tmp_path / "new").exists()  # a refused import leaves nothing behind


def _resize(d):
    kfd = cpb.CriuKfd()
    kfd.ParseFromString((d / "amdgpu-kfd-7.img").read_bytes()[8:])
    kfd.bo_entries[4].size += 4096
    write_img(d / "amdgpu-kfd-7.img", kfd.SerializeToString())


def _more(d):
    kfd = cpb.CriuKfd()
    kfd.ParseFromString((d / "amdgpu-kfd-7.img").read_bytes()[8:])
    kfd.bo_entries.add(addr=1, size=4096, offset=0, alloc_flags=VRAM, gpu_id=G2, handle=99)
    kfd.num_of_bos += 1
    write_img(d / "amdgpu-kfd-7.img", kfd.SerializeToString())


def _fewer(d):
    (d / "amdgpu-renderD-9.img").unlink()


@pytest.mark.parametrize("change, words", [
    (_resize, ["BO 2 (kfd-7:4) holds 65536 bytes", "amdgpu-pages-7-1a2b.img needs 69632"]),
    (_more, ["has no BO for", "kfd-7:6 (4096 bytes)"]),
    (_fewer, ["BO 5 (renderD-9:0) has no entry in"]),
])
def test_export_refuses_another_checkpoint(tmp_path, change, words):
    ck, img, out_dir = tmp_path / "ck", tmp_path / "img", tmp_path / "ck2"
    stock_dir(ck)
    assert vramctl("import-criu", str(ck), str(img), "--offline").returncode == 0
    metadata_copy(ck, out_dir)
    change(out_dir)
    before = sorted(os.listdir(out_dir))
    r = vramctl("export-criu", str(img), str(out_dir), "--offline", "--json")
    assert r.returncode == 1, r.stderr
    err = json.loads(r.stdout)["error"]
    assert err["code"] == "IMAGE_ERROR", err
    for w in words:
        assert w in err["message"], err
    assert sorted(os.listdir(out_dir)) == before  # nothing written


def test_export_refuses_an_image_not_imported(daemon, tmp_path):
    """An image of other BOs (a plain file dump) has no stock entries to go to; and a damaged image fails
    the export with the BO and offset, leaving no pages file behind."""
    ck, out_dir = tmp_path / "ck", tmp_path / "ck2"
    stock_dir(ck)
    metadata_copy(ck, out_dir)
    f = tmp_path / "bo.bin"
    f.write_bytes(os.urandom(8192))
    other = tmp_path / "other"
    assert vramctl("dump", "--bo-file", str(f), "--image", str(other), socket=daemon.socket).returncode == 0
    r = vramctl("export-criu", str(other), str(out_dir), socket=daemon.socket)
    assert r.returncode == 1 and "was not imported from a stock checkpoint" in r.stderr, r.stderr

    img = tmp_path / "img"
    assert vramctl("import-criu", str(ck), str(img), "--compress", "none", socket=daemon.socket).returncode == 0
    # flip a byte in the middle of the largest data file: its records (a small one may hold no record at all,
    # and its middle would be its header: FOREIGN_DATA_FILE, not the damaged chunk this is about)
    target = max((p for p in img.iterdir() if p.suffix == ".vrd"), key=lambda p: p.stat().st_size)
    with open(target, "r+b") as fh:
        fh.seek(target.stat().st_size // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))
    before = sorted(os.listdir(out_dir))
    r = vramctl("export-criu", str(img), str(out_dir), "--json", socket=daemon.socket)
    assert r.returncode == 1, r.stderr
    err = json.loads(r.stdout)["error"]
    assert err["code"] == "CORRUPT_CHUNK" and err["bo_id"] is not None and err["offset"] is not None, err
    assert sorted(os.listdir(out_dir)) == before


def plugin_image(img_dir, ck, file_id):
    """A vramd image of amdgpu-kfd-<file_id>.img's BOs as the vramd plugin dumps one (through vramd.inproc, from
    memfds holding the stock pages files' bytes): BO id = bucket index, no name, the user gpu_id, VA and flags."""
    import uvloop

    from vramd import inproc
    from vramd.backends import BoRef
    from vramd.engine import BoSpec, Engine
    kfd = cpb.CriuKfd()
    kfd.ParseFromString((ck / f"amdgpu-kfd-{file_id}.img").read_bytes()[8:])
    offsets = {}
    specs, fds = [], []
    for i, e in enumerate(kfd.bo_entries):
        if not e.alloc_flags & (VRAM | GTT):
            continue
        off = offsets.setdefault(e.gpu_id, 8)
        offsets[e.gpu_id] = off + e.size
        with open(ck / f"amdgpu-pages-{file_id}-{e.gpu_id:04x}.img", "rb") as f:
            f.seek(off)
            data = f.read(e.size)
        fd = os.memfd_create(f"bo{i}")
        os.write(fd, data)
        fds.append(fd)
        specs.append(BoSpec(i, e.size, BoRef("mmap", fd, 0), gpu_id=e.gpu_id, alloc_flags=e.alloc_flags,
                            va_addr=e.addr))
    img_dir.mkdir()
    dfd = os.open(img_dir, os.O_RDONLY | os.O_DIRECTORY)

    async def go():
        async with Engine() as eng:
            return await inproc.dump(eng, dfd, specs)
    try:
        uvloop.run(go())
    finally:
        for fd in [dfd, *fds]:
            os.close(fd)


def test_the_vramd_plugins_layout(daemon, tmp_path):
    """The vramd plugin keeps amdgpu-kfd-<id>.img and writes an image per KFD file, amdgpu-vramd-<id>/, whose BO
    i is bucket i (docs/criu-integration.md).  export-criu writes such an image's pages files (the KFD file
    from the directory's name), and import-criu --kfd makes one from a stock checkpoint."""
    ck, out_dir = tmp_path / "ck", tmp_path / "ck2"
    stock_dir(ck)
    metadata_copy(ck, out_dir)
    plugin_image(out_dir / "amdgpu-vramd-7", ck, 7)
    r = vramctl("export-criu", str(out_dir / "amdgpu-vramd-7"), str(out_dir), "--json", socket=daemon.socket)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["pages_files"] == ["amdgpu-pages-7-1a2b.img", "amdgpu-pages-7-3c4d.img"]
    for name in ("amdgpu-pages-7-1a2b.img", "amdgpu-pages-7-3c4d.img"):
        assert (out_dir / name).read_bytes() == (ck / name).read_bytes(), name
    assert not any(n.startswith("amdgpu-drm-pages-") for n in os.listdir(out_dir))  # the render node's are not its

    # import-criu --kfd: the same layout (ids = bucket indices, the stock gpu_ids offline), and back
    img = tmp_path / "ck3" / "amdgpu-vramd-7"
    r = vramctl("import-criu", str(ck), str(img), "--kfd", "7", "--offline")
    assert r.returncode == 0, r.stderr
    info = json.loads(vramctl("inspect", str(img), "--json").stdout)
    assert sorted((b["id"], b["gpu_id"], b["size"]) for b in info["bos"]) == [
        (0, G1, 2 * MIB), (1, G2, 3 * MIB + 8192), (4, G1, 64 << 10), (5, G2, 2 * MIB)]
    out3 = tmp_path / "ck3"
    metadata_copy(ck, out3 / "meta")
    r = vramctl("export-criu", str(img), str(out3 / "meta"), socket=daemon.socket)  # the daemon has none of those
    assert r.returncode == 0, r.stderr                                              # GPUs: its default GPU copies
    assert pages_files(out3 / "meta") == ["amdgpu-pages-7-1a2b.img", "amdgpu-pages-7-3c4d.img"]
    for name in pages_files(out3 / "meta"):
        assert (out3 / "meta" / name).read_bytes() == (ck / name).read_bytes(), name

    # a plugin image of another process's BOs: VA and flags disagree with the metadata's
    kfd = cpb.CriuKfd()
    kfd.ParseFromString((out_dir / "amdgpu-kfd-7.img").read_bytes()[8:])
    kfd.bo_entries[4].addr += 1 << 21
    write_img(out_dir / "amdgpu-kfd-7.img", kfd.SerializeToString())
    r = vramctl("export-criu", str(out_dir / "amdgpu-vramd-7"), str(out_dir), "--offline", "--json")
    assert r.returncode == 1
    err = json.loads(r.stdout)["error"]
    assert err["code"] == "IMAGE_ERROR" and err["bo_id"] == 4 and "was dumped from VA" in err["message"], err
    # without a KFD id (a directory not named amdgpu-vramd-<id>, no --kfd) unnamed BOs are refused
    os.rename(out_dir / "amdgpu-vramd-7", tmp_path / "elsewhere")
    r = vramctl("export-criu", str(tmp_path / "elsewhere"), str(out_dir), "--offline")
    assert r.returncode == 1 and "--kfd ID" in r.stderr, r.stderr
