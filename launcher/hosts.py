"""Hosts on one machine: Linux network namespaces on a bridge, to run the system across a real network stack.

``Hosts(n)`` makes ``n`` hosts, each a network namespace with one interface ``eth0`` (a veth pair whose
other end sits on a bridge in the root namespace) and its loopback up, addressed ``<subnet>.1`` ..
``<subnet>.n`` in one /24 of the benchmarking range 198.18.0.0/15 (never another private or public
range). The bridge itself gets ``<subnet>.254``, so this process (in the root namespace) reaches every
host: that address is the *driver's* link, and the bridge's counters are its bytes.

What a host offers (:class:`Host`): :meth:`Host.popen` runs a command inside it (``ip netns exec``),
in its own session, so it can be stopped by its process-group id; :attr:`Host.exec_prefix` is the same
prefix for a launcher that starts the process itself; :meth:`Host.link_bytes` reads the kernel's byte
counters of its link (the host-side end of its veth, seen from the host: what it received and sent);
:meth:`Host.cut` / :meth:`Host.restore` take its link down and up (a cable pulled: packets are dropped
silently, TCP connections survive a short cut and resend); :meth:`Host.shape` caps its link's rate.

Guarantees:

* names are unique per instance (process id and a counter; interface names within the kernel's 15
  characters) and the /24 is one no interface of the root namespace uses, so concurrent runs do not
  collide (allocation runs under a file lock);
* teardown always runs (``__exit__``, on exceptions and KeyboardInterrupt too, and at interpreter exit
  for an instance never exited): the processes started here are stopped by process-group id, then
  whatever is still inside a namespace (``ip netns pids``, only those pids) is killed, then the
  namespaces, veths and the bridge are deleted. Nothing is ever stopped by name. What a process killed
  outright (SIGKILL) left behind is removed by the next instance's setup (:func:`sweep_stale`);
* where namespaces cannot be made (not Linux, no ``ip``, no CAP_NET_ADMIN) :class:`HostsUnavailableError`
  says why, before anything is created.

Example::

    with Hosts(2) as hosts:
        server = hosts[0].popen([sys.executable, "-m", "http.server", "--bind", hosts[0].address, "8000"])
        hosts[1].popen(["curl", f"http://{hosts[0].address}:8000/"]).wait()
        hosts[0].link_bytes()
    # -> LinkBytes(rx=..., tx=...)
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher import lifeline
from launcher.placement import Site

log = logging.getLogger(__name__)

RANGE = ipaddress.IPv4Network("198.18.0.0/15")
"""The only addresses hosts get (RFC 2544's benchmarking range)."""
MAX_HOSTS = 200
"""Hosts per instance (one /24, the bridge at .254)."""
HOST_IFNAME = "eth0"
"""The interface of a host, inside its namespace (the same name in every host)."""
MAX_BURST_KB = 16
"""The largest token bucket :meth:`Host.shape` makes (KB): what passes a shaped link unshaped."""
_COUNTER = itertools.count()


class HostsUnavailableError(RuntimeError):
    """Network namespaces cannot be made here; the message says why (not Linux, no ``ip``, not privileged)."""


class HostsCommandError(RuntimeError):
    """An ``ip`` command failed while hosts were set up or changed; names the command and its error output."""


@dataclass(frozen=True, slots=True)
class LinkBytes:
    """The kernel's byte counters of one link, seen from the host (or the driver) at its end."""

    rx: int
    """Bytes it received."""
    tx: int
    """Bytes it sent."""

    def __sub__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(rx=self.rx - other.rx, tx=self.tx - other.tx)

    @property
    def total(self) -> int:
        return self.rx + self.tx


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and res.returncode != 0:
        msg = f"`ip {' '.join(args)}` failed (exit {res.returncode}): {res.stderr.strip()}"
        raise HostsCommandError(msg)
    return res


def _first(args: tuple[str, ...]) -> None:
    """A command that makes a namespace or bridge: refused for lack of privilege, hosts cannot be made here."""
    try:
        _ip(*args)
    except HostsCommandError as exc:
        if any(w in str(exc) for w in ("not permitted", "Permission denied", "Operation not supported")):
            msg = f"cannot make network namespaces and bridges here: {exc}"
            raise HostsUnavailableError(msg) from exc
        raise


def _read_counter(ifname: str, which: str) -> int:
    return int(Path(f"/sys/class/net/{ifname}/statistics/{which}").read_text())


def _no_ipv6(ifname: str) -> None:
    with contextlib.suppress(OSError):  # a kernel without IPv6: nothing to turn off
        Path(f"/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6").write_text("1")


def check_available(*, probe: bool = False) -> None:
    """Raise :class:`HostsUnavailableError` when network namespaces cannot be made here, saying why.

    ``probe``: also make and delete one namespace (root may still be refused, e.g. in a container)."""
    if not sys.platform.startswith("linux"):
        msg = f"network namespaces need Linux, this is {sys.platform}"
        raise HostsUnavailableError(msg)
    if shutil.which("ip") is None:
        msg = "the `ip` command (iproute2) is not installed"
        raise HostsUnavailableError(msg)
    if os.geteuid() != 0:
        msg = f"making network namespaces needs root (CAP_NET_ADMIN); running as uid {os.geteuid()}"
        raise HostsUnavailableError(msg)
    if probe:
        name = f"k{os.getpid()}probe"
        try:
            _first(("netns", "add", name))
        except HostsCommandError as exc:
            msg = f"cannot make a network namespace here: {exc}"
            raise HostsUnavailableError(msg) from exc
        _ip("netns", "del", name, check=False)


_NAME = re.compile(r"^k(\d+)x\d+(?:h\d+|b|p\d+)$")
"""The names :class:`Hosts` gives: ``k<pid>x<counter>`` and ``h<i>`` (namespace), ``b`` (bridge) or ``p<i>`` (veth)."""


def sweep_stale() -> list[str]:
    """Remove the namespaces, veths and bridges of :class:`Hosts` instances whose process is gone (killed before
    its teardown could run), and stop the processes still inside those namespaces (by ``ip netns pids``).

    Only names of the form :data:`_NAME` whose process id no longer exists are touched. Returns what was removed.
    """
    def stale(name: str) -> bool:
        m = _NAME.match(name)
        return m is not None and not Path(f"/proc/{m.group(1)}").exists()

    removed = []
    netns = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()]
    for ns in filter(stale, netns):
        for pid in _ip("netns", "pids", ns, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        if _ip("netns", "del", ns, check=False).returncode == 0:
            removed.append(ns)
    links = [str(i.get("ifname", "")) for i in json.loads(_ip("-j", "link", "show", check=False).stdout or "[]")]
    for link in filter(stale, links):
        if _ip("link", "del", link, check=False).returncode == 0:
            removed.append(link)
    if removed:
        log.warning("removed what killed runs left behind: %s", removed)
    return removed


class Host:
    """One host: a network namespace with ``eth0`` at :attr:`address` on the bridge (made by :class:`Hosts`)."""

    def __init__(self, owner: Hosts, index: int, netns: str, address: str, link: str) -> None:
        self._owner = owner
        self.index = index
        """1-based."""
        self.netns = netns
        """The namespace's name."""
        self.address = address
        """Its address on the bridge (198.18.x.index)."""
        self.link = link
        """The host-side end of its veth, in the root namespace (what :meth:`cut` takes down)."""

    def __repr__(self) -> str:
        return f"Host({self.index}, {self.address}, netns={self.netns})"

    @property
    def exec_prefix(self) -> list[str]:
        """Prefix of a command that runs inside this host."""
        return ["ip", "netns", "exec", self.netns]

    def popen(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` inside this host in its own session (its pgid is its pid); stopped at teardown, and
        SIGKILLed by the kernel if this process dies first (``launcher.lifeline.popen``).

        Keyword arguments go to ``subprocess.Popen`` (``start_new_session`` is always on).
        """
        return self._owner._popen(self, [*self.exec_prefix, *cmd], **kwargs)

    def site(self) -> Site:
        """This host as a ``knit run`` placement site: its address, its exec prefix, gloo bound to its interface."""
        return Site(address=self.address, exec_prefix=self.exec_prefix, env={"GLOO_SOCKET_IFNAME": HOST_IFNAME},
                    name=f"host{self.index}")

    def link_bytes(self) -> LinkBytes:
        """Bytes this host received and sent over its link (the kernel's counters of the veth's bridge end)."""
        return LinkBytes(rx=_read_counter(self.link, "tx_bytes"), tx=_read_counter(self.link, "rx_bytes"))

    def cut(self) -> None:
        """Take this host's link down: its packets are dropped until :meth:`restore`."""
        _ip("link", "set", self.link, "down")

    def restore(self) -> None:
        """Bring this host's link up again."""
        _ip("link", "set", self.link, "up")

    def shape(self, mbit: float, *, burst_kb: int = 16) -> None:
        """Cap this host's link at ``mbit`` Mbit/s each way: a token bucket (``tc ... tbf``) on both ends of its
        veth, the host's end for what it sends and the bridge's end for what it receives.

        ``burst_kb``: the bucket's size (KB, 1..16). At most 16 KB passes at the veth's own speed, less than
        the smallest read a trainer makes, so every read is shaped.
        """
        if not 1 <= burst_kb <= MAX_BURST_KB:
            msg = f"burst_kb={burst_kb} must be 1..{MAX_BURST_KB} (a larger bucket lets small reads pass unshaped)"
            raise ValueError(msg)
        tbf = ["root", "tbf", "rate", f"{mbit:g}mbit", "burst", f"{burst_kb}kb", "latency", "50ms"]
        for cmd in ([*self.exec_prefix, "tc", "qdisc", "replace", "dev", HOST_IFNAME, *tbf],
                    ["tc", "qdisc", "replace", "dev", self.link, *tbf]):
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
            if res.returncode != 0:
                msg = f"`{' '.join(cmd)}` failed (exit {res.returncode}): {res.stderr.strip()}"
                raise HostsCommandError(msg)

    def pids(self) -> list[int]:
        """Every process inside this host's namespace now."""
        res = _ip("netns", "pids", self.netns, check=False)
        return [int(p) for p in res.stdout.split() if p.strip().isdigit()]


class Hosts:
    """``n`` hosts as network namespaces on a bridge, with the bridge at ``.254`` for this process.

    Args:
        n: hosts to make (1..200).
        settle_s: seconds to wait, at most, for every link to report carrier.

    Raises:
        HostsUnavailableError: namespaces cannot be made here (says why).
        HostsCommandError: an ``ip`` command failed during setup (everything made so far is removed).
        ValueError: ``n`` out of range.

    Example::

        with Hosts(4) as hosts:
            hosts[0].address, hosts.driver_address
        # -> ('198.18.7.1', '198.18.7.254')
    """

    def __init__(self, n: int, *, settle_s: float = 5.0) -> None:
        if not 1 <= n <= MAX_HOSTS:
            msg = f"Hosts(n={n}): n must be in 1..{MAX_HOSTS}"
            raise ValueError(msg)
        self.n = n
        self._settle_s = settle_s
        tag = f"k{os.getpid()}x{next(_COUNTER) % 100}"  # <= 11 characters: 'p200' still fits in 15
        self.tag = tag
        """Unique prefix of this instance's names."""
        self.bridge = f"{tag}b"
        """The bridge, in the root namespace: the driver's link."""
        self.hosts: list[Host] = []
        self.driver_address = ""
        """This process's address on the bridge (``<subnet>.254``)."""
        self._procs: list[subprocess.Popen[Any]] = []
        self._made: list[tuple[str, str]] = []  # ("netns" | "link", name), in creation order
        self._torn_down = False

    # ---- setup / teardown ----------------------------------------------------------------------

    def __enter__(self) -> Hosts:
        if self._torn_down or self.hosts:
            msg = f"Hosts {self.tag} was entered before: make a new instance"
            raise RuntimeError(msg)
        check_available()
        atexit.register(self.teardown)
        try:
            self._setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def _setup(self) -> None:
        lock_path = Path(tempfile.gettempdir()) / "knittrans-hosts.lock"
        with lock_path.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two instances must not pick the same /24
            sweep_stale()
            subnet = self._free_subnet()
            _first(("link", "add", self.bridge, "type", "bridge"))
            self._made.append(("link", self.bridge))
            _ip("addr", "add", f"{subnet[254]}/24", "dev", self.bridge)
        self.driver_address = str(subnet[254])
        _no_ipv6(self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(1, self.n + 1):
            netns, link, peer = f"{self.tag}h{i}", f"{self.tag}p{i}", f"{self.tag}v{i}"
            _first(("netns", "add", netns))
            self._made.append(("netns", netns))
            _ip("link", "add", link, "type", "veth", "peer", "name", peer, "netns", netns)
            self._made.append(("link", link))
            _ip("-n", netns, "link", "set", peer, "name", HOST_IFNAME)
            _no_ipv6(link)  # no router solicitations or MLD reports in the counters
            _ip("netns", "exec", netns, "sh", "-c", f"echo 1 > /proc/sys/net/ipv6/conf/{HOST_IFNAME}/disable_ipv6",
                check=False)
            _ip("link", "set", link, "master", self.bridge, "up")
            _ip("-n", netns, "addr", "add", f"{subnet[i]}/24", "dev", HOST_IFNAME)
            _ip("-n", netns, "link", "set", HOST_IFNAME, "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            self.hosts.append(Host(self, i, netns, str(subnet[i]), link))
        self._wait_carrier()
        log.info("hosts up: %s on bridge %s (%s)", [h.address for h in self.hosts], self.bridge, self.driver_address)

    def _free_subnet(self) -> ipaddress.IPv4Network:
        """A /24 of 198.18.0.0/15 that no address of the root namespace is in (searched from one chosen by pid)."""
        res = _ip("-j", "addr", "show")
        used = set()
        for iface in json.loads(res.stdout or "[]"):
            for a in iface.get("addr_info", []):
                if a.get("family") == "inet":
                    used.add(ipaddress.IPv4Network(f"{a['local']}/24", strict=False))
        subnets = list(RANGE.subnets(new_prefix=24))
        start = (os.getpid() * 7 + int(self.tag.rsplit("x", 1)[1])) % len(subnets)
        for k in range(len(subnets)):
            candidate = subnets[(start + k) % len(subnets)]
            if candidate not in used:
                return candidate
        msg = f"every /24 of {RANGE} is in use by an interface of this machine"
        raise HostsCommandError(msg)

    def _wait_carrier(self) -> None:
        deadline = time.monotonic() + self._settle_s
        for h in self.hosts:
            while Path(f"/sys/class/net/{h.link}/operstate").read_text().strip() != "up":
                if time.monotonic() > deadline:
                    msg = f"the link of {h} did not come up within {self._settle_s} s"
                    raise HostsCommandError(msg)
                time.sleep(0.02)

    def teardown(self) -> None:
        """Stop every process started here and inside the hosts, then delete namespaces, veths and bridge.

        Idempotent; runs to the end whatever fails on the way (failures are logged).
        """
        if self._torn_down:
            return
        self._torn_down = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.teardown)
        try:
            self._stop_processes()
        finally:
            for kind, name in reversed(self._made):
                args = ("netns", "del", name) if kind == "netns" else ("link", "del", name)
                res = _ip(*args, check=False)
                if res.returncode != 0 and "Cannot find" not in res.stderr and "No such" not in res.stderr:
                    log.warning("teardown: `ip %s` failed: %s", " ".join(args), res.stderr.strip())
            self._made.clear()

    def _stop_processes(self, grace_s: float = 5.0) -> None:
        for p in self._procs:  # by the process group each one leads (start_new_session)
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)  # stragglers of its group
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        for _ in range(50):  # whatever else runs inside a host (started by a launcher there): by its pid
            inside = [pid for h in self.hosts for pid in h.pids()]
            if not inside:
                break
            for pid in inside:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        else:
            log.warning("teardown: processes still inside the hosts: %s", inside)

    # ---- processes -----------------------------------------------------------------------------

    def _popen(self, host: Host, cmd: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        if self._torn_down:
            msg = f"{host} was torn down: cannot start {cmd}"
            raise RuntimeError(msg)
        kwargs["start_new_session"] = True
        proc = lifeline.popen(cmd, **kwargs)  # the parent-death signal: ``ip netns exec`` execs, it stays with cmd
        self._procs.append(proc)
        return proc

    def driver_bytes(self) -> LinkBytes:
        """Bytes this process (the root namespace) received and sent over the bridge: the driver's link."""
        return LinkBytes(rx=_read_counter(self.bridge, "rx_bytes"), tx=_read_counter(self.bridge, "tx_bytes"))
