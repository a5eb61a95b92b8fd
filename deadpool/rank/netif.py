"""Which network interface a job's processes talk over: chosen, never assumed.

gloo and NCCL's socket transport each bind one interface (``GLOO_SOCKET_IFNAME``,
``NCCL_SOCKET_IFNAME``); left to themselves they resolve the host's name, which on many machines
(Debian's 127.0.1.1 line, containers) is a loopback address: every peer on another host is then
dialled at 127.0.0.1 and the job never trains a step. So each process's interface is decided
here, on the host it runs on (``socket_env``), in this order:

1. ``launcher.ifname`` when the config names one (it must exist on every host);
2. ``GLOO_SOCKET_IFNAME`` when the environment already has it (a site's or a user's choice);
3. the interface this host routes the coordinator's store address through: the network every
   rank reaches the control plane on (loopback only when the store itself is on loopback, as with
   the single-host local launcher).

``NCCL_SOCKET_IFNAME`` follows unless the environment sets it (NCCL's data path on InfiniBand is
unaffected: this names its bootstrap and socket fallback). The coordinator, for its part, refuses
to serve a multi-node job from a loopback address (``check_store_host``).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

SIOCGIFADDR = 0x8915  # ioctl(2): an interface's IPv4 address


def interface_addresses(name: str) -> list[str]:
    """The addresses of interface ``name`` on this host (IPv4 from the kernel, IPv6 from
    /proc/net/if_inet6)."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            r = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            out.append(socket.inet_ntoa(r[20:24]))
        except OSError:
            pass
    try:
        for line in open("/proc/net/if_inet6"):
            hexaddr, *_, dev = line.split()
            if dev == name:
                out.append(str(ipaddress.ip_address(bytes.fromhex(hexaddr))))
    except OSError:
        pass
    return out


def interface_of(addr: str) -> str | None:
    """The interface of this host that holds local address ``addr``."""
    want = ipaddress.ip_address(addr.split("%")[0])
    for _, name in socket.if_nameindex():
        if any(ipaddress.ip_address(a) == want for a in interface_addresses(name)):
            return name
    return None


def route_interface(host: str, port: int = 9) -> tuple[str, str]:
    """(interface, local address) this host would use to reach ``host``: the routing table's
    answer, found by connecting a UDP socket (which sends nothing)."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        local = s.getsockname()[0]
    name = interface_of(local)
    if name is None:
        raise RuntimeError(f"no interface of this host holds {local}, the address it routes "
                           f"{host} through")
    return name, local


def choose(cfg: dict, environ=os.environ) -> str:
    """The interface this host's processes of job ``cfg`` use (the module docstring's order)."""
    named = cfg.get("launcher", {}).get("ifname")
    if named:
        try:
            socket.if_nametoindex(named)
        except OSError:
            have = ", ".join(n for _, n in socket.if_nameindex())
            raise ValueError(f"launcher.ifname={named!r}: no such interface on "
                             f"{socket.gethostname()} (it has {have})") from None
        return named
    if environ.get("GLOO_SOCKET_IFNAME"):
        return environ["GLOO_SOCKET_IFNAME"]
    store = cfg.get("_store") or {"host": cfg["launcher"]["host"], "port": cfg["launcher"]["port"]}
    return route_interface(store["host"], int(store["port"] or 9))[0]


def socket_env(cfg: dict, environ=os.environ) -> dict:
    """``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` for this host's processes of ``cfg``."""
    name = choose(cfg, environ)
    return {"GLOO_SOCKET_IFNAME": name,
            "NCCL_SOCKET_IFNAME": environ.get("NCCL_SOCKET_IFNAME") or name}


def is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback
                   for info in socket.getaddrinfo(host, None))
    except socket.gaierror:
        return False


def check_store_host(cfg: dict, environ=os.environ) -> None:
    """Refuse to serve a job whose processes run on other hosts from a loopback address (a host
    name that resolves to 127.0.1.1 would otherwise bind the store where no other node reaches
    it, and the job would wait for agents that can never connect)."""
    launcher = cfg["launcher"]
    nodes = int(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or 1)
    if launcher["name"] != "local" and nodes > 1 and is_loopback(launcher["host"]):
        raise ValueError(
            f"the store host {launcher['host']!r} (DEADPOOL_STORE_HOST / launcher.host) is a "
            f"loopback address, but the job spans {nodes} nodes: no other node could reach the "
            f"coordinator. Set DEADPOOL_STORE_HOST to this host's cluster-internal address "
            f"(e.g. $(hostname -I | cut -d' ' -f1), or the address of the interface the nodes "
            f"share)")
