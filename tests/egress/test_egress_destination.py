"""`substrate.egress.destination`: which addresses the proxy may connect to, judged
before any connection. The kernel's routes are asked (`ip route get`: no packet sent)."""

from __future__ import annotations

import ipaddress

import pytest
from pyroute2 import IPRoute

from substrate.egress.destination import (
    RTN_UNICAST,
    IPAddress,
    Route,
    refusal,
    route_to,
)


def _unicast(ip: IPAddress) -> Route:
    return Route(kind=RTN_UNICAST)


@pytest.mark.parametrize(
    ("address", "refused", "refused_private"),
    [
        ("127.0.0.1", True, True),
        ("127.5.5.5", True, True),
        ("::1", True, True),
        ("0.0.0.0", True, True),
        ("::", True, True),
        ("169.254.169.254", True, True),  # cloud metadata
        ("fe80::1%eth0", True, True),
        ("224.0.0.1", True, True),
        ("ff02::1", True, True),
        ("::ffff:127.0.0.1", True, True),
        ("::ffff:169.254.169.254", True, True),
        ("240.0.0.1", True, True),
        ("255.255.255.255", True, True),
        ("not-an-address", True, True),
        ("10.1.2.3", False, True),
        ("172.17.0.9", False, True),
        ("192.168.1.1", False, True),
        ("100.64.0.1", False, True),  # carrier-grade NAT
        ("fd00::2", False, True),
        ("203.0.113.80", False, True),
        ("::ffff:10.0.0.1", False, True),
        ("8.8.8.8", False, False),
        ("2606:4700::1111", False, False),
    ],
)
def test_addresses_by_their_range(address: str, refused: bool, refused_private: bool) -> None:
    assert (refusal(address, refuse_private=False, lookup=_unicast) is not None) is refused
    assert (refusal(address, refuse_private=True, lookup=_unicast) is not None) is refused_private


@pytest.mark.parametrize(
    ("route", "why"),
    [
        (Route(kind=2), "an address of this host"),  # RTN_LOCAL
        (Route(kind=3), "an address of this host"),  # RTN_BROADCAST
        (Route(kind=RTN_UNICAST, guest_link=True), "an address of this host's containers"),
        (Route(kind=RTN_UNICAST), None),
    ],
)
def test_addresses_by_the_kernels_route(route: Route, why: str | None) -> None:
    assert refusal("10.20.30.40", refuse_private=False, lookup=lambda ip: route) == why


def test_an_address_without_a_route_is_refused() -> None:
    def no_route(ip: IPAddress) -> Route:
        raise OSError(101, "Network is unreachable")

    assert refusal("10.20.30.40", refuse_private=False, lookup=no_route) == (
        "an address with no route"
    )


def test_every_address_of_this_host_is_local_to_the_kernel() -> None:
    with IPRoute() as ipr:
        own = [str(a.get_attr("IFA_ADDRESS")) for a in ipr.get_addr()]
    assert any(not ipaddress.ip_address(a.split("%")[0]).is_loopback for a in own)
    for address in own:
        ip = ipaddress.ip_address(address.split("%")[0])
        if ip.is_link_local:
            continue  # refused by its range already; its route needs the scope
        assert route_to(ip).kind != RTN_UNICAST, address
        assert refusal(address, refuse_private=False) is not None
