"""bench/corpus.py is deterministic, and bench/image_size.py runs end to end (tiny scale, no torch).

The torch parts of the corpus (MiniLM's weights, the trained transformer) are not
generated here: CI does not install torch (pyproject's `bench` extra).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import corpus  # noqa: E402
import image_size  # noqa: E402

SCALE = 0.02  # 8 KV BOs and one slack BO of 2 MiB each


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.bin"))}


def test_corpus_without_torch_is_deterministic(tmp_path):
    a = corpus.open_corpus(str(tmp_path / "a"), SCALE, use_torch=False, log=lambda _: None)
    b = corpus.open_corpus(str(tmp_path / "b"), SCALE, use_torch=False, log=lambda _: None)
    fa, fb = _files(Path(a.root)), _files(Path(b.root))
    assert fa and fa == fb
    strip = {"seconds"}
    assert {k: v for k, v in a.index.items() if k not in strip} == {k: v for k, v in b.index.items() if k not in strip}
    assert {x.group for x in a.bos} == {"kv", "slack"}
    assert all(x.size % corpus.BO_ALIGN == 0 for x in a.bos)
    kv = a.group("kv")
    # partially filled: zeros inside every KV BO; inference rewrites the KV cache, nothing else changes
    assert all(0 < x.nonzero["base"] < x.size for x in kv)
    assert a.total(what="changed", state="inference") == sum(x.changed["inference"] for x in kv) > 0
    assert a.group("slack")[0].nonzero["base"] == 0


def test_corpus_cache_is_reused_and_a_stale_one_rebuilt(tmp_path):
    logs: list[str] = []
    c = corpus.open_corpus(str(tmp_path), SCALE, use_torch=False, log=logs.append)
    assert any("generating" in m for m in logs)
    logs.clear()
    corpus.open_corpus(str(tmp_path), SCALE, use_torch=False, log=logs.append)
    assert logs == []  # from the cache
    stamp = Path(c.root) / "corpus.json"
    index = json.loads(stamp.read_text())
    index["generator_version"] = -1
    stamp.write_text(json.dumps(index))
    c2 = corpus.open_corpus(str(tmp_path), SCALE, use_torch=False, log=logs.append)
    assert any("stale" in m for m in logs)
    assert c2.index["generator_version"] == corpus.GENERATOR_VERSION


def test_diff_and_nonzero_helpers():
    a = bytearray(3 * corpus.PAGE)
    b = bytearray(a)
    b[5] = 1
    b[2 * corpus.PAGE + 7] = 2
    assert corpus.nonzero_bytes(a) == 0
    assert corpus.nonzero_bytes(b) == 2 * corpus.PAGE
    assert corpus.diff_bytes(a, b) == (2, 2 * corpus.PAGE)


def test_image_size_end_to_end(tmp_path):
    """The real script, as a user runs it: every codec, single and replicas (dedup on and off)."""
    out = tmp_path / "out.json"
    shm = tmp_path / "shm"
    shm.mkdir()
    codecs = ("none", "zstd:1", "bplanes", "auto")
    r = subprocess.run([sys.executable, str(BENCH / "image_size.py"), "--cache", str(tmp_path / "cache"),
                        "--scale", str(SCALE), "--no-torch", "--codecs", ",".join(codecs), "--reps", "1",
                        "--shm", str(shm), "--scenarios", "single,replicas", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    rows = {(x["scenario"], x["codec"]): x for x in res["rows"]}
    assert set(rows) == {(s, c) for s in ("single", "replicas (dedup=on)", "replicas (dedup=off)") for c in codecs}
    single = rows[("single", "none")]
    on, off = rows[("replicas (dedup=on)", "none")], rows[("replicas (dedup=off)", "none")]
    assert res["corpus"]["replica_group"] == "kv"  # no torch: no training state to replicate
    assert on["raw_bytes"] == corpus.REPLICAS * res["corpus"]["groups"]["kv"]["bytes"]
    assert single["raw_bytes"] == res["corpus"]["bytes"]
    assert rows[("single", "zstd:1")]["stored_bytes"] < single["stored_bytes"]
    assert on["stored_bytes"] * corpus.REPLICAS <= off["stored_bytes"] * 1.01  # one replica stored, not four
    assert all(x["dump_gbps"] > 0 and x["restore_gbps"] > 0 for x in res["rows"])
    assert os.listdir(shm) == []  # images removed


def test_incremental_and_chain_scenarios_run(tmp_path, capsys):
    """Child images over a parent, and a 3-image chain against its flattened copy; the bench checks every
    restore byte for byte and exits on a mismatch."""
    out = tmp_path / "out.json"
    assert image_size.main(["--cache", str(tmp_path / "cache"), "--scale", str(SCALE), "--no-torch",
                            "--codecs", "none", "--reps", "1", "--shm", str(tmp_path),
                            "--scenarios", "incremental,chain", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {x["scenario"] for x in res["rows"]} == {"inference", "finetune", "training", "chain3"}
    inference = next(x for x in res["rows"] if x["scenario"] == "inference")
    assert inference["changed_bytes"] > 0 and inference["stored_bytes"] < inference["full_image_stored"]
    assert {v["status"] for v in res["targets"]} <= {"met", "MISSED", "n/a"}
    assert "chain" in capsys.readouterr().out
