"""Confinement facts, pure: required facts of the shipped profiles, `compare` catching each
kind of weakening, and the pure readers of the engine's inspect and runsc's argv."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from substrate.egress.allow import AllowList
from substrate.sandbox import facts as F
from substrate.sandbox import observe, observe_gvisor, profiles
from substrate.sandbox import parsers as P
from substrate.sandbox.facts import Fact, Mismatch

ROOT = Path(__file__).resolve().parents[2]
CID = "1861239ebab313493267c5b96ef434c3764753482345831e678b0ea2ef797ce3"

SANDBOX_ARGV = [
    "runsc-sandbox",
    "--root=/var/run/docker/runtime-runc/moby",
    "--log-format=json",
    "--network=none",
    "--log-fd=3",
    "boot",
    "--bundle=/var/run/docker/containerd/daemon/x",
    "--cpu-num",
    "2",
]


def test_docker_socket_mounted() -> None:
    assert observe.docker_socket_mounted(["/var/run/docker.sock"])
    assert observe.docker_socket_mounted(["/run"])  # a directory above the socket
    assert observe.docker_socket_mounted(["/"])
    assert observe.docker_socket_mounted(["/home/u/sock/docker.sock"])
    assert not observe.docker_socket_mounted(["/tmp/ws", "/tmp/ws/.git", "/running"])
    inspect = {"Mounts": [{"Source": "/srv/x", "Destination": "/var/run/docker.sock"}]}
    assert not observe.engine_socket_absent(inspect)
    assert observe.engine_socket_absent(
        {"Mounts": [{"Source": "/srv/x", "Destination": "/workspace"}]}
    )


def test_engine_side_readers() -> None:
    assert observe.engine_kept_caps({"CapDrop": ["ALL"], "CapAdd": None}) == []
    assert observe.engine_kept_caps({"CapDrop": ["ALL"], "CapAdd": ["CAP_NET_ADMIN", "CHOWN"]}) == [
        "CHOWN",
        "NET_ADMIN",
    ]
    assert set(
        observe.engine_kept_caps({"CapDrop": ["NET_RAW"]})
    ) == observe.ENGINE_DEFAULT_CAPS - {"NET_RAW"}
    assert observe.engine_kept_caps({"Privileged": True}) == list(P.CAP_NAMES)
    assert observe.engine_user("1000:1000") == (1000, 1000)
    assert observe.engine_user("") == (0, 0)
    assert observe.engine_user("app")[0] == "app"
    assert observe.engine_tmpfs(
        {"Tmpfs": {"/tmp": "rw,nosuid,nodev,exec,mode=1777,size=256m"}}
    ) == ["/tmp=268435456"]


def test_runsc_flags() -> None:
    flags = observe_gvisor.runsc_flags(SANDBOX_ARGV)
    assert flags["network"] == "none"
    assert "oci-seccomp" not in flags
    assert "bundle" not in flags  # the subcommand's own flags do not count
    assert observe_gvisor.runsc_flags(["/usr/bin/runsc", "--oci-seccomp", "boot"]) == {
        "oci-seccomp": ""
    }
    assert observe_gvisor.runsc_flags(["/bin/sleep", "--network=none"]) == {}


def test_seccomp_policy_of() -> None:
    assert F.seccomp_policy_of([]) == F.seccomp_policy_of(["no-new-privileges"]) == "engine-default"
    assert F.seccomp_policy_of(["seccomp=unconfined"]) == "unconfined"
    assert F.seccomp_policy_of(["seccomp:unconfined"]) == "unconfined"
    assert F.seccomp_policy_of(["seccomp={not json"]) == "invalid"
    # The digest is of the canonical document: key order and spacing do not matter.
    a = F.seccomp_policy_of(['seccomp={"defaultAction": "SCMP_ACT_ERRNO", "syscalls": []}'])
    b = F.seccomp_policy_of(['seccomp={"syscalls":[],"defaultAction":"SCMP_ACT_ERRNO"}'])
    assert a == b and a.startswith("sha256:")
    assert a != F.seccomp_policy_of(['seccomp={"defaultAction":"SCMP_ACT_ALLOW"}'])


# -- required facts -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped() -> dict[str, profiles.Profile]:
    return profiles.load_profiles(ROOT / "profiles", ROOT / "seccomp")


def test_required_facts_default_profile(shipped: dict[str, profiles.Profile]) -> None:
    req = F.required_facts(
        shipped["default"],
        run_uid=1000,
        run_gid=1000,
        workspace_mode="rw",
        readonly_dirs=[".git/"],
        seccomp_expected=True,
        image_id="sha256:abc",
    )
    assert req == {
        "runtime": "runc",
        "privileged": False,
        "network_mode": "none",
        "docker_socket_absent": True,
        "docker_host_unset": True,
        "memory_limit": 1 << 30,
        "pids_limit": 256,
        "cpu_quota": 2.0,
        "net_links": ["lo"],
        "net_routes": [],
        "no_new_privs": True,
        "cap_bnd": [],
        "uid": 1000,
        "gid": 1000,
        "rootfs_readonly": True,
        "workspace_mount": "rw",
        "readonly_dirs": [".git"],
        "tmpfs": ["/tmp=268435456"],
        "image_id": "sha256:abc",
        "cap_eff": [],
        "cap_prm": [],
        "cap_amb": [],
        "seccomp_mode": 2,
    }
    # Every value is a wire value.
    assert msgspec.json.decode(msgspec.json.encode(req)) == req


def test_required_facts_readonly_and_none_workspaces(shipped: dict[str, profiles.Profile]) -> None:
    ro = F.required_facts(
        shipped["readonly"],
        run_uid=1000,
        run_gid=1000,
        workspace_mode="ro",
        readonly_dirs=[".git"],
        seccomp_expected=True,
    )
    assert ro["workspace_mount"] == "ro" and ro["readonly_dirs"] == []
    assert "image_id" not in ro
    assert "seccomp_policy" not in ro  # strict, and the caller did not give the options
    none = F.required_facts(
        shipped["default"],
        run_uid=1000,
        run_gid=1000,
        workspace_mode="none",
        readonly_dirs=[],
        seccomp_expected=True,
    )
    assert none["workspace_mount"] == "absent" and none["readonly_dirs"] == []


def test_required_facts_gvisor(shipped: dict[str, profiles.Profile]) -> None:
    def req(seccomp_expected: bool) -> dict[str, F.FactValue]:
        return F.required_facts(
            shipped["gvisor"],
            run_uid=1000,
            run_gid=1000,
            workspace_mode="rw",
            readonly_dirs=[".git"],
            seccomp_expected=seccomp_expected,
        )

    lax = req(False)
    assert lax["runtime"] == "runsc"
    assert lax["sandbox_no_new_privs"] is True and lax["sandbox_seccomp_mode"] == 2
    assert lax["sandbox_userns"] is True and lax["sandbox_network"] == "none"
    # The command's own status is inside the Sentry: not required from the host kernel.
    assert {"cap_eff", "cap_prm", "cap_amb", "seccomp_mode", "sandbox_oci_seccomp"}.isdisjoint(lax)
    assert req(True)["sandbox_oci_seccomp"] is True
    assert lax["seccomp_policy"] == "engine-default"


def test_required_facts_seccomp_policy_from_the_options(
    shipped: dict[str, profiles.Profile],
) -> None:
    opts = profiles.security_opts(shipped["default"], ROOT / "seccomp")
    req = F.required_facts(
        shipped["default"],
        run_uid=1000,
        run_gid=1000,
        workspace_mode="rw",
        readonly_dirs=[],
        seccomp_expected=True,
        security_opt=opts,
    )
    assert req["seccomp_policy"] == F.seccomp_policy_of(opts)
    assert str(req["seccomp_policy"]).startswith("sha256:")
    # A container on the engine's default policy shows the same kernel mode (2) but not
    # the same policy.
    (m,) = F.compare(req, observed_as(req, seccomp_policy="engine-default"))
    assert m.name == "seccomp_policy"


def test_required_facts_root_keeps_capabilities() -> None:
    p = profiles.Profile(user="0:0", allow_root=True, capabilities=["NET_BIND_SERVICE", "CHOWN"])

    def req(uid: int) -> dict[str, F.FactValue]:
        return F.required_facts(
            p,
            run_uid=uid,
            run_gid=uid,
            workspace_mode="rw",
            readonly_dirs=[],
            seccomp_expected=True,
        )

    root = req(0)
    assert root["cap_eff"] == root["cap_prm"] == root["cap_bnd"] == ["CHOWN", "NET_BIND_SERVICE"]
    user = req(1000)
    assert user["cap_eff"] == [] and user["cap_bnd"] == ["CHOWN", "NET_BIND_SERVICE"]


# -- compare ------------------------------------------------------------------------------


@pytest.fixture
def required(shipped: dict[str, profiles.Profile]) -> dict[str, F.FactValue]:
    return F.required_facts(
        shipped["default"],
        run_uid=1000,
        run_gid=1000,
        workspace_mode="rw",
        readonly_dirs=[".git"],
        seccomp_expected=True,
    )


def observed_as(required: dict[str, F.FactValue], **changes: F.FactValue) -> list[Fact]:
    values = {**required, **changes}
    return [F.make_fact(n, v, source=f"test:{n}", observed_at=1.0) for n, v in values.items()]


def test_compare_exact_observation_meets(required: dict[str, F.FactValue]) -> None:
    assert F.compare(required, observed_as(required)) == []
    # Lists are sets, more read-only directories are fine, kernel rounding is fine.
    relaxed = observed_as(
        required,
        readonly_dirs=[".git", "node_modules"],
        memory_limit=(1 << 30) - 4096,
        cpu_quota=2,
    )
    assert F.compare(required, relaxed) == []
    assert F.compare(observed_as(required), observed_as(required)) == []  # Facts as required


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("rootfs_readonly", False),  # writable root
        ("cap_bnd", ["NET_ADMIN"]),  # an extra capability
        ("cap_eff", ["NET_ADMIN"]),
        ("seccomp_mode", 0),  # no filter
        ("net_routes", ["inet 0.0.0.0/0 via 172.17.0.1 dev eth0 table 254"]),  # a way out
        ("net_links", ["eth0", "lo"]),
        ("memory_limit", 2 << 30),  # a wrong memory limit
        ("memory_limit", None),  # no limit at all
        ("pids_limit", None),
        ("cpu_quota", 4.0),
        ("uid", "1000/0/0/0"),  # a saved root uid
        ("workspace_mount", "mixed"),
        ("readonly_dirs", []),  # .git writable
        ("tmpfs", ["/tmp=268435456", "/var/tmp=1048576"]),
        ("docker_socket_absent", False),
        ("no_new_privs", 1),  # an int is not a bool
    ],
)
def test_compare_catches(required: dict[str, F.FactValue], name: str, value: F.FactValue) -> None:
    (m,) = F.compare(required, observed_as(required, **{name: value}))
    assert m == Mismatch(name, required[name], value, f"test:{name}")


def test_compare_missing_observation(required: dict[str, F.FactValue]) -> None:
    observed = [f for f in observed_as(required) if f.name != "no_new_privs"]
    assert F.compare(required, observed) == [Mismatch("no_new_privs", True, None, "")]


def test_compare_last_observation_counts(required: dict[str, F.FactValue]) -> None:
    observed = [*observed_as(required), F.make_fact("rootfs_readonly", False, source="late")]
    assert [m.name for m in F.compare(required, observed)] == ["rootfs_readonly"]


def test_mismatch_report_and_wire_shapes(required: dict[str, F.FactValue]) -> None:
    ms = F.compare(required, observed_as(required, seccomp_mode=0, cap_bnd=["SYS_ADMIN"]))
    assert F.mismatch_report(ms) == {
        "required": {"cap_bnd": [], "seccomp_mode": 2},
        "observed": {"cap_bnd": ["SYS_ADMIN"], "seccomp_mode": 0},
    }
    assert [F.mismatch_name(m) for m in ms] == ["cap_bnd", "seccomp_mode"]
    values: list[F.FactValue] = ["x", 1, 1.5, True, ["a"], None]
    for value in values:
        fact = F.make_fact("n", value, source="s", observed_at=2.5)
        assert msgspec.json.decode(msgspec.json.encode(fact), type=Fact) == fact
    assert msgspec.to_builtins(ms[0]) == {
        "name": "cap_bnd",
        "required": [],
        "observed": ["SYS_ADMIN"],
        "source": "test:cap_bnd",
    }


# -- egress ---------------------------------------------------------------------------------


def test_an_egress_sandbox_requires_its_listener_digest_and_bundle() -> None:
    profile = profiles.Profile(
        name="e", network="egress", egress_allow=["b.example", "a.example"], ca_bundle="host"
    )
    req = F.required_facts(
        profile,
        run_uid=1000,
        run_gid=1000,
        workspace_mode="rw",
        readonly_dirs=[],
        seccomp_expected=True,
    )
    assert req["network_mode"] == "none"
    assert req["net_links"] == ["lo"] and req["net_routes"] == []
    extra = F.egress_required(profile, ca_bundle="sha256:ab")
    assert extra == {
        "egress_allow_digest": AllowList.of(["a.example", "b.example"]).digest,
        "egress_listeners": ["127.0.0.1:3128=substrate"],
        "ca_bundle": "sha256:ab",
    }
    assert "ca_bundle" not in F.egress_required(profile, ca_bundle=None)
    assert F.egress_required(profiles.Profile(name="p"), ca_bundle="sha256:ab") == {}
    ok = observed_as(extra)
    assert F.compare(extra, ok) == []
    for name, value in [
        ("egress_listeners", ["127.0.0.1:3128=substrate", "127.0.0.1:8080=other"]),
        ("egress_listeners", ["127.0.0.1:3128=other"]),
        ("egress_listeners", []),
        ("egress_allow_digest", AllowList.of(["a.example"]).digest),
        ("ca_bundle", "sha256:cd"),
        ("ca_bundle", None),
    ]:
        assert [m.name for m in F.compare(extra, observed_as(extra, **{name: value}))] == [name]
