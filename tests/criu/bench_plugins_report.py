"""bench_plugins.py's report: the table (MODEL NUMBERS) and a verdict per target of issue 34, naming the
stage that holds a missed target back (CRIU's own log stamps)."""

from __future__ import annotations

GIB = 1 << 30


def _cpu(m: dict) -> float:
    return m["criu_cpu_s"] + m["task_cpu_s"] + m["daemon_cpu_s"]


def _rest(m: dict) -> float:
    return m["wall_s"] - m.get("before_copy_s", 0.0) - m.get("copy_s", 0.0)


def _held_back(res: dict, what: str) -> str:
    """The stage of vramd's side that grew most against stock's (CRIU's log stamps)."""
    s, w = res["median"]["stock"][what], res["median"]["vramd"][what]
    if "copy_s" not in s or "copy_s" not in w:
        return "stages not found in the logs"
    d = {
        "CRIU before the BO copy": w["before_copy_s"] - s["before_copy_s"],
        "the BO copy (plugin span)": w["copy_s"] - s["copy_s"],
        "CRIU after the copy": _rest(w) - _rest(s),
    }
    stage = max(d, key=lambda k: d[k])
    return f"held back by {stage}: +{d[stage]:.2f} s vs stock ({', '.join(f'{k} {x:+.2f}' for k, x in d.items())})"


def _per_bo_cpu(m: dict) -> str:
    """Where a many-BO step's CPU went (its whole step; the BO stage is most of it): which side's per-BO work
    holds the rate back."""
    parts = {
        "criu (its own work, the plugin, libvramd)": m["criu_cpu_s"],
        "the restored tasks (the plugin, libvramd)": m["task_cpu_s"],
        "the daemon (intake, opens and imports, per-chunk work)": m["daemon_cpu_s"] - m["model_copy_daemon_cpu_s"],
        "the SDMA model's copying": m["model_copy_cpu_s"],
    }
    top = max(parts, key=lambda k: parts[k])
    return (f"the BO stage {m['copy_s']:.2f} s of {m['wall_s']:.2f} s; most CPU in {top}: "
            + ", ".join(f"{k} {x:.2f} s" for k, x in parts.items()))


def table(results: list[dict]) -> list[str]:
    out = [
        "| shape | plugin | step | wall s | criu CPU s | task CPU s | daemon CPU s | model copy CPU s | "
        "CPU s/GiB | hw CPU s/GiB | image MiB | BOs/s | byte-exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for side in ("stock", "vramd"):
            med = res["median"][side]
            gib = med["bytes"] / GIB
            for what in ("dump", "restore"):
                m = med[what]
                if "failed" in m:
                    out.append(f"| {res['shape']} | {side} | {what} | **failed**: {m['failed']} |" + " |" * 9)
                    continue
                model = m["model_copy_cpu_s"]
                img = f"{m['image_bytes'] / (1 << 20):.0f}" if what == "dump" else ""
                exact = "" if what == "dump" else ("yes" if m["byte_exact"] else "**no**")
                out.append(
                    f"| {res['shape']} | {side} | {what} | {m['wall_s']:.2f} | {m['criu_cpu_s']:.2f} | "
                    f"{m['task_cpu_s']:.2f} | {m['daemon_cpu_s']:.2f} | {model:.2f} | "
                    f"{_cpu(m) / gib:.2f} | {(_cpu(m) - model) / gib:.2f} | {img} | "
                    f"{med['bos'] / m['wall_s']:.0f} | {exact} |"
                )
    return out


def verdicts(results: list[dict], hash_rate: float) -> list[str]:
    by = {r["shape"]: r["median"] for r in results}
    res = {r["shape"]: r for r in results}
    out = []

    def failed(shape: str, what: str, target: str) -> bool:
        for side in ("stock", "vramd"):
            if "failed" in by[shape][side][what]:
                out.append(
                    f"- {target}: {shape} {what}: **not judged**: {side} failed: {by[shape][side][what]['failed']}"
                )
                return True
        return False

    def wall(shape: str, what: str, factor: float, target: str) -> None:
        if failed(shape, what, target):
            return
        s, w = by[shape]["stock"][what]["wall_s"], by[shape]["vramd"][what]["wall_s"]
        ok = w <= factor * s
        if not by[shape]["vramd"]["restore"]["byte_exact"]:
            out.append(f"- {target}: {shape} {what}: **not judged**: vramd's restore was not byte-exact")
            return
        note = (
            ""
            if by[shape]["stock"]["restore"]["byte_exact"] or what == "dump"
            else " (the stock restore was not byte-exact: it skipped work)"
        )
        out.append(
            f"- {target}: {shape} {what} vramd {w:.2f} s vs stock {s:.2f} s = {w / s:.2f} x "
            f"(target <= {factor:.2f}): **{'met' if ok else 'missed'}**{note}"
            + ("" if ok else f"; {_held_back(res[shape], what)}")
        )

    if "tree" in by:
        wall("tree", "restore", 0.70, "two-process tree restore")
    if "disk" in by:
        wall("disk", "dump", 0.85, "one process, 2 GPUs, image on disk")
        wall("disk", "restore", 0.85, "one process, 2 GPUs, image on disk")
        m = by["disk"]["vramd"]["restore"]
        if "copy_s" in m and m["byte_exact"]:
            criu_alone = m["wall_s"] - m.get("barrier_wait_s", 0.0)
            bound = 1.10 * max(criu_alone, m["copy_s"])
            out.append(
                f"- restore wall <= 1.10 x max(CRIU alone {criu_alone:.2f} s (wall less the barrier wait), "
                f"vramd's copy {m['copy_s']:.2f} s (submit to done)): {m['wall_s']:.2f} s vs {bound:.2f} s: "
                f"**{'met' if m['wall_s'] <= bound else 'missed'}**"
            )
    if "tmpfs" in by:
        wall("tmpfs", "dump", 1.0, "image on tmpfs")
        wall("tmpfs", "restore", 1.0, "image on tmpfs")
        for what in ("dump", "restore"):
            if failed("tmpfs", what, f"tmpfs {what} CPU/GiB"):
                continue
            s, w = (by["tmpfs"][x] for x in ("stock", "vramd"))
            sg, wg = _cpu(s[what]) / (s["bytes"] / GIB), _cpu(w[what]) / (w["bytes"] / GIB)
            extra = hash_rate if what == "dump" else hash_rate / 2  # xxh3 only at restore: an upper bound
            ok = wg <= sg + extra
            out.append(
                f"- tmpfs {what} CPU/GiB: vramd {wg:.2f} vs stock {sg:.2f} + hashing {extra:.2f} s/GiB: "
                f"**{'met' if ok else 'missed'}**"
            )
    if "small" in by:
        small = by["small"]
        n = small["vramd"]["bos"]
        # a restore that is not byte-exact may have skipped work: the rate is shown, marked, and not judged
        caveat = "" if small["vramd"]["restore"]["byte_exact"] else " (vramd's restore not byte-exact)"
        for what in ("dump", "restore"):
            if failed("small", what, f"{n} small BOs"):
                continue
            m, st = small["vramd"][what], small["stock"][what]
            if "copy_s" not in m or not m["copy_s"]:
                out.append(f"- {n} small BOs, vramd {what}: **not judged**: the plugin's copy stage not in the log")
                continue
            rate, stock_rate = n / m["copy_s"], n / st.get("copy_s", float("inf"))
            verdict = "not judged" if caveat else ("met" if rate >= 10000 else "missed")
            out.append(
                f"- {n} small BOs, vramd {what}: {rate:.0f} BOs/s through the plugin's BO stage (stock "
                f"{stock_rate:.0f}; over criu's whole wall {n / m['wall_s']:.0f}) (target >= 10000): **{verdict}**"
                + caveat
                + ("" if caveat or rate >= 10000 else f"; {_per_bo_cpu(m)}; {_held_back(res['small'], what)}")
            )
    return out
