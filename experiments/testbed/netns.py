"""Emulated hosts on one machine: Linux network namespaces on a bridge.

``TestBed(n)`` makes ``n`` hosts, each a network namespace with one interface (``eth0``, the
inside end of a veth pair) and its own address on a private /24, the outside ends joined by a
bridge in the root namespace that carries the subnet's first address (where a test runs the
coordinator, as a cluster's batch host would)::

    root namespace:   bridge dptb<id>  10.213.<k>.1  (the coordinator's store listens here)
                        |-- veth dptb<id>h0 ---- eth0 10.213.<k>.10  netns dptb<id>-h0  (host 0)
                        |-- veth dptb<id>h1 ---- eth0 10.213.<k>.11  netns dptb<id>-h1  (host 1)
                        ...

Nothing is shared between hosts but the file system (a cluster's shared file system) and the
machine's CPUs; each host has its own loopback, so a process that binds ``lo`` or dials
127.0.0.1 reaches no other host. Faults:

    kill_host(i)      SIGKILL every process of host i (a node lost: its agent and ranks at once)
    link_down(i)      the host's link down (a partition: its packets go nowhere, its processes
    link_up(i)        live on); link_up brings it back
    rate_limit(i, m)  the host's link capped at m Mbit/s both ways (``tc`` tbf; this kernel has
                      no netem, so no delay or loss emulation)

Traffic goes only to addresses this bed made. Everything it made (namespaces, links, processes
inside them) is removed by ``close`` (the context manager's exit, also after an exception), by
``atexit``, and, for a bed whose owner died with SIGKILL, by the next bed's ``sweep`` (names
carry the owner's pid). Needs root (CAP_NET_ADMIN) and ``ip``/``tc`` (iproute2): ``available()``
says why not.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

PREFIX = "dptb"
SUBNET_BASE = "10.213"  # 10.213.<k>.0/24, k chosen per bed among the free ones
HOST_IF = "eth0"


def _ip(*args: str, check: bool = True, netns: str | None = None) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r


def available() -> str | None:
    """None if this process can make network namespaces, else why not."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    name = f"{PREFIX}probe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot make a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


@dataclass
class Host:
    index: int
    netns: str   # the namespace's name (ip netns exec <netns> ...)
    veth: str    # the outside end of its link, on the bridge
    addr: str    # its address (eth0 inside)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class TestBed:
    """``n_hosts`` emulated hosts (see the module docstring); use as a context manager."""

    __test__ = False  # not a pytest class

    def __init__(self, n_hosts: int):
        if not 1 <= n_hosts <= 50:
            raise ValueError(f"n_hosts={n_hosts}: 1 to 50 hosts")
        why = available()
        if why:
            raise RuntimeError(f"no test bed: {why}")
        self.sweep()
        self.tag = f"{PREFIX}{os.getpid()}"
        self.bridge = self.tag  # at most 4 + 7 digits: within IFNAMSIZ with the host suffix
        self.subnet = self._free_subnet()
        self.gateway = str(self.subnet.network_address + 1)
        self.hosts: list[Host] = []
        self._closed = False
        atexit.register(self.close)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(n_hosts):
                self._add_host(i)
        except BaseException:
            self.close()
            raise

    # -- making and removing ---------------------------------------------------------------------
    @staticmethod
    def _free_subnet() -> ipaddress.IPv4Network:
        used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
        routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
        start = os.getpid() % 200
        for j in range(200):
            k = 20 + (start + j) % 200
            prefix = f"{SUBNET_BASE}.{k}."
            if prefix not in used and prefix not in routes:
                return ipaddress.ip_network(f"{prefix}0/24")
        raise RuntimeError(f"no free /24 under {SUBNET_BASE}.0.0/16")

    def _add_host(self, i: int) -> None:
        h = Host(i, f"{self.tag}-h{i}", f"{self.tag}h{i}", str(self.subnet.network_address + 10 + i))
        self.hosts.append(h)
        subprocess.run(["ip", "netns", "add", h.netns], check=True, capture_output=True)
        _ip("link", "add", h.veth, "type", "veth", "peer", "name", HOST_IF, "netns", h.netns)
        _ip("link", "set", h.veth, "master", self.bridge, "up")
        _ip("addr", "add", f"{h.addr}/24", "dev", HOST_IF, netns=h.netns)
        _ip("link", "set", HOST_IF, "up", netns=h.netns)
        _ip("link", "set", "lo", "up", netns=h.netns)

    def close(self) -> None:
        """Kill every process inside the bed's hosts, remove the hosts and the bridge."""
        if self._closed:
            return
        self._closed = True
        for h in self.hosts:
            self.kill_host(h.index)
        for h in self.hosts:
            subprocess.run(["ip", "netns", "del", h.netns], capture_output=True)
            subprocess.run(["ip", "link", "del", h.veth], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def __enter__(self) -> "TestBed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def sweep() -> list[str]:
        """Remove what beds of dead owners left behind (their names carry the owner's pid)."""
        removed = []
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        for name in {w.split("@")[0].rstrip(":") for line in (names + links).splitlines()
                     for w in line.split()[:2] if w.startswith(PREFIX)}:
            owner = name[len(PREFIX):].split("-")[0].split("h")[0]
            if owner.isdigit() and not _alive(int(owner)):
                if "-h" in name:
                    for pid in _netns_pids(name):
                        _kill(pid)
                    subprocess.run(["ip", "netns", "del", name], capture_output=True)
                else:
                    subprocess.run(["ip", "link", "del", name], capture_output=True)
                removed.append(name)
        return removed

    # -- running things on a host ----------------------------------------------------------------
    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` on host ``i`` (inside its namespace); keyword arguments as Popen's."""
        return subprocess.Popen(["ip", "netns", "exec", self.hosts[i].netns, *argv], **kw)

    def run(self, i: int, argv: list[str], timeout_s: float = 20) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.hosts[i].netns, *argv],
                              capture_output=True, text=True, timeout=timeout_s)

    def pids(self, i: int) -> list[int]:
        """Every process inside host ``i``."""
        return _netns_pids(self.hosts[i].netns)

    # -- faults ------------------------------------------------------------------------------------
    def kill_host(self, i: int) -> list[int]:
        """SIGKILL every process of host ``i`` (repeated until none is left, at most 2 s)."""
        killed, deadline = [], time.monotonic() + 2.0
        while time.monotonic() < deadline:
            pids = self.pids(i)
            if not pids:
                break
            for pid in pids:
                _kill(pid)
            killed += pids
            time.sleep(0.02)
        return killed

    def link_down(self, i: int) -> None:
        _ip("link", "set", self.hosts[i].veth, "down")

    def link_up(self, i: int) -> None:
        _ip("link", "set", self.hosts[i].veth, "up")

    def rate_limit(self, i: int, mbit: float) -> None:
        """Cap host ``i``'s link at ``mbit`` Mbit/s in both directions (a token bucket on each end
        of its veth; a queue of at most 200 ms, beyond which packets are dropped)."""
        h = self.hosts[i]
        spec = ["root", "tbf", "rate", f"{mbit}mbit", "burst", "64kb", "latency", "200ms"]
        subprocess.run(["tc", "qdisc", "replace", "dev", h.veth, *spec], check=True,
                       capture_output=True)
        subprocess.run(["ip", "netns", "exec", h.netns, "tc", "qdisc", "replace", "dev", HOST_IF,
                        *spec], check=True, capture_output=True)


def _netns_pids(netns: str) -> list[int]:
    r = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(x) for x in r.stdout.split()] if r.returncode == 0 else []


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
