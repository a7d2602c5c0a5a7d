"""The fuzz harness's long mode: a fixed number of inputs per fuzz test, spread over the cores, counted.

    ./dev.sh fuzz                          # 150,000 inputs per decoder test (7 tests: 1,050,000 frames,
                                           # messages, manifests and records) + 20,000 request sequences
                                           # against a live daemon
    ./dev.sh fuzz --examples 10000 --daemon-examples 1000 --jobs 2

Each fuzz test runs in its own pytest process under the `long` profile with VRAMD_FUZZ_EXAMPLES
set; up to --jobs of them at once.  Hypothesis's own statistics give each test's count of inputs
tried (passing + failing; the invalid ones it discarded are reported apart), and this prints one
row a test and the totals.  Exit status: 0 when every test passed, 1 otherwise (a failure prints
the minimal example and the seed that reproduces it, as in any hypothesis run).

Not run in CI (CI runs the short `ci` profile with the rest of the suite).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

# The property tests and what one input of each is.  The daemon test's input is a sequence of 1-8
# requests over one connection.
DECODERS = {
    "test_fuzz_decoders.py::test_decode_frame_raises_only_protocol_error": "frame",
    "test_fuzz_decoders.py::test_server_protocol_never_raises_and_every_fd_has_one_owner": "packet sequence",
    "test_fuzz_decoders.py::test_client_protocol_raises_only_typed_errors_and_closes_fds": "response frame",
    "test_fuzz_decoders.py::test_decode_manifest_raises_only_image_errors": "manifest",
    "test_fuzz_decoders.py::test_the_quick_v2_checks_agree_with_the_entry_by_entry_ones": "manifest (v2 table)",
    "test_fuzz_decoders.py::test_decode_record_head_raises_only_image_errors": "record head",
    "test_fuzz_decoders.py::test_decode_chunk_raises_only_image_errors": "chunk record",
}
DAEMON = ("test_fuzz_daemon.py::test_the_daemon_answers_every_request_with_success_or_a_typed_error"
          " test_fuzz_daemon.py::test_after_the_fuzzing_the_daemon_serves_and_its_memory_is_back")

COUNTS = re.compile(r"(\d+) passing, (\d+) failing, and (\d+) invalid")


@dataclass
class Row:
    test: str
    what: str
    passing: int = 0
    failing: int = 0
    invalid: int = 0
    seconds: float = 0.0
    ok: bool = False
    tail: str = ""


def run(ids: str, examples: int, what: str, seed: int | None) -> Row:
    env = dict(os.environ, VRAMD_FUZZ_EXAMPLES=str(examples), VRAMD_FUZZ_PROFILE="long")
    cmd = [sys.executable, "-m", "pytest", *(str(HERE / i) for i in ids.split()), "-q", "-p", "no:cacheprovider",
           "--hypothesis-profile=long", "--hypothesis-show-statistics"]
    if seed is not None:
        cmd.append(f"--hypothesis-seed={seed}")
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    row = Row(ids.split()[0].split("::")[1], what, seconds=time.monotonic() - t0, ok=p.returncode == 0)
    for m in COUNTS.finditer(p.stdout):  # the generate phase's line (a failure adds a shrink phase's too)
        row.passing += int(m[1])
        row.failing += int(m[2])
        row.invalid += int(m[3])
    if not row.ok:
        row.tail = (p.stdout + p.stderr)[-4000:]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dev.sh fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=150_000, help="inputs per decoder test (default 150000)")
    ap.add_argument("--daemon-examples", type=int, default=20_000,
                    help="request sequences against a live daemon (default 20000; 0: skip)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="pytest processes at once (default: cores)")
    ap.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    ap.add_argument("--only", metavar="WORD", default="", help="only the tests whose name has WORD")
    ns = ap.parse_args(argv)

    work = [(i, ns.examples, what) for i, what in DECODERS.items() if ns.only in i]
    if ns.daemon_examples > 0 and ns.only in DAEMON:
        work.insert(0, (DAEMON, ns.daemon_examples, "request sequence (live daemon)"))  # the longest: first
    t0 = time.monotonic()
    with ThreadPoolExecutor(max(1, ns.jobs)) as pool:
        rows = list(pool.map(lambda w: run(w[0], w[1], w[2], ns.seed), work))
    wall = time.monotonic() - t0

    print(f"{'test':<68} {'one input':<32} {'tried':>9} {'failing':>7} {'invalid':>8} {'s':>7}")
    for r in rows:
        print(f"{r.test:<68} {r.what:<32} {r.passing + r.failing:>9} {r.failing:>7} {r.invalid:>8} "
              f"{r.seconds:>7.0f}  {'ok' if r.ok else 'FAILED'}")
    daemon = sum(r.passing + r.failing for r in rows if "live daemon" in r.what)
    decoded = sum(r.passing + r.failing for r in rows) - daemon
    print(f"total: {decoded} frames, messages and images through the decoders, {daemon} request sequences "
          f"against a live daemon; {sum(r.failing for r in rows)} failing; {wall:.0f} s on {ns.jobs} processes")
    bad = [r for r in rows if not r.ok]
    for r in bad:
        print(f"\n--- {r.test} FAILED ---\n{r.tail}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
