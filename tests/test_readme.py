"""The README's "Using the engine" snippet runs as printed."""
from __future__ import annotations

import re
from pathlib import Path

from helpers import ROOT, Workload, run


def test_using_the_engine_snippet_runs(tmp_path):
    text = Path(ROOT, "README.md").read_text()
    section = text[text.index("## Using the engine"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    with Workload([{"size": 3 << 20, "fill": "random", "seed": 5}]) as w:
        r = w.regions[0]
        report = run(scope["main"](str(tmp_path), w.pid, r["addr"], r["size"]))
    assert report.progress.bytes_done == 3 << 20 and report.manifest.totals.bo_count == 1
