"""A star-shaped simulated WAN in network namespaces, with rate-shaped access links.

Layout (one run; names carry the prefix and the owning pid, so runs never collide):

    <prefix>-<pid>-hub     a namespace holding bridge `br0`; port `h<i>` per host
    <prefix>-<pid>-h<i>    host i (h0 = learner, h1..hN = peers), interface `eth0`, 10.77.x.y/16
    <prefix>-<pid>-r<i>    only for a host with `Rates(nat=True)`: its home router (see below)

Each host is joined to the hub by one veth pair created directly between the two namespaces, so
nothing appears in (or can route to) the machine's own namespace. Shaping follows
docs/platform.md: `tbf rate R burst 64kb limit 16mb` on both ends of every veth — egress of
the host's `eth0` is its uplink, egress of the hub's port `h<i>` is its downlink. A flow h1→h2
therefore passes h1's uplink shaper, the bridge, and h2's downlink shaper, as on a WAN where
access links are the bottleneck and the core is not.

A NAT'd host (`Rates(nat=True)`) sits behind a home-router-style NAT instead:

    hub: br0─h<i> ══ shaped veth ══ r<i>: eth0 [NAT] lan0 ── unshaped veth ── h<i>: eth0
                                         10.77.x.y/16  10.P.Q.1/24              10.P.Q.2/24
                                                                                default via 10.P.Q.1

The router takes the host's place on the bridge: its `eth0` holds the bridge address the host
would have had (`public_addr(i)`) and carries the host's shapers, so rates mean the same with or
without NAT. The host keeps `eth0` but on a private /24 of its own, P = 100 + i // 256 and
Q = i % 256 (P ≤ 200, so NAT'd hosts need i < 25856; each NAT'd host gets a distinct subnet and
none overlaps 10.77/16). `addr(i)` is that private .2 address — what the host sees on its own
interface and what a naive `--advertise-host` would announce; nothing outside r<i> can reach it
(the bridge hosts have no route to 10.P.Q.0/24). The router forwards (`ip_forward=1`) and loads
nftables rules: masquerade out of `eth0`; forward policy drop except established/related and
whatever enters from `lan0`; input from `eth0` dropped except established/related. So the host
can open connections outward (peers see `public_addr(i)` as the source) and nothing can open one
inward, at either address — as behind a home router without port forwarding.

Why a bridge and not a router: one L2 segment needs no routes, no forwarding sysctl and no
per-link subnets; the bridge does no shaping of its own, and the bottlenecks are exactly the
two qdiscs per host. netem does not exist in this kernel, so latency (if a scenario needs it)
is the application's job.

Invariants: every namespace this run created is deleted when the `Topology` context exits —
normally, by exception, or by SIGINT/SIGTERM/SIGHUP (turned into exceptions while the context is
open) — and every process started with `Topology.run` is killed and reaped first. A run killed
with SIGKILL leaves namespaces whose pid is gone; `cleanup_stale(prefix)` removes them.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PREFIX = "ewan"
SUBNET_PREFIX = "10.77"  # exists only inside this run's namespaces; nothing routes out of them
NAT_FIRST_OCTET2 = 100  # NAT'd host i's LAN is 10.(100 + i // 256).(i % 256).0/24, above 10.77
NAT_MAX_BLOCK = 100  # i // 256 ≤ 100 keeps the second octet ≤ 200: room left, and a valid octet
STOP_GRACE_S = 2.0
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Rates:
    """One host's access link in Mbit/s (10^6 bit/s); None leaves that direction unshaped."""

    up_mbit: float | None = 100.0
    down_mbit: float | None = 100.0
    # True puts the host behind its own NAT router (module docstring): it can connect out, but
    # nothing on the bridge can connect in; the rates then shape the router's side of the bridge.
    nat: bool = False


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], capture_output=True, text=True, check=True, timeout=30)


def list_namespaces() -> list[str]:
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_available() -> str | None:
    """None when this process can build topologies, else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not on PATH"
    return _in_throwaway_namespace(
        "probe", lambda ns: _ip("-n", ns, "link", "add", "br0", "type", "bridge"), "no Linux bridge in this kernel"
    )


def _in_throwaway_namespace(tag: str, check: Callable[[str], object], failure: str) -> str | None:
    """Run `check(namespace)` in a namespace made for it; None if it passed, else why not."""
    probe = f"{DEFAULT_PREFIX}-{os.getpid()}-{tag}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"`ip netns add` failed: {getattr(e, 'stderr', e)!s}".strip()
    try:
        check(probe)
    except subprocess.CalledProcessError as e:
        return f"{failure}: {e.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


# Home-router rules for a NAT'd host's router namespace. `eth0` faces the bridge, `lan0` the host.
_NAT_RULES = """\
table ip homenat {
    chain postrouting {
        type nat hook postrouting priority srcnat; policy accept;
        oifname "eth0" masquerade
    }
    chain forward {
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "lan0" accept
    }
    chain input {
        type filter hook input priority filter; policy accept;
        iifname "eth0" ct state established,related accept
        iifname "eth0" drop
    }
}
"""


def _nft(ns: str, rules: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=rules, capture_output=True, text=True, check=True, timeout=30)


def nat_available() -> str | None:
    """None when this process can build topologies with NAT'd hosts, else the reason it cannot."""
    why = netns_available()
    if why is not None:
        return why
    if shutil.which("nft") is None:
        return "`nft` (nftables) is not on PATH: apt-get install nftables"
    # nft on PATH is not enough: the kernel needs nf_tables with conntrack and NAT, so load the
    # real rules once into a throwaway namespace.
    return _in_throwaway_namespace("natprobe", lambda ns: _nft(ns, _NAT_RULES), "nftables NAT rules do not load in this kernel")


def nat_lan(host: int) -> tuple[str, str]:
    """(router address, host address) on NAT'd host `host`'s private /24 (module docstring)."""
    block = host // 256
    if host < 0 or block > NAT_MAX_BLOCK:
        raise ValueError(f"host {host}: NAT'd hosts need 0 <= index < {(NAT_MAX_BLOCK + 1) * 256} (private subnet scheme)")
    net = f"10.{NAT_FIRST_OCTET2 + block}.{host % 256}"
    return f"{net}.1", f"{net}.2"


def _pid_alive(pid: int) -> bool:
    """False for a gone pid and for a zombie (a SIGKILLed run not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL whatever still runs inside `ns` (processes of ours that escaped their group)."""
    res = _ip("netns", "pids", ns, check=False)
    for tok in res.stdout.split():
        if tok.isdigit() and int(tok) != os.getpid():
            try:
                os.kill(int(tok), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _delete_namespace(ns: str) -> None:
    _kill_namespace_processes(ns)
    _ip("netns", "del", ns, check=False)


def cleanup_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete namespaces `<prefix>-<pid>-*` whose owning pid no longer exists; returns them."""
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-")
    removed = []
    for ns in list_namespaces():
        m = pattern.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            _delete_namespace(ns)
            removed.append(ns)
    return removed


def python_argv(module: str, *args: str) -> list[str]:
    """argv that runs `python -m module args...` with this interpreter (run it via `Topology.run`,
    which puts the repository root on PYTHONPATH)."""
    return [sys.executable, "-m", module, *args]


def _tbf(ns: str, dev: str, mbit: float | None) -> None:
    if mbit is None:
        return
    if mbit <= 0:
        raise ValueError(f"rate {mbit} Mbit/s: give a positive rate, or None for unshaped")
    # burst 64kb / limit 16mb give exact rates; smaller bursts cost several times the CPU and a
    # shallow limit hurts when several flows share one downlink (docs/platform.md).
    _tc("-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit:g}mbit", "burst", "64kb", "limit", "16mb")


def _child_setup(cpus: frozenset[int] | None) -> Any:
    libc = ctypes.CDLL(None, use_errno=True)

    def setup() -> None:
        # Die with the orchestrator even if it is SIGKILLed (survives the exec of `ip netns exec`).
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


class Topology:
    """Learner h0 and peers h1..hN, each in its own namespace, joined through a shaped bridge.

        with Topology([Rates(up_mbit=100, down_mbit=100)] * 9) as topo:
            proc = topo.run(1, python_argv("benchmarks.wan.calibrate", "--send", ...), cpus={1})
            topo.addr(0)  # "10.77.0.1"

    With `Rates(nat=True)` for host i, `addr(i)` is its private address behind its router and
    `public_addr(i)` the bridge address the router masquerades it as.
    """

    def __init__(self, hosts: Sequence[Rates], *, prefix: str = DEFAULT_PREFIX, mtu: int = 1500) -> None:
        if len(hosts) < 2:
            raise ValueError("a topology needs the learner h0 and at least one peer")
        if len(hosts) > 65000:
            raise ValueError("at most 65000 hosts fit the /16 test subnet")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,15}", prefix):
            raise ValueError(f"prefix {prefix!r}: use 1-16 lowercase letters/digits, starting with a letter")
        for i, rates in enumerate(hosts):
            if rates.nat:
                nat_lan(i)  # raises before anything is built if i is outside the NAT subnet scheme
        self.hosts = tuple(hosts)
        self.prefix = prefix
        self.mtu = mtu
        self.run_tag = f"{prefix}-{os.getpid()}"
        self.hub = f"{self.run_tag}-hub"
        self.procs: list[subprocess.Popen[Any]] = []
        self._created: list[str] = []
        self._old_handlers: dict[int, Any] = {}

    # --- addressing -------------------------------------------------------------------------
    @property
    def n_peers(self) -> int:
        return len(self.hosts) - 1

    def ns(self, host: int) -> str:
        self._check_host(host)
        return f"{self.run_tag}-h{host}"

    def router_ns(self, host: int) -> str | None:
        """The namespace of host's NAT router, or None for a host on the bridge itself."""
        self._check_host(host)
        return f"{self.run_tag}-r{host}" if self.hosts[host].nat else None

    def addr(self, host: int) -> str:
        """The address host has on its own `eth0` (for a NAT'd host: private, unreachable)."""
        self._check_host(host)
        if self.hosts[host].nat:
            return nat_lan(host)[1]
        return self.public_addr(host)

    def public_addr(self, host: int) -> str:
        """The address the bridge sees for host: its own, or its NAT router's `eth0`."""
        self._check_host(host)
        n = host + 1  # 10.77.0.0 is the network address; hosts start at .0.1
        return f"{SUBNET_PREFIX}.{n >> 8}.{n & 255}"

    @property
    def namespaces(self) -> list[str]:
        routers = [r for i in range(len(self.hosts)) if (r := self.router_ns(i)) is not None]
        return [self.hub, *routers, *(self.ns(i) for i in range(len(self.hosts)))]

    def _check_host(self, host: int) -> None:
        if not 0 <= host < len(self.hosts):
            raise IndexError(f"host {host}: this topology has h0..h{len(self.hosts) - 1}")

    # --- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> Topology:
        self._install_signal_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _build(self) -> None:
        self._add_ns(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge", "stp_state", "0")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        _ip("-n", self.hub, "link", "set", "lo", "up")
        mtu = str(self.mtu)
        for i, rates in enumerate(self.hosts):
            ns, port = self.ns(i), f"h{i}"
            # On the bridge sits the host itself, or its router (which then takes the shapers).
            edge = self.router_ns(i) or ns
            self._add_ns(edge)
            _ip("-n", self.hub, "link", "add", port, "mtu", mtu, "type", "veth", "peer", "name", "eth0", "mtu", mtu, "netns", edge)
            _ip("-n", self.hub, "link", "set", port, "master", "br0", "up")
            _ip("-n", edge, "addr", "add", f"{self.public_addr(i)}/16", "dev", "eth0")
            _ip("-n", edge, "link", "set", "eth0", "up")
            _ip("-n", edge, "link", "set", "lo", "up")
            _tbf(edge, "eth0", rates.up_mbit)
            _tbf(self.hub, port, rates.down_mbit)
            if edge != ns:
                self._build_nat_host(i, router=edge)

    def _build_nat_host(self, host: int, *, router: str) -> None:
        ns, mtu = self.ns(host), str(self.mtu)
        gw, addr = nat_lan(host)
        self._add_ns(ns)
        # The LAN veth is unshaped: the access link (router eth0 <-> hub) is the bottleneck.
        _ip("-n", router, "link", "add", "lan0", "mtu", mtu, "type", "veth", "peer", "name", "eth0", "mtu", mtu, "netns", ns)
        _ip("-n", router, "addr", "add", f"{gw}/24", "dev", "lan0")
        _ip("-n", router, "link", "set", "lan0", "up")
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "route", "add", "default", "via", gw)
        # Rules before forwarding: there is never a moment when the router forwards unfiltered.
        _nft(router, _NAT_RULES)
        subprocess.run(["ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1"], capture_output=True, text=True, check=True, timeout=30)

    def _add_ns(self, ns: str) -> None:
        if ns in list_namespaces():
            raise RuntimeError(f"namespace {ns} already exists: this pid already owns a topology with prefix {self.prefix!r}")
        _ip("netns", "add", ns)
        self._created.append(ns)

    def close(self) -> None:
        """Kill and reap every process, delete every namespace; idempotent, signals held off."""
        held = self._hold_signals()
        try:
            self._stop_procs()
            for ns in reversed(self._created):
                _delete_namespace(ns)
            self._created.clear()
        finally:
            # Old handlers first: a signal held during teardown is then delivered to them (the
            # default SIGTERM ends the process now that nothing is left behind).
            self._uninstall_signal_handlers()
            self._restore_signals(held)

    def _stop_procs(self) -> None:
        live = [p for p in self.procs if p.poll() is None]
        for p in live:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        for p in self.procs:
            for stream in (p.stdin, p.stdout, p.stderr):
                if stream is not None:
                    stream.close()
        self.procs.clear()

    # --- processes --------------------------------------------------------------------------
    def run(
        self,
        host: int,
        argv: Sequence[str],
        *,
        cpus: Iterable[int] | None = None,
        env: dict[str, str] | None = None,
        **popen: Any,
    ) -> subprocess.Popen[Any]:
        """Start `argv` inside host's namespace, pinned to `cpus`, in its own process group.

        stdout/stderr/cwd etc. pass through to Popen (stdin defaults to /dev/null). The repo
        root is prepended to PYTHONPATH so `python -m benchmarks...`/`echo_node...` resolve.
        The process is killed and reaped when the topology closes, and dies with this process.
        """
        if not self._created:
            raise RuntimeError("the topology is not built: use it as `with Topology(...) as topo:`")
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), full_env.get("PYTHONPATH", "")) if p)
        popen.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(host), *argv],
            env=full_env,
            start_new_session=True,
            preexec_fn=_child_setup(frozenset(cpus) if cpus is not None else None),
            **popen,
        )
        self.procs.append(proc)
        return proc

    # --- signals ----------------------------------------------------------------------------
    def _install_signal_handlers(self) -> None:
        if not _in_main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, _raise_on_signal)

    def _uninstall_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    def _hold_signals(self) -> set[int] | None:
        """Block SIGINT/SIGTERM/SIGHUP during teardown, so a second Ctrl-C cannot cut it short."""
        if not _in_main_thread():
            return None
        return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})

    @staticmethod
    def _restore_signals(held: set[int] | None) -> None:
        if held is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


class Interrupted(SystemExit):
    """SIGTERM/SIGHUP arrived while a topology was open (SIGINT stays KeyboardInterrupt)."""


def _raise_on_signal(signum: int, frame: FrameType | None) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Interrupted(128 + signum)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _signal_group(p: subprocess.Popen[Any], sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass
