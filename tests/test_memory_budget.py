"""Peak host memory of the process doing a dump stays within the staging budget.

The engine runs in its own process; its peak RSS (VmHWM) is reset after
start-up through /proc/self/clear_refs, so the figure is what the dump
itself added.  The BO is 8x the budget and lives in another process; there are more
batches in flight (32, a dump's included) than the budget can feed, so the budget is the binding limit.
"""
import json
import subprocess
import sys
import textwrap

import pytest
from helpers import Workload

MiB = 1 << 20
BUDGET = 64 * MiB
MARGIN = 24 * MiB  # interpreter, thread stacks, protobuf objects: not BO bytes

WORKER = textwrap.dedent("""
    import json, os, sys, uvloop
    from vramd import inproc
    from vramd.engine import Engine, EngineConfig
    from vramd.image.codec import Compression
    from vramd.engine import BoSpec
    from vramd.backends import BoRef
    pid, addr, size, dirpath, budget, comp = sys.argv[1:7]
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    async def main():
        dfd = os.open(dirpath, os.O_RDONLY | os.O_DIRECTORY)
        mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        async with Engine(EngineConfig(staging_budget=int(budget), chunk_size=4 << 20, workers_per_gpu=32,
                                       dump_inflight_per_gpu=32)) as e:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")                       # reset VmHWM to the current RSS
            base = status("VmRSS")
            m = await inproc.dump(e, dfd, [BoSpec(1, int(size), BoRef("procmem", mem, int(addr)))],
                                  compression=Compression.parse(comp))
            print(json.dumps({"base": base, "hwm": status("VmHWM"), "pool_peak": e.pool.peak_in_use_bytes,
                              "allocated": e.pool.allocated_bytes, "stored": m.totals.stored_bytes}))
    uvloop.run(main())
""")


@pytest.fixture(scope="module")
def big_child():
    with Workload([{"size": 8 * BUDGET, "fill": "random", "seed": 5}]) as w:
        yield w


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_peak_rss_within_budget(big_child, tmp_path, compression):
    r = big_child.regions[0]
    out = subprocess.run([sys.executable, "-c", WORKER, str(big_child.pid), str(r["addr"]), str(r["size"]),
                          str(tmp_path), str(BUDGET), compression], check=True, capture_output=True, text=True)
    m = json.loads(out.stdout)
    grew = m["hwm"] - m["base"]
    assert m["pool_peak"] <= BUDGET and m["allocated"] <= BUDGET
    # 32 workers x 4 MiB chunks want more than the budget: the budget is what bounded them
    assert m["pool_peak"] > BUDGET * 3 // 4
    assert m["stored"] >= r["size"] * 0.99  # random data: everything really went through staging
    assert grew <= BUDGET + MARGIN, f"peak RSS grew {grew / MiB:.1f} MiB for a {BUDGET / MiB:.0f} MiB budget"
