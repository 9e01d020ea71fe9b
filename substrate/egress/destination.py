"""Which addresses the egress proxy may connect to, decided before it connects.

Theory of operation. An allowed name can resolve to anything its DNS says, this host's
own addresses included; a proxy that connected first and looked afterwards would already
have knocked on the host's service (a port oracle for the sandbox: refused quickly when
closed, slowly when open). So every address the resolver gave is judged here, and the
proxy connects only when all of them pass, to those very addresses (no second lookup):

1. by the address alone (`static_refusal`, pure): loopback, unspecified, link-local
   (cloud metadata, 169.254.169.254), multicast, reserved and broadcast are refused; an
   IPv4-mapped IPv6 address is judged as its IPv4 one; private and other non-global
   ranges (RFC 1918, CGNAT, ULA, documentation) only when the operator says so
   (`egress_refuse_private`: a corporate mirror lives there);
2. by the kernel's own route to it (`route_to`: one rtnetlink `RTM_GETROUTE`, as
   `ip route get` asks, no packet sent): an address the kernel delivers *locally* (any
   of this host's interface addresses, the docker bridge's 172.17.0.1 among them) or
   as broadcast is refused, and so is one reached on-link through a bridge or a veth of
   this host (`docker0`, `br-…`, `cni0`, `cali…`: the networks of this host's
   containers and VMs), whatever range it is in.

`refusal` combines both for one address; nothing here opens a TCP connection.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass

from pyroute2.netlink import NLM_F_REQUEST
from pyroute2.netlink.rtnl import RTM_GETLINK, RTM_GETROUTE
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg
from pyroute2.netlink.rtnl.marshal import MarshalRtnl
from pyroute2.netlink.rtnl.rtmsg import rtmsg

#: `rtm_type` of a route the kernel sends on to another host (all others stay here).
RTN_UNICAST = 1
#: Link kinds whose on-link neighbours are this host's containers or VMs.
GUEST_LINK_KINDS = frozenset({"bridge", "veth"})
#: Longest wait for the kernel's answer (it answers at once; this is a guard).
_NETLINK_TIMEOUT_S = 2.0
_NETLINK_ROUTE = 0

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Route:
    """The kernel's route to one address: its `rtm_type` and whether it leaves on-link
    (no gateway) through a bridge or veth of this host."""

    kind: int
    guest_link: bool = False


RouteLookup = Callable[[IPAddress], Route]


def parse(address: str) -> IPAddress | None:
    """`address` (a scope `%eth0` ignored) as an IP address, IPv4-mapped IPv6 as IPv4;
    None when it is not one. Pure."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def static_refusal(ip: IPAddress, *, refuse_private: bool) -> str | None:
    """Why `ip` is refused by its range alone, or None. Pure."""
    if ip.is_loopback or ip.is_unspecified:
        return "an address of this host"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_multicast or ip.is_reserved:
        return "a multicast or reserved address"
    if refuse_private and not ip.is_global:
        return "a private address (egress_refuse_private)"
    return None


def route_refusal(route: Route) -> str | None:
    """Why an address with the kernel's `route` is refused, or None. Pure."""
    if route.kind != RTN_UNICAST:
        return "an address of this host"
    if route.guest_link:
        return "an address of this host's containers"
    return None


def refusal(address: str, *, refuse_private: bool, lookup: RouteLookup | None = None) -> str | None:
    """Why the proxy may not connect to `address`, or None when it may. Blocking (one
    or two rtnetlink round trips, about 0.3 ms; `lookup` replaces `route_to` in tests).
    A route the kernel does not have is a refusal too (nothing could be reached)."""
    ip = parse(address)
    if ip is None:
        return "not an address"
    why = static_refusal(ip, refuse_private=refuse_private)
    if why is not None:
        return why
    try:
        route = (lookup or route_to)(ip)
    except OSError:
        return "an address with no route"
    return route_refusal(route)


def route_to(ip: IPAddress) -> Route:
    """The kernel's route from this host to `ip` (`ip route get`), and for an on-link
    route whether its link is a bridge or veth. Blocking; raises OSError (no route,
    netlink errors)."""
    with _netlink() as sock:
        msg = rtmsg()
        msg["family"] = socket.AF_INET if ip.version == 4 else socket.AF_INET6
        msg["dst_len"] = ip.max_prefixlen
        msg["attrs"] = [("RTA_DST", str(ip))]
        found = _ask(sock, msg, RTM_GETROUTE)
        kind = int(found["type"])
        oif = found.get_attr("RTA_OIF")
        if kind != RTN_UNICAST or oif is None or found.get_attr("RTA_GATEWAY") is not None:
            return Route(kind=kind)
        if found.get_attr("RTA_MULTIPATH") is not None:
            return Route(kind=kind)
        link = ifinfmsg()
        link["family"] = socket.AF_UNSPEC
        link["index"] = int(oif)
        info = _ask(sock, link, RTM_GETLINK).get_attr("IFLA_LINKINFO")
        link_kind = None if info is None else info.get_attr("IFLA_INFO_KIND")
        return Route(kind=kind, guest_link=link_kind in GUEST_LINK_KINDS)


def _netlink() -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, _NETLINK_ROUTE)
    try:
        sock.settimeout(_NETLINK_TIMEOUT_S)
        sock.bind((0, 0))
    except BaseException:
        sock.close()
        raise
    return sock


def _ask(sock: socket.socket, msg: rtmsg | ifinfmsg, msg_type: int) -> rtmsg | ifinfmsg:
    """One rtnetlink request (not a dump) and its one answer."""
    msg["header"]["type"] = msg_type
    msg["header"]["flags"] = NLM_F_REQUEST
    msg["header"]["sequence_number"] = msg_type
    msg.encode()
    sock.send(msg.data)
    for part in MarshalRtnl().parse(sock.recv(1 << 16)):
        header = part["header"]
        if header.get("sequence_number") != msg_type:
            continue
        err = header.get("error")
        if err is not None:
            raise err if isinstance(err, OSError) else OSError(errno.EIO, str(err))
        return part
    raise OSError(errno.EIO, "no rtnetlink answer")
