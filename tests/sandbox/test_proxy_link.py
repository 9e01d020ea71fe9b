"""`substrate.sandbox.proxy_link` without an engine: what it refuses before a sandbox is
made, and its kernel readers pointed at this test's own process and sockets."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from substrate.egress.allow import AllowList
from substrate.errors import RuntimeUnavailable
from substrate.sandbox import proxy_link
from substrate.sandbox.profiles import Profile

EGRESS = Profile(name="e", network="egress", egress_allow=["pkg.example.org"])


async def test_an_egress_profile_needs_the_daemons_proxy() -> None:
    assert await proxy_link.prepare(None, Profile(name="p")) == (None, {})
    with pytest.raises(RuntimeUnavailable, match="no egress proxy"):
        await proxy_link.prepare(None, EGRESS)
    # Without a proxy nothing is linked, and a profile without egress never is.
    assert await proxy_link.link(None, [], "c", "w", EGRESS, os.getpid(), {}) == []
    assert await proxy_link.observe_again(None, None) == []


def test_the_listener_facts_tell_the_daemons_socket_from_any_other() -> None:
    with socket.socket() as ours, socket.socket() as other:
        ours.bind(("127.0.0.1", 0))
        ours.listen(1)
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        mine = f"127.0.0.1:{ours.getsockname()[1]}=substrate"
        theirs = f"127.0.0.1:{other.getsockname()[1]}=other"
        digest = AllowList.of(["pkg.example.org"]).digest
        found = proxy_link.observe_link(os.getpid(), os.fstat(ours.fileno()).st_ino, digest, False)
    facts = {f.name: f for f in found}
    assert set(facts) == {"egress_allow_digest", "egress_listeners"}
    assert facts["egress_allow_digest"].value == digest
    assert facts["egress_allow_digest"].source == "egress:proxy"
    listeners = facts["egress_listeners"].value
    assert isinstance(listeners, list) and mine in listeners and theirs in listeners
    assert facts["egress_listeners"].source == "kernel:proc-net-tcp"


def test_the_bundle_is_read_through_the_root_without_following_a_link(tmp_path: Path) -> None:
    real = tmp_path / "real.crt"
    real.write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    assert proxy_link._read_in_root(os.getpid(), str(real)) == real.read_bytes()
    (tmp_path / "link.crt").symlink_to(real)
    with pytest.raises(OSError):
        proxy_link._read_in_root(os.getpid(), str(tmp_path / "link.crt"))
    (tmp_path / "dir").symlink_to(tmp_path)
    with pytest.raises(OSError):
        proxy_link._read_in_root(os.getpid(), str(tmp_path / "dir" / "real.crt"))
    facts = proxy_link.observe_link(os.getpid(), 0, "sha256:x", True)
    (bundle,) = [f for f in facts if f.name == "ca_bundle"]
    assert bundle.value is None and bundle.source.startswith("kernel:proc-root (")
