"""KFD topology parsing, serialisation and the restore-time GPU mapping (vramd/topology.py).

The trees under tests/fixtures/topology/ come from make_fixtures.py there; variants are
built with the same generator into tmp_path.
"""
import filecmp
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

from vramd import errors
from vramd.topology import (
    CHECK_ENV,
    Checks,
    Cpu,
    Gpu,
    Topology,
    TopologyError,
    TopologyMismatchError,
    compare_gpus,
    map_gpus,
    parse_properties,
    parse_topology,
    render_node,
)

FIXTURES = Path(__file__).parent / "fixtures" / "topology"
GiB = 1 << 30

_spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
mk = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("make_fixtures", mk)
_spec.loader.exec_module(mk)


def fixture(name: str) -> Topology:
    return parse_topology(FIXTURES / name / "nodes")


def build(tmp_path: Path, name: str, nodes: dict) -> Topology:
    return parse_topology(mk.write_tree(tmp_path / name, nodes))


# --- the fixture trees ---------------------------------------------------------

def test_committed_fixtures_match_the_generator(tmp_path):
    mk.main(tmp_path)
    for name in mk.FIXTURES:
        cmp = filecmp.dircmp(FIXTURES / name, tmp_path / name)
        stack = [cmp]
        while stack:
            c = stack.pop()
            assert not (c.left_only or c.right_only or c.diff_files), \
                (name, c.left, c.left_only, c.right_only, c.diff_files)
            stack.extend(c.subdirs.values())


@pytest.mark.parametrize("name,gpu_ids,cpus,minors,hives", [
    ("mi300x-8gpu-xgmi", mk.MI300X_IDS, 2, [128 + 8 * k for k in range(8)], [8]),
    ("2gpu-pcie", [0x8A3C, 0x1E5B], 1, [128, 129], []),
    ("2gpu-pcie-host2", [0xC017, 0x2B94], 1, [129, 130], []),
    ("2gpu-pcie-oldfw", [0x8A3C, 0x1E5B], 1, [128, 129], []),
    ("1gpu", [0x4E1D], 1, [128], []),
])
def test_parse_fixture(name, gpu_ids, cpus, minors, hives):
    t = fixture(name)
    assert [g.gpu_id for g in t.gpus] == gpu_ids
    assert len(t.cpus) == cpus and all(isinstance(c, Cpu) and c.cpu_cores_count > 0 for c in t.cpus)
    assert [g.render_minor for g in t.gpus] == minors
    assert [render_node(g) for g in t.gpus] == [f"/dev/dri/renderD{m}" for m in minors]
    assert [len(h) for h in t.hives()] == hives
    assert not t.skipped
    assert [n.index for n in t.nodes] == list(range(len(gpu_ids) + cpus))
    for g in t.gpus:
        assert t.gpu(g.gpu_id) is g and g.node == g.index
        # every key of the file is kept, as an int, including ones CRIU does not read
        assert {"gfx_target_version", "p2p_links_count", "unique_id", "location_id", "cpu_core_id_base",
                "simd_id_base", "local_mem_size", "num_xcc"} <= set(g.properties)
        assert g.prop("local_mem_size") == 0  # the kernel always prints 0: VRAM comes from mem_banks
        assert g.vram_bytes > 0 and g.mem_banks[0]["size_in_bytes"] == g.vram_bytes


def test_mi300x_details():
    t = fixture("mi300x-8gpu-xgmi")
    g = t.gpus[0]
    assert isinstance(g, Gpu) and g.name == "ip discovery"
    assert (g.vendor_id, g.device_id) == (0x1002, 0x74A1)
    assert (g.num_sdma_engines, g.num_sdma_xgmi_engines, g.num_sdma_queues_per_engine) == (2, 14, 8)
    assert g.vram_bytes == 206141652992 and g.vram_public
    assert {x.hive_id for x in t.gpus} == {mk.MI300X_HIVE}
    assert [x.index for x in t.hives()[0]] == list(range(2, 10))
    # GPUs 0-3 hang off CPU node 0, 4-7 off CPU node 1
    assert [t.cpu_of(x) for x in t.gpus] == [[0]] * 4 + [[1]] * 4
    # links: one PCIe to the CPU, seven XGMI to the peers, all two-way
    assert [lk.type_name for lk in g.io_links] == ["PCIe"] + ["XGMI"] * 7
    assert all(t.is_bidirectional(lk) for lk in g.io_links) and g.prop("io_links_count") == 8
    # the recommended SDMA mask is per link: the PCIe engines towards the CPU, one engine per XGMI peer
    masks = g.recommended_sdma_engine_id_mask
    assert masks[0] == 0b11 == g.sdma_engine_mask(0)
    peers = [masks[i] for i in range(3, 10)]
    assert all(bin(m).count("1") == 1 for m in peers) and len(set(peers)) == 7
    assert g.sdma_engine_mask(42) is None
    # CPU-CPU links are kept but not used for mapping (CRIU keeps PCIe and XGMI only)
    cpu0 = t.node(0)
    assert cpu0.io_links[0].type_name == "HyperTransport" and cpu0.io_links[0] not in t.valid_links(cpu0)
    assert len(t.valid_links(cpu0)) == 4 and len(t.links) == 8 * 8 + 2 * 5
    assert "XGMI hives of 8" in t.summary() and "renderD184" in t.describe()


def test_pcie_and_single_gpu_details():
    t = fixture("2gpu-pcie")
    a, _ = t.gpus
    assert a.hive_id == 0 and not t.hives()
    assert (a.num_sdma_engines, a.num_sdma_xgmi_engines) == (2, 3)
    assert [(lk.node_to, lk.type_name, lk.p2p) for lk in a.p2p_links] == [(2, "PCIe", True)]
    assert t.valid_links(a) == a.io_links and len(a.io_links) == 1  # p2p links are not io links
    assert 63 * GiB < a.vram_bytes <= 64 * GiB
    one = fixture("1gpu").gpus[0]
    assert not one.vram_public and one.prop("wave_front_size") == 32 and one.num_sdma_xgmi_engines == 0


# --- serialisation ---------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(mk.FIXTURES))
def test_dict_round_trip(name):
    t = fixture(name)
    d = json.loads(json.dumps(t.to_dict()))
    back = Topology.from_dict(d)
    assert back == t and back.to_dict() == t.to_dict()
    assert [type(n) for n in back.nodes] == [type(n) for n in t.nodes]
    assert [len(h) for h in back.hives()] == [len(h) for h in t.hives()]
    assert map_gpus(back, t) == {g.gpu_id: g.gpu_id for g in t.gpus}


@pytest.mark.parametrize("mutate,msg", [
    (lambda d: d.update(format="other"), "not a saved topology"),
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d["nodes"][1].pop("gpu_id"), "malformed"),
    (lambda d: d["nodes"][1]["properties"].update(simd_count="416"), "malformed"),
    (lambda d: d["nodes"][1]["io_links"][0].pop("node_to"), "malformed"),
    (lambda d: d["nodes"][2].update(gpu_id=d["nodes"][1]["gpu_id"]), "gpu_id"),
])
def test_from_dict_rejects(mutate, msg):
    d = fixture("2gpu-pcie").to_dict()
    mutate(d)
    with pytest.raises(TopologyError, match=msg):
        Topology.from_dict(d)


# --- mapping ---------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(mk.FIXTURES))
def test_identity_on_the_same_machine(name):
    t = fixture(name)
    assert map_gpus(t, fixture(name)) == {g.gpu_id: g.gpu_id for g in t.gpus}


def test_same_model_renumbered():
    src, dst = fixture("2gpu-pcie"), fixture("2gpu-pcie-host2")
    assert map_gpus(src, dst) == {0x8A3C: 0xC017, 0x1E5B: 0x2B94}


def test_mi300x_renumbered_hive_kept(tmp_path):
    ids = [0x0101 * (k + 1) for k in range(8)]
    dst = build(tmp_path, "host2", mk.mi300x_8gpu(ids=ids, hive=0x1234))
    m = map_gpus(fixture("mi300x-8gpu-xgmi"), dst)
    assert m == dict(zip(mk.MI300X_IDS, ids))


def _two_hives(dev_a: int, dev_b: int, ids) -> dict:
    """8 MI300X-like GPUs in two hives of 4: hive 1 with device_id dev_a, hive 2 dev_b."""
    gpus = [mk.GpuSpec(mk.MI300X, ids[k], k % 2, 128 + k, 0x10 + k, k, 1 if k < 4 else 2,
                       {"device_id": dev_a if k < 4 else dev_b}) for k in range(8)]
    return mk.machine([mk.CpuSpec(96, 0), mk.CpuSpec(96, 96)], gpus)


def test_hives_placed_whole(tmp_path):
    # As CRIU's test 0: the hives' device ids are swapped between the machines, so the
    # checkpoint's first hive must land on the present second hive, and the other way round.
    src = build(tmp_path, "src", _two_hives(0xD000, 0xD001, [0xA000 + k for k in range(8)]))
    dst = build(tmp_path, "dst", _two_hives(0xD001, 0xD000, [0xB000 + k for k in range(8)]))
    m = map_gpus(src, dst)
    dst_hive_of = {g.gpu_id: i for i, h in enumerate(dst.hives()) for g in h}
    for hive in src.hives():
        assert len({dst_hive_of[m[g.gpu_id]] for g in hive}) == 1  # a hive stays together
        assert {dst.gpu(m[g.gpu_id]).device_id for g in hive} == {hive[0].device_id}
    assert sorted(m.values()) == sorted(g.gpu_id for g in dst.gpus)


def test_more_checkpoint_hives_than_present(tmp_path):
    src = build(tmp_path, "src", _two_hives(0xD000, 0xD000, [0xA000 + k for k in range(8)]))
    with pytest.raises(TopologyMismatchError, match=r"2 XGMI hive\(s\) \(sizes 4, 4\), here 1 \(sizes 8\)"):
        map_gpus(src, fixture("mi300x-8gpu-xgmi"))


def test_gpu_count_must_match():
    with pytest.raises(TopologyMismatchError, match="GPU counts must be equal") as ei:
        map_gpus(fixture("1gpu"), fixture("2gpu-pcie"))
    assert ei.value.code == "TOPOLOGY_MISMATCH"


def test_older_firmware_is_refused_and_named():
    with pytest.raises(TopologyMismatchError) as ei:
        map_gpus(fixture("2gpu-pcie"), fixture("2gpu-pcie-oldfw"))
    e = ei.value
    msg = str(e)
    assert isinstance(e, errors.VramdError) and e.code == "TOPOLOGY_MISMATCH"
    assert "gpu 0x1e5b (node 2) cannot be placed" in msg
    assert "candidate 0x1e5b (node 2): fw_version 71 < 78 (KFD_FW_VER_CHECK)" in msg
    assert "candidate 0x8a3c (node 1): compatible, but needed by gpu 0x8a3c" in msg
    assert "hint: a mapping exists with KFD_FW_VER_CHECK=0" in msg
    assert e.unplaced[0x1E5B][0x1E5B] == ["fw_version 71 < 78 (KFD_FW_VER_CHECK)"]
    assert e.to_dict()["code"] == "TOPOLOGY_MISMATCH"
    # the wire code finds the class again
    assert errors.error_class("TOPOLOGY_MISMATCH") is TopologyMismatchError


@pytest.mark.parametrize("value", ["0", "no", "NO", "No"])
def test_older_firmware_allowed_when_the_check_is_off(value):
    checks = Checks.from_env({"KFD_FW_VER_CHECK": value})
    assert not checks.fw_version and checks.disabled() == ["KFD_FW_VER_CHECK"]
    assert map_gpus(fixture("2gpu-pcie"), fixture("2gpu-pcie-oldfw"), checks) == {0x8A3C: 0x8A3C, 0x1E5B: 0x1E5B}


def test_newer_firmware_is_fine():
    # the direction is: present >= checkpoint
    assert map_gpus(fixture("2gpu-pcie-oldfw"), fixture("2gpu-pcie")) == {0x8A3C: 0x8A3C, 0x1E5B: 0x1E5B}


def test_smaller_vram(tmp_path):
    small = build(tmp_path, "small", mk.two_gpu_pcie(overrides={0: {"vram": 32 * GiB}, 1: {"vram": 64 * GiB}}))
    big = build(tmp_path, "big", mk.two_gpu_pcie(overrides={0: {"vram": 64 * GiB}, 1: {"vram": 64 * GiB}}))
    with pytest.raises(TopologyMismatchError) as ei:
        map_gpus(big, small)
    msg = str(ei.value)
    assert "gpu 0x1e5b (node 2) cannot be placed" in msg or "gpu 0x8a3c (node 1) cannot be placed" in msg
    assert "candidate 0x8a3c (node 1): vram 32.0 GiB < 64.0 GiB (KFD_VRAM_SIZE_CHECK)" in msg
    assert "hint: a mapping exists with KFD_VRAM_SIZE_CHECK=0" in msg
    assert map_gpus(big, small, Checks.from_env({"KFD_VRAM_SIZE_CHECK": "0"}))
    assert map_gpus(small, big) == {0x8A3C: 0x8A3C, 0x1E5B: 0x1E5B}


@pytest.mark.parametrize("var,key,lower", [
    ("KFD_SDMA_FW_VER_CHECK", "sdma_fw_version", 7),
    ("KFD_CACHES_COUNT_CHECK", "caches_count", 200),
    ("KFD_NUM_GWS_CHECK", "num_gws", 32),
    ("KFD_CAPABILITY_CHECK", "capability", 0x2C8B2281),
])
def test_each_relaxable_check(tmp_path, var, key, lower):
    dst = build(tmp_path, "dst", mk.two_gpu_pcie(overrides={0: {key: lower}, 1: {key: lower}}))
    with pytest.raises(TopologyMismatchError, match=rf"\({var}\)"):
        map_gpus(fixture("2gpu-pcie"), dst)
    assert map_gpus(fixture("2gpu-pcie"), dst, Checks.from_env({var: "0"})) == {0x8A3C: 0x8A3C, 0x1E5B: 0x1E5B}


def test_exact_properties_cannot_be_switched_off(tmp_path):
    dst = build(tmp_path, "dst", mk.two_gpu_pcie(overrides={0: {"device_id": 0x740C}, 1: {"device_id": 0x740C}}))
    off = Checks.from_env(dict.fromkeys(CHECK_ENV.values(), "0"))
    with pytest.raises(TopologyMismatchError) as ei:
        map_gpus(fixture("2gpu-pcie"), dst, off)
    assert "device_id 0x740c != 0x740f" in str(ei.value) and "hint" not in str(ei.value)
    assert compare_gpus(fixture("1gpu").gpus[0], fixture("2gpu-pcie").gpus[0])  # different models


@pytest.mark.parametrize("env,expect", [
    ({}, Checks()),
    ({"KFD_NUMA_CHECK": "0", "KFD_CAPABILITY_CHECK": "yes"}, Checks(numa=False)),
    ({"KFD_VRAM_SIZE_CHECK": "NO", "KFD_NUM_GWS_CHECK": "1"}, Checks(vram_size=False)),
    # CRIU ignores anything but 0/1/yes/no (case-insensitive words): the default stays
    ({"KFD_FW_VER_CHECK": "false", "KFD_SDMA_FW_VER_CHECK": "off", "KFD_CACHES_COUNT_CHECK": " 0"}, Checks()),
])
def test_checks_from_env(env, expect):
    assert Checks.from_env(env) == expect


def test_checks_from_os_environ(monkeypatch):
    monkeypatch.setenv("KFD_NUMA_CHECK", "no")
    assert Checks.from_env() == Checks(numa=False)


# --- NUMA --------------------------------------------------------------------------

def _numa_machine(cpu_of_gpu, ids) -> dict:
    gpus = [mk.GpuSpec(mk.MI210, ids[k], c, 128 + k, 0x10 + k, k) for k, c in enumerate(cpu_of_gpu)]
    return mk.machine([mk.CpuSpec(32, 0), mk.CpuSpec(32, 32)], gpus)


def test_numa_regions_kept(tmp_path):
    src = build(tmp_path, "src", _numa_machine([0, 1], [0xA0, 0xA1]))
    # the same shape with the sockets' roles swapped: a consistent CPU renaming exists
    dst = build(tmp_path, "dst", _numa_machine([1, 0], [0xB0, 0xB1]))
    assert map_gpus(src, dst) == {0xA0: 0xB0, 0xA1: 0xB1}
    # both GPUs on one socket: the two checkpoint CPU nodes would have to become one
    one = build(tmp_path, "one", _numa_machine([0, 0], [0xB0, 0xB1]))
    with pytest.raises(TopologyMismatchError) as ei:
        map_gpus(src, one)
    msg = str(ei.value)
    assert "each checkpoint CPU node must map to one CPU node here (KFD_NUMA_CHECK)" in msg
    assert "gpu 0x00a1 (node 3) cannot be placed" in msg
    assert "candidate 0x00b0 (node 2): compatible, but taken by gpu 0x00a0" in msg
    assert "candidate 0x00b1 (node 3): its CPU node(s) [0] are taken: CPU node 0 stands for checkpoint CPU node 0" \
           " (KFD_NUMA_CHECK)" in msg
    assert "hint: a mapping exists with KFD_NUMA_CHECK=0" in msg
    assert map_gpus(src, one, Checks.from_env({"KFD_NUMA_CHECK": "0"})) == {0xA0: 0xB0, 0xA1: 0xB1}
    # and the other way: two GPUs of one checkpoint socket may not be split over two sockets
    with pytest.raises(TopologyMismatchError, match="KFD_NUMA_CHECK"):
        map_gpus(one, src)
    assert map_gpus(one, src, Checks(numa=False))


def test_numa_mi300x_uneven_sockets(tmp_path):
    ids = [0x0101 * (k + 1) for k in range(8)]
    dst = build(tmp_path, "dst", mk.mi300x_8gpu(ids=ids, cpu_of=lambda k: 0 if k < 5 else 1))
    src = fixture("mi300x-8gpu-xgmi")
    with pytest.raises(TopologyMismatchError, match="KFD_NUMA_CHECK"):
        map_gpus(src, dst)
    m = map_gpus(src, dst, Checks(numa=False))
    assert sorted(m.values()) == sorted(ids)
    # with the check on, a mapping that exists keeps each socket's GPUs on one socket
    swapped = build(tmp_path, "swapped", mk.mi300x_8gpu(ids=ids, cpu_of=lambda k: 1 - k // 4))
    m = map_gpus(src, swapped)
    for cpu in (0, 1):
        placed = {swapped.cpu_of(swapped.gpu(m[g.gpu_id]))[0] for g in src.gpus if src.cpu_of(g) == [cpu]}
        assert len(placed) == 1


def test_gpu_without_a_cpu_link_cannot_replace_one_with(tmp_path):
    src = fixture("2gpu-pcie")
    dst = build(tmp_path, "dst", mk.machine([mk.CpuSpec(32)], [
        mk.GpuSpec(mk.MI210, 0x8A3C, 0, 128, 0x41, 1), mk.GpuSpec(mk.MI210, 0x1E5B, 0, 129, 0xC1, 2)],
        p2p=True, gpu_cpu_links=False))
    with pytest.raises(TopologyMismatchError, match="io_links_count 0 != 1"):
        map_gpus(src, dst, Checks(numa=False))


# --- unreadable nodes ----------------------------------------------------------------
# Tests run as root, so chmod 000 would not stop the reads. What masking looks like to a
# reader is a read that fails (the kernel answers EPERM for a GPU the device cgroup hides),
# so these simulate failing reads: a missing properties file, and a gpu_id that is a
# directory (reading it fails with EISDIR).

def test_node_without_properties_is_skipped(tmp_path):
    root = tmp_path / "t"
    shutil.copytree(FIXTURES / "2gpu-pcie", root)
    (root / "nodes" / "2" / "properties").unlink()
    t = parse_topology(root / "nodes")
    assert [g.gpu_id for g in t.gpus] == [0x8A3C]
    assert [s.index for s in t.skipped] == [2] and "properties" in t.skipped[0].reason
    cpu = t.node(0)
    assert len(cpu.io_links) == 2 and [lk.node_to for lk in t.valid_links(cpu)] == [1]  # link to node 2 is not valid
    assert "1 node(s) unreadable: 2" in t.summary()
    assert Topology.from_dict(t.to_dict()).skipped == t.skipped
    with pytest.raises(TopologyMismatchError, match=r"(?s)GPU counts must be equal.*unreadable: 2"):
        map_gpus(fixture("2gpu-pcie"), t)


def test_unreadable_gpu_id_and_link_are_skipped(tmp_path):
    root = tmp_path / "t"
    shutil.copytree(FIXTURES / "mi300x-8gpu-xgmi", root)
    gid = root / "nodes" / "9" / "gpu_id"
    gid.unlink()
    gid.mkdir()
    link = root / "nodes" / "2" / "io_links" / "7" / "properties"
    link.unlink()
    link.mkdir()
    t = parse_topology(root / "nodes")
    assert len(t.gpus) == 7 and [s.index for s in t.skipped] == [9]
    assert len(t.node(2).io_links) == 7  # the unreadable link is left out, the node stays
    assert [len(h) for h in t.hives()] == [7]


def test_not_a_topology(tmp_path):
    with pytest.raises(TopologyError, match="no KFD topology"):
        parse_topology(tmp_path / "missing")
    (tmp_path / "nodes" / "x").mkdir(parents=True)  # non-numeric entries are ignored
    assert parse_topology(tmp_path / "nodes").nodes == []


def test_parse_properties_tolerates_odd_lines(caplog):
    props = parse_properties("a 1\n\nb 18446744073709551615\nunique_id 0a1b\nnovalue\nc -1\n")
    assert props == {"a": 1, "b": 2**64 - 1}
    assert "unique_id 0a1b" in caplog.text


def test_render_node():
    t = fixture("1gpu")
    assert render_node(t.gpus[0]) == "/dev/dri/renderD128"
    with pytest.raises(TopologyError, match="not a GPU"):
        render_node(t.cpus[0])
    d = t.to_dict()
    d["nodes"][1]["properties"]["drm_render_minor"] = 0
    with pytest.raises(TopologyError, match="not a render node"):
        render_node(Topology.from_dict(d).gpus[0])
