"""bench/throughput.py's report of an earlier run: `--markdown` prints its rows as bench/README.md quotes them.

The benchmark itself is not run here (minutes of timed copies); its rows are JSON like these.
"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _row(backend, direction, strategy, size, gbps, cpu):
    return {"backend": backend, "direction": direction, "strategy": strategy, "bytes": size, "gbps": gbps,
            "cpu_s_per_gib": cpu, "seconds": size / gbps / 1e9, "seconds_min": 0.0, "spread": 1.0}


def _markdown(tmp_path, rows):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "throughput.py"), "--markdown", str(path)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_markdown_has_a_column_per_measured_strategy_in_the_bench_order(tmp_path):
    gib = 1 << 30
    rows = [_row("procmem", "dump", "vramd", gib, 3.756, 1.181), _row("procmem", "dump", "serial", gib, 1.5, 0.795),
            _row("procmem", "dump", "criu", gib, 2.214, 0.527), _row("procmem", "restore", "serial", gib, 2.37, 0.455)]
    lines = _markdown(tmp_path, rows)
    assert lines[0] == "| row | serial | vramd | criu |"
    assert lines[1] == "|---|---|---|---|"
    assert lines[2] == "| procmem dump | 1.50 · 0.80 | 3.76 · 1.18 | 2.21 · 0.53 |"
    assert lines[3] == "| procmem restore | 2.37 · 0.46 | — | — |"  # what a run did not measure is a dash
    assert len(lines) == 4


def test_markdown_names_the_size_where_a_run_had_several(tmp_path):
    rows = [_row("mmap", "dump", "vramd", 1 << 30, 4.1, 1.04), _row("mmap", "dump", "vramd", 4 << 30, 3.99, 1.13)]
    lines = _markdown(tmp_path, rows)
    assert lines[2:] == ["| 1.0 GiB, mmap dump | 4.10 · 1.04 |", "| 4.0 GiB, mmap dump | 3.99 · 1.13 |"]
