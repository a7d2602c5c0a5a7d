"""A registry across a rate-limited network: its own network namespace behind a veth pair shaped with `tc`.

    with NetNs() as ns:                                  # root only; this machine's lo and NICs are not touched
        with Registry(work / "reg", listen=ns.peer, netns=ns.name) as reg:   # reg.host is "10.213.X.2:PORT"
            ns.shape("10gbit")                           # both directions: tbf on each end's egress
            ...
            ns.shape(None)                               # no qdisc: the veth pair at full speed

The namespace (`vramd-bench-PID`) holds one end of the pair (`vbPIDr`, PEER/30) and the other (`vbPIDh`,
HOST/30) stays in this namespace; routing between them is the /30 itself.  Shaping: a token bucket (tbf) on
the egress of both ends (the registry's answers leave through the namespace's end, uploads through ours), its
bucket `burst` = 2 ms at the rate (at least 256 KiB: a veth passes GSO packets of up to 64 KiB) and a queue of
`latency` 20 ms; `delay`, if given, puts a netem delay (each way) in front of it, the tbf its child.

The registry still runs on this machine's cores: a namespace and a rate limit separate the network, not the
CPU.  The veth pair and the tbf cost softirq CPU no process is charged for.

Cleanup on every exit path: `close()` (`__exit__`) deletes the namespace, which destroys the pair and its
qdiscs; `atexit` and SIGTERM/SIGHUP (turned into SystemExit, so `with` blocks unwind) cover the rest; a
namespace left by a SIGKILLed run is named by its PID and `sweep()` removes those whose PID is gone.
"""
from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
from types import FrameType

PREFIX = "vramd-bench-"
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit)$")
_UNIT = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def rate_bits(rate: str) -> int:
    """'10gbit' -> 10_000_000_000 (tc's decimal units, bits per second)."""
    m = _RATE.match(rate)
    if not m:
        raise ValueError(f"not a tc rate (e.g. 10gbit, 500mbit): {rate!r}")
    return int(float(rate[: -len(m.group(2))]) * _UNIT[m.group(2)])


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


def _tc(*args: str, ns: str | None = None) -> None:
    cmd = ["tc", *(["-n", ns] if ns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


def sweep() -> list[str]:
    """Delete the namespaces earlier runs of this bench left (their PID no longer alive); their names."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    gone = []
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        pid = name[len(PREFIX):]
        if name.startswith(PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
            gone.append(name)
    return gone


class NetNs:
    def __init__(self) -> None:
        if os.geteuid() != 0:
            raise SystemExit("--net-rate needs root (ip netns, tc)")
        sweep()
        pid = os.getpid()
        self.name = f"{PREFIX}{pid}"
        self.host_if, self.peer_if = f"vb{pid}h", f"vb{pid}r"
        used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True, check=True).stdout
        third = next((n for n in [pid % 250, *range(250)] if f"10.213.{n}." not in used), None)
        if third is None:
            raise RuntimeError("no free 10.213.X.0/30 for the bench's veth pair")
        self.host, self.peer = f"10.213.{third}.1", f"10.213.{third}.2"
        self.rate: str | None = None
        self._open = False
        self._old: dict[int, object] = {}
        try:
            _ip("netns", "add", self.name)
            self._open = True
            atexit.register(self.close)
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._old[sig] = signal.signal(sig, self._on_signal)
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.peer_if)
            _ip("link", "set", self.peer_if, "netns", self.name)
            _ip("addr", "add", f"{self.host}/30", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            _ip("addr", "add", f"{self.peer}/30", "dev", self.peer_if, ns=self.name)
            _ip("link", "set", self.peer_if, "up", ns=self.name)
            _ip("link", "set", "lo", "up", ns=self.name)
        except BaseException:
            self.close()
            raise

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    def shape(self, rate: str | None, delay: str | None = None) -> None:
        """Limit both directions to `rate` (a tc rate, e.g. '10gbit'), `delay` (e.g. '100us') each way before it;
        None: no qdisc, the pair at its full speed."""
        for dev, ns in ((self.host_if, None), (self.peer_if, self.name)):
            subprocess.run(["tc", *(["-n", ns] if ns else []), "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, check=False)  # none there is fine
            if rate is None:
                continue
            burst = max(256 << 10, rate_bits(rate) // 8 // 500)  # 2 ms at the rate
            parent = ["root"]
            if delay:
                _tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", delay, "limit", "100000",
                    ns=ns)
                parent = ["parent", "1:"]
            _tc("qdisc", "add", "dev", dev, *parent, "tbf", "rate", rate, "burst", str(burst), "latency", "20ms",
                ns=ns)
        self.rate = rate

    def qdiscs(self) -> str:
        """`tc qdisc show` of both ends (what the bench records beside its numbers)."""
        a = subprocess.run(["tc", "qdisc", "show", "dev", self.host_if], capture_output=True, text=True).stdout
        b = subprocess.run(["tc", "-n", self.name, "qdisc", "show", "dev", self.peer_if], capture_output=True,
                           text=True).stdout
        return (a + b).strip()

    def close(self) -> None:
        if self._open:
            self._open = False
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)
            subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, check=False)  # gone with it
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        self._old = {}
        atexit.unregister(self.close)

    def __enter__(self) -> NetNs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
