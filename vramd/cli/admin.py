"""The daemon's view: `vramctl status`, `sessions`, `cancel` and `selftest`."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Any

from ..units import format_size
from .common import EXIT_OK, Failure, connect, daemon_uid, emit, gbps, session_dict


def cmd_status(ns: argparse.Namespace) -> int:
    with connect(ns) as c:
        st = c.status()
    backends = [{"name": b.name, "available": b.available, "can_read": b.can_read, "can_write": b.can_write,
                 "asynchronous_dma": b.asynchronous_dma, "reason": b.reason} for b in st.backends]
    data = {"server": st.server, "protocol_version": st.version, "uptime_s": round(st.uptime_s, 3),
            "connections": st.connections, "sessions": st.sessions, "staging_budget": st.staging_budget,
            "staging_in_use": st.staging_in_use, "draining": st.draining, "backends": backends,
            "socket": c.path, "metrics": st.metrics}
    text = [f"{st.server} on {c.path}: up {st.uptime_s:.0f} s{', draining' if st.draining else ''}",
            f"{st.connections} connection(s), {st.sessions} session(s); staging {format_size(st.staging_in_use)} "
            f"in use of {format_size(st.staging_budget)}",
            "backends: " + ", ".join(b.name + ("" if b.available else f" (unavailable: {b.reason})")
                                     for b in st.backends),
            "metrics:"]
    text += ["  " + line for line in st.metrics.splitlines() if line and not line.startswith("#")]
    emit(ns, data, "\n".join(text))
    return EXIT_OK


def format_age(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s // 60 % 60:02d}m"


def sessions_table(rows: list[dict[str, Any]]) -> list[str]:
    """The admin view: every column an operator needs to decide what to cancel."""
    head = (f"{'id':>6} {'uid':>6} {'pid':>8} {'target':>8} {'kind':>7} {'state':>10} {'bytes done/total':>21} "
            f"{'rate':>11} {'age':>7}  label / error")
    lines = [head]
    for r in rows:
        p = r["progress"]
        targets = ",".join(map(str, r["target_pids"])) or "-"
        err = r.get("error")
        note = r["label"] + (f"  {err['code']}: {err['message']}" if err else "")
        lines.append(f"{r['session_id']:>6} {r['uid']:>6} {r['pid']:>8} {targets:>8} {r['kind']:>7} "
                     f"{r['state']:>10} {format_size(p['bytes_done']):>10}/{format_size(p['bytes_total']):<10} "
                     f"{gbps(r['rate_bytes_per_s']):>11} {format_age(r['age_s']):>7}  {note}")
    return lines


def cmd_sessions(ns: argparse.Namespace) -> int:
    with connect(ns) as c:
        infos = c.sessions()  # root and the daemon's uid get every uid's; others their own
        me, daemon = os.geteuid(), daemon_uid(c)
    if ns.all and me not in (0, daemon):  # said on stderr: stdout stays what scripts parse
        print(f"vramctl: sessions --all shows you only your own sessions (uid {me}): every uid's are shown only "
              f"to root and the daemon's user (uid {daemon})", file=sys.stderr)
    if not ns.all:
        infos = [i for i in infos if i.uid == os.getuid()]
    rows = [session_dict(i) for i in infos]
    if ns.all:
        text = sessions_table(rows)
    else:
        text = [f"{'id':>6} {'kind':>8} {'state':>10} {'uid':>6} {'pid':>8} {'bos':>13} {'bytes':>21}  label"]
        for r in rows:
            p = r["progress"]
            text.append(f"{r['session_id']:>6} {r['kind']:>8} {r['state']:>10} {r['uid']:>6} {r['pid']:>8} "
                        f"{p['bos_done']:>6}/{p['bos_total']:<6} {format_size(p['bytes_done']):>10}/"
                        f"{format_size(p['bytes_total']):<10}  {r['label']}")
    emit(ns, {"sessions": rows}, "\n".join(text) if rows else "no sessions")
    return EXIT_OK


def cmd_cancel(ns: argparse.Namespace) -> int:
    token, sid = ns.session
    with connect(ns) as c:
        if sid is None:
            info = c.cancel(token, ns.reason or "")
        else:
            info = c.cancel_by_id(sid, ns.reason or "")
    d = session_dict(info)
    d.update(ok=True)
    # the state after the cancel: cancelling (its copies stopping), or the end it had reached already
    emit(ns, d, f"session {info.session_id} (uid {info.uid}, pid {info.pid}): cancel requested; it is now "
                f"{d['state']}")
    return EXIT_OK


def cmd_selftest(ns: argparse.Namespace) -> int:
    from .selftest import format_rows, run_selftest
    with connect(ns, "vramctl selftest") as c:
        work = tempfile.mkdtemp(prefix="vramd-selftest-", dir=ns.workdir)
        try:
            rows, notes = run_selftest(c, ns.size, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    ok = bool(rows) and all(r.ok for r in rows)
    data = {"ok": ok, "notes": notes, "rows": [
        {"gpu_id": r.gpu_id, "backend": r.backend, "direction": r.direction, "bytes": r.nbytes,
         "seconds": round(r.seconds, 6), "gb_per_s": round(r.gbps, 3), "ok": r.ok, "note": r.note} for r in rows]}
    emit(ns, data, "\n".join([format_rows(rows), *notes]))
    if not ok:
        raise Failure("selftest failed: " + ("a round trip did not match" if rows else "nothing could be tested"))
    return EXIT_OK
