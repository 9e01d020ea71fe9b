"""Egress sandboxes against the real engine (docs/egress.md).

A daemon runs in-process with three profiles: `default` and `setup` as shipped, and
`local` (an egress profile allowing only `mirror.test`). Network reached: only loopback
(a server this test starts on 127.0.0.1, reached through the proxy, with the proxy's
resolver mapping `mirror.test` to it), namespaces the engine made for this test's
sandboxes, and, in one test, the package index this machine's pip uses, through the
proxy only. A name under `.invalid` is refused before any resolution: the proxy's
resolver records every question, and none is asked for it.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import ssl
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import pytest
import trio

from substrate.daemon import Daemon
from substrate.egress import destination
from substrate.egress.allow import AllowList
from substrate.egress.authority import SandboxAuthority
from substrate.egress.cabundle import bundle_path, digest, read_bundle
from substrate.egress.npmregistry import npm_registry_hosts
from substrate.egress.pipindex import pip_index_hosts, pip_index_urls
from substrate.egress.proxy import Addresses
from substrate.protocol.client import AsyncClient, RpcError, open_client
from substrate.secrets import SecretStore
from tests.harness.inprocess import in_process_config, owned_project, profiles_dir, serving

OWNER = 1000
MIRROR = "mirror.test"
LOCAL = """\
description = "egress to mirror.test only (tests)"
network = "egress"
egress_allow = ["mirror.test"]
"""
API = "api.example.com"
#: The model key the proxy injects: it must never be seen inside the sandbox.
SECRET = "sk-engine-test-5f2c9a71-never-inside"
INJECTING = """\
description = "egress to api.example.com with its key injected by the proxy (tests)"
network = "egress"
egress_allow = ["api.example.com"]
ca_bundle = "host"

[egress_inject."api.example.com"]
header = "x-api-key"
secret = "model-key"
"""
#: In the sandbox: one HTTPS request without a key, then what the sandbox holds.
ASK_API = """\
import json, os, sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=60) as r:
    print(r.status, r.read().decode(), json.dumps(dict(r.headers)))
print(json.dumps(dict(os.environ)))
print(open("/etc/substrate/ca-bundle.crt").read()[-1200:])
"""
#: Links and routes of the network namespace at argv[1], with pyroute2, as JSON.
NETNS_QUERY = """\
import json, sys
from pyroute2 import NetNS
ns = NetNS(sys.argv[1], flags=0)
try:
    links = {int(link["index"]): link.get_attr("IFLA_IFNAME") for link in ns.get_links()}
    routes = [
        (r.get_attr("RTA_GATEWAY"), r.get_attr("RTA_OIF"))
        for family in (2, 10)
        for r in ns.get_routes(family=family)
    ]
finally:
    ns.close()
print(json.dumps({"links": links, "routes": routes}))
"""
#: A command that fetches URL argv[1] with urllib and prints the status (or the error).
FETCH = """\
import sys, urllib.request, urllib.error
try:
    with urllib.request.urlopen(sys.argv[1], timeout=60) as r:
        body = r.read()
        print(r.status, len(body), body[:200])
except urllib.error.HTTPError as e:
    print("HTTPError", e.code, e.headers.get("X-Substrate-Refusal"))
except Exception as e:
    print(type(e).__name__, e)
"""


@dataclass
class Env:
    daemon: Daemon
    client: AsyncClient
    ws: str
    state: Path
    resolved: list[str] = field(default_factory=list)

    async def run(self, profile: str, argv: list[str], **params: Any) -> dict[str, Any]:
        out: dict[str, Any] = await self.client.call(
            "proc.run", workspace=self.ws, profile=profile, argv=argv, **params
        )
        return out

    async def fetch(self, profile: str, url: str) -> tuple[dict[str, Any], str]:
        result = await self.run(profile, ["python3", "-c", FETCH, url])
        assert result["exit_code"] == 0, result["stderr"]
        return result, result["stdout"]["inline"]

    async def journal(self, kind: str) -> list[dict[str, Any]]:
        entries = (await self.client.call("journal.read", since=0, limit=10000))["entries"]
        return [e for e in entries if e["kind"] == kind]

    def sandbox_pid(self, profile: str) -> int:
        sandbox = self.daemon.execution.containers.cached(self.ws, profile)
        assert sandbox is not None
        return sandbox.init_pid


@pytest.fixture
async def env(sandbox_image: str, engine_state: Path, tmp_path: Path) -> AsyncIterator[Env]:
    profiles = profiles_dir(
        tmp_path / "profiles", ["default", "setup"], local=LOCAL, inject=INJECTING
    )
    project = owned_project(tmp_path / "roots" / "project", {"README.md": "hi\n"})
    config = in_process_config(engine_state, project.parent, profiles)
    async with serving(config) as daemon, open_client(engine_state / "substrate.sock") as client:
        ws = await client.call("workspace.adopt", path=str(project))
        made = Env(daemon, client, ws["workspace"], engine_state)
        system = daemon.egress.resolve

        async def recording(host: str, port: int) -> Addresses:
            made.resolved.append(host)
            return await system(host, port)

        daemon.egress.resolve = recording
        yield made


async def _origin(nursery: trio.Nursery, heads: list[bytes]) -> int:
    """A loopback HTTP server on this host: records request heads, answers "hello"."""

    async def handler(stream: trio.SocketStream) -> None:
        buf = b""
        while b"\r\n\r\n" not in buf and (data := await stream.receive_some(65536)):
            buf += data
        heads.append(buf.partition(b"\r\n\r\n")[0])
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")

    serve = functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1")
    listeners = await nursery.start(serve)
    port: int = listeners[0].socket.getsockname()[1]
    return port


async def test_a_blocked_name_is_refused_before_resolution_and_reported(env: Env) -> None:
    # Through a child process (`sh` starts python3): still attributed to the command.
    script = f"python3 -c '{FETCH}' http://blocked.invalid/secret/path?token=abc"
    result = await env.run("local", ["sh", "-c", script])
    assert result["stdout"]["inline"] == "HTTPError 403 egress_denied\n"
    assert result["egress_blocked"] == {"count": 1, "hosts": ["blocked.invalid:80"]}
    https, out = await env.fetch("local", "https://blocked.invalid/")
    assert "403" in out and "Tunnel" in out  # urllib's words for a refused CONNECT
    assert https["egress_blocked"] == {"count": 1, "hosts": ["blocked.invalid:443"]}
    denied = await env.journal("egress.denied")
    assert [e["data"] for e in denied] == [
        {
            "container": denied[0]["data"]["container"],
            "profile": "local",
            "proc": result["proc"],
            "host": "blocked.invalid",
            "port": 80,
        },
        {
            "container": denied[0]["data"]["container"],
            "profile": "local",
            "proc": https["proc"],
            "host": "blocked.invalid",
            "port": 443,
        },
    ]
    assert all(e["workspace"] == env.ws for e in denied)
    # No path, query or header of the request anywhere in the journal.
    entries = await env.client.call("journal.read", since=0, limit=10000)
    assert "secret" not in repr(entries) and "token" not in repr(entries)
    assert env.resolved == []  # never looked up
    status = await env.client.call("proc.status", proc=result["proc"])
    assert status["egress_blocked"] == result["egress_blocked"]
    waited = await env.client.call("proc.wait", proc=https["proc"])
    assert waited["egress_blocked"] == https["egress_blocked"]


async def test_the_namespace_has_only_lo_and_the_daemons_listener(env: Env) -> None:
    probe = await env.client.call("facts.probe", workspace=env.ws, profile="local")
    facts = {f["name"]: f["value"] for f in probe["facts"]}
    assert facts["net_links"] == ["lo"] and facts["net_routes"] == []
    assert facts["network_mode"] == "none"
    assert facts["egress_listeners"] == ["127.0.0.1:3128=substrate"]
    assert facts["egress_allow_digest"] == AllowList.of([MIRROR]).digest
    # Seen with pyroute2, independently of the daemon's own reader; in a fresh process, as
    # pyroute2's NetNS forks a helper (a fork of this threaded process could hang).
    path = f"/proc/{env.sandbox_pid('local')}/ns/net"
    with trio.fail_after(60):
        done = await trio.run_process(
            [sys.executable, "-c", NETNS_QUERY, path], capture_stdout=True
        )
    seen = json.loads(done.stdout)
    links = {int(index): name for index, name in seen["links"].items()}
    assert list(links.values()) == ["lo"]
    assert seen["routes"], "the local table's loopback routes are always there"
    for gateway, oif in seen["routes"]:
        assert gateway is None
        assert links[oif] == "lo"
    # No resolver of its own: names are the proxy's to resolve (and only allowed ones).
    lookup = await env.run(
        "local", ["python3", "-c", "import socket; socket.getaddrinfo('mirror.test', 80)"]
    )
    assert lookup["exit_code"] != 0 and "gaierror" in lookup["stderr"]["inline"]
    assert env.resolved == []
    # The port is the daemon's: a command cannot take it over.
    taken = await env.run(
        "local",
        ["python3", "-c", "import socket; socket.socket().bind(('127.0.0.1', 3128))"],
    )
    assert taken["exit_code"] != 0 and "Address already in use" in taken["stderr"]["inline"]


async def test_an_allowed_name_reaches_a_loopback_origin_through_the_proxy(
    env: Env, nursery: trio.Nursery
) -> None:
    heads: list[bytes] = []
    port = await _origin(nursery, heads)

    async def to_origin(host: str, want: int) -> Addresses:
        env.resolved.append(host)
        return [(2, ("127.0.0.1", port))]

    env.daemon.egress.resolve = to_origin
    env.daemon.egress.allow_local = True  # the origin is this host's loopback
    result, out = await env.fetch("local", "http://mirror.test/simple/six/")
    assert out == "200 5 b'hello'\n"
    assert "egress_blocked" not in result
    assert heads == [
        b"GET /simple/six/ HTTP/1.1\r\nHost: mirror.test\r\nAccept-Encoding: identity\r\n"
        b"User-Agent: " + heads[0].split(b"User-Agent: ")[1].split(b"\r\n")[0] + b"\r\n"
        b"Connection: close"
    ]
    assert env.resolved == [MIRROR]
    # Allowed names only: the same origin under another name stays out of reach.
    _, out = await env.fetch("local", "http://other.test/")
    assert out == "HTTPError 403 egress_denied\n"
    assert env.resolved == [MIRROR] and len(heads) == 1


async def test_default_has_no_way_out(env: Env) -> None:
    script = """\
import errno, os, socket
print(sorted(k for k in os.environ if "proxy" in k.lower() or "CERT" in k))
for addr in [("127.0.0.1", 3128), ("198.51.100.1", 80)]:
    try:
        socket.create_connection(addr, timeout=5)
        print("connected", addr)
    except OSError as e:
        print(errno.errorcode.get(e.errno, e.errno))
try:
    socket.getaddrinfo("example.org", 80)
    print("resolved")
except OSError as e:
    print("no resolver")
"""
    result = await env.run("default", ["python3", "-c", script], facts="full")
    assert result["stdout"]["inline"].splitlines() == [
        "[]",
        "ECONNREFUSED",
        "ENETUNREACH",
        "no resolver",
    ]
    facts = {f["name"] for f in result["facts"]}
    assert not facts & {"egress_listeners", "egress_allow_digest", "ca_bundle"}
    assert "egress_blocked" not in result


async def test_setup_reaches_the_package_index_through_the_proxy_only(env: Env) -> None:
    profile = await env.client.call("profile.get", name="setup")
    urls, why = pip_index_urls()
    assert why is None and urls
    # The shipped setup profile: the pip index and the npm registry, nothing else.
    assert profile["egress_allow"] == sorted({*pip_index_hosts()[0], *npm_registry_hosts()[0]})
    probe = await env.client.call("facts.probe", workspace=env.ws, profile="setup")
    facts = {f["name"]: f["value"] for f in probe["facts"]}
    # The host's bundle (which trusts this machine's inspecting proxy) is what it sees.
    assert facts["ca_bundle"] == digest(read_bundle(bundle_path("host")))
    assert facts["net_links"] == ["lo"] and facts["net_routes"] == []
    has_pip = await env.run("setup", ["python3", "-m", "pip", "--version"])
    if has_pip["exit_code"] == 0:
        result = await env.run(
            "setup",
            [
                "sh",
                "-c",
                "python3 -m pip install --no-cache-dir --target /tmp/six six"
                " && PYTHONPATH=/tmp/six python3 -c 'import six; print(six.__name__)'",
            ],
        )
        assert result["exit_code"] == 0, result["stderr"]
        assert result["stdout"]["inline"].endswith("six\n")
    else:
        # This image has no pip (yet): the index page of six, fetched the same way.
        result, out = await env.fetch("setup", urls[0].rstrip("/") + "/six/")
        assert out.startswith("200 ") and "six" in out
    assert "egress_blocked" not in result
    assert await env.journal("egress.denied") == []


async def test_the_listener_closes_with_its_sandbox(env: Env, docker_client: Any) -> None:
    await env.client.call("facts.probe", workspace=env.ws, profile="local")
    sandbox = env.daemon.execution.containers.cached(env.ws, "local")
    assert sandbox is not None and sandbox.egress is not None
    attachment = sandbox.egress.attachment
    assert not attachment.done.is_set()
    await env.client.call("workspace.release", workspace=env.ws)
    assert attachment.done.is_set()
    assert attachment.listener.fileno() == -1
    with pytest.raises(docker.errors.NotFound):
        docker_client.containers.get(sandbox.id)


def test_the_engines_bridge_network_is_refused_as_this_hosts_containers(
    docker_client: Any,
) -> None:
    """Judged from the kernel's route (no packet sent): an address on the engine's
    bridge network is a container of this host, and the bridge's own is this host's."""
    subnet = docker_client.networks.get("bridge").attrs["IPAM"]["Config"][0]["Subnet"]
    network = ipaddress.ip_network(subnet)
    neighbour = network.network_address + 200
    assert destination.route_to(neighbour) == destination.Route(
        kind=destination.RTN_UNICAST, guest_link=True
    )
    assert destination.refusal(str(neighbour), refuse_private=False) == (
        "an address of this host's containers"
    )
    gateway = docker_client.networks.get("bridge").attrs["IPAM"]["Config"][0].get("Gateway")
    if gateway:  # the bridge's own address (172.17.0.1): this host's
        assert destination.refusal(gateway, refuse_private=False) == "an address of this host"


async def _tls_api(nursery: trio.Nursery, ca: SandboxAuthority, heads: list[bytes]) -> int:
    """A loopback HTTPS server for API (its certificate from `ca`): records each request
    head and answers with a body and a header echoing the key it got."""
    context = ca.server_context(API)

    async def handler(raw: trio.SocketStream) -> None:
        stream = trio.SSLStream(raw, context, server_side=True)
        buf = b""
        with trio.fail_after(30):
            while b"\r\n\r\n" not in buf and (data := await stream.receive_some(65536)):
                buf += data
        head = buf.partition(b"\r\n\r\n")[0]
        heads.append(head)
        key = next(
            (
                line.split(b":", 1)[1].strip()
                for line in head.split(b"\r\n")[1:]
                if line.lower().startswith(b"x-api-key:")
            ),
            b"",
        )
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\nConnection: close\r\nX-Echo: "
            + key
            + b"\r\n\r\nanswer"
        )
        await stream.aclose()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    port: int = listeners[0].socket.getsockname()[1]
    return port


async def test_the_proxy_injects_the_key_and_the_sandbox_never_holds_it(
    env: Env, nursery: trio.Nursery, docker_client: Any
) -> None:
    SecretStore(env.state).set("model-key", SECRET.encode())
    upstream_ca = SandboxAuthority([API])
    heads: list[bytes] = []
    port = await _tls_api(nursery, upstream_ca, heads)

    async def to_api(host: str, want: int) -> Addresses:
        env.resolved.append(host)
        return [(2, ("127.0.0.1", port))]

    env.daemon.egress.resolve = to_api
    env.daemon.egress.allow_local = True  # the "upstream" is this host's loopback
    upstream_tls = ssl.create_default_context(cadata=upstream_ca.cert_pem.decode())
    env.daemon.egress.upstream_tls = upstream_tls

    result = await env.run("inject", ["python3", "-c", ASK_API, f"https://{API}/v1/messages"])
    out = result["stdout"]["inline"]
    assert result["exit_code"] == 0, result["stderr"]
    assert out.startswith("200 answer ")
    assert len(heads) == 1
    assert b"\r\nx-api-key: " + SECRET.encode() in heads[0]
    assert b"\r\nhost: api.example.com" in heads[0].lower()
    # Not in the sandbox: not in its environment, its CA bundle, nor the answer it got.
    assert SECRET not in out + result["stderr"]["inline"]
    assert "BEGIN CERTIFICATE" in out
    sandbox = env.daemon.execution.containers.cached(env.ws, "inject")
    assert sandbox is not None
    inspect = json.dumps(docker_client.api.inspect_container(sandbox.id))
    assert SECRET not in inspect
    # The bundle it trusts ends with its own CA's certificate (the whole file, read here).
    bundle = await trio.Path(
        f"/proc/{sandbox.init_pid}/root/etc/substrate/ca-bundle.crt"
    ).read_bytes()
    assert sandbox.egress is not None and sandbox.egress.authority is not None
    assert bundle.endswith(sandbox.egress.authority.cert_pem)
    assert SECRET.encode() not in bundle
    # Nor in the journal, the facts, the profile as profile.get shows it.
    probe = await env.client.call("facts.probe", workspace=env.ws, profile="inject")
    facts = {f["name"]: f["value"] for f in probe["facts"]}
    assert facts["egress_inject"] == [API]
    assert facts["egress_ca"].startswith("sha256:")
    profile = await env.client.call("profile.get", name="inject")
    entries = (await env.client.call("journal.read", since=0, limit=10000))["entries"]
    assert SECRET not in json.dumps([probe, profile, entries, result])
    assert profile["egress_inject"] == {API: {"header": "x-api-key", "secret": "model-key"}}


async def test_an_injecting_profile_whose_secret_is_not_set_is_refused(env: Env) -> None:
    with pytest.raises(RpcError) as caught:
        await env.client.call("facts.probe", workspace=env.ws, profile="inject")
    assert caught.value.refusal == "secret_unknown"
    assert caught.value.data["secrets"] == ["model-key"]
