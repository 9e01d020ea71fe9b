"""`substrate.sandbox.spec` (pure): who runs, and the create request."""

from __future__ import annotations

import pytest

from substrate.egress.cabundle import CA_BUNDLE_TARGET
from substrate.errors import ConfinementUnmet
from substrate.sandbox.profiles import EGRESS_ENV, Profile
from substrate.sandbox.spec import (
    KEEPALIVE,
    LABEL_CONFIG,
    LABEL_DAEMON,
    LABEL_EPOCH,
    LABEL_PROFILE,
    LABEL_WORKSPACE,
    PROXY_URL,
    RunAs,
    container_spec,
    create_request,
    egress_env,
    run_as,
    spec_digest,
    tmpfs_options,
)


def test_owner_runs_and_root_needs_allow_root() -> None:
    assert run_as(Profile(name="p", workspace="rw"), 1000, 1001) == RunAs(1000, 1001)
    assert run_as(Profile(name="p", workspace="rw", user="2000:3000"), 1000, 1000) == RunAs(
        2000, 3000
    )
    with pytest.raises(ConfinementUnmet) as caught:
        run_as(Profile(name="p", workspace="rw"), 0, 0)
    assert "chown" in caught.value.message
    assert run_as(Profile(name="p", workspace="rw", allow_root=True), 0, 0) == RunAs(0, 0)
    with pytest.raises(ConfinementUnmet):
        run_as(Profile(name="p", workspace="rw", user="0:0"), 1000, 1000)


def spec(profile: Profile, **kw: object) -> dict[str, object]:
    args: dict[str, object] = {
        "who": RunAs(1000, 1000),
        "workspace_source": "/src/proj",
        "readonly_dirs": [".git"],
        "security_opt": ["no-new-privileges", "seccomp={}"],
    }
    args.update(kw)
    return container_spec(profile, **args)  # type: ignore[arg-type]


def test_spec_comes_from_the_profile_only() -> None:
    profile = Profile(
        name="p", workspace="rw", memory="256m", pids=64, cpus=1.5, capabilities=["CHOWN"]
    )
    out = spec(profile)
    host = out["host_config"]
    assert isinstance(host, dict)
    assert out["command"] == list(KEEPALIVE)
    assert out["user"] == "1000:1000"
    assert out["environment"] == profile.env
    assert host["network_mode"] == "none"
    assert host["read_only"] is True
    assert host["cap_drop"] == ["ALL"] and host["cap_add"] == ["CHOWN"]
    assert host["pids_limit"] == 64 and host["nano_cpus"] == 1_500_000_000
    assert host["mem_limit"] == host["memswap_limit"] == "256m"
    assert host["security_opt"] == ["no-new-privileges", "seccomp={}"]
    assert host["init"] is True and host["privileged"] is False
    # The engine reads the runtime from HostConfig only: a top-level one is ignored.
    assert host["runtime"] == "runc" and "runtime" not in out
    gvisor = spec(Profile(name="g", runtime="runsc", seccomp="engine-default"))
    assert gvisor["host_config"]["runtime"] == "runsc"  # type: ignore[index]
    assert host["tmpfs"] == {"/tmp": tmpfs_options("256m")}
    mounts = host["mounts"]
    assert [(m["Source"], m["Target"], m["ReadOnly"]) for m in mounts] == [
        ("/src/proj", "/workspace", False),
        ("/src/proj/.git", "/workspace/.git", True),
    ]
    assert "docker.sock" not in repr(out)


def test_an_empty_resolver_file_is_bound_read_only() -> None:
    host = spec(Profile(name="p", workspace="rw"), resolv_conf="/state/sandbox-files/resolv.conf")[
        "host_config"
    ]
    assert isinstance(host, dict)
    assert host["mounts"][-1] == {
        "Type": "bind",
        "Source": "/state/sandbox-files/resolv.conf",
        "Target": "/etc/resolv.conf",
        "ReadOnly": True,
        "BindOptions": {"Propagation": "rprivate"},
    }
    none = spec(Profile(name="p", workspace="none"), resolv_conf="/r")["host_config"]
    assert [m["Target"] for m in none["mounts"]] == ["/etc/resolv.conf"]  # type: ignore[index]


def test_the_home_is_bound_read_write_and_the_env_is_the_profiles_only() -> None:
    prof = Profile(name="p", secrets={"TOKEN": "tok"})
    out = spec(prof, home_source="/state/homes/1-2/1000")
    host = out["host_config"]
    assert isinstance(host, dict)
    assert host["mounts"][-1] == {
        "Type": "bind",
        "Source": "/state/homes/1-2/1000",
        "Target": "/home/agent",
        "ReadOnly": False,
        "BindOptions": {"Propagation": "rprivate"},
    }
    # Secrets are per exec: never in the container's environment.
    assert out["environment"] == prof.env and "TOKEN" not in repr(out)
    assert prof.env["HOME"] == "/home/agent"


def test_workspace_modes() -> None:
    ro = spec(Profile(name="p", workspace="ro"))["host_config"]
    assert isinstance(ro, dict)
    assert ro["mounts"][0]["ReadOnly"] is True
    none = spec(Profile(name="p", workspace="none"))
    assert none["host_config"]["mounts"] == []  # type: ignore[index]
    assert none["working_dir"] == "/"


def test_the_create_request_is_named_and_labelled_with_the_digest_of_its_spec() -> None:
    made = spec(Profile(name="box", workspace="rw"))
    request = create_request("w_1", "box", made, daemon_id="d" * 16, epoch=7, token="abc123")
    assert request.name == "substrate-w_1-box-abc123"
    assert request.labels == {
        LABEL_DAEMON: "d" * 16,
        LABEL_WORKSPACE: "w_1",
        LABEL_PROFILE: "box",
        LABEL_EPOCH: "7",
        LABEL_CONFIG: spec_digest(made),
    }
    assert request.spec is made  # a supervisor directory is bound in after the digest


def test_digest_changes_with_any_setting() -> None:
    base = spec_digest(spec(Profile(name="p", workspace="rw")))
    assert base == spec_digest(spec(Profile(name="p", workspace="rw")))
    assert base != spec_digest(spec(Profile(name="p", workspace="rw", read_only_rootfs=False)))
    assert base != spec_digest(spec(Profile(name="p", workspace="rw"), readonly_dirs=[]))


def test_an_egress_sandbox_gets_the_proxy_and_its_bundle_and_no_network() -> None:
    profile = Profile(name="e", network="egress", egress_allow=["pkg.example.org"])
    out = spec(profile, ca_bundle="/state/sandbox-files/ca-x.crt")
    host = out["host_config"]
    assert isinstance(host, dict)
    assert host["network_mode"] == "none"  # the way out is the daemon's listener
    env = out["environment"]
    assert isinstance(env, dict)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        assert env[name] == PROXY_URL == "http://127.0.0.1:3128"
    assert env["NO_PROXY"] == env["no_proxy"] == "localhost,127.0.0.1,::1"
    for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "CURL_CA_BUNDLE"):
        assert env[name] == CA_BUNDLE_TARGET
    assert set(egress_env(profile, ca_bundle=True)) == EGRESS_ENV
    assert {k: v for k, v in env.items() if k not in EGRESS_ENV} == profile.env
    assert host["mounts"][-1] == {
        "Type": "bind",
        "Source": "/state/sandbox-files/ca-x.crt",
        "Target": CA_BUNDLE_TARGET,
        "ReadOnly": True,
        "BindOptions": {"Propagation": "rprivate"},
    }
    without = spec(profile)["environment"]
    assert isinstance(without, dict) and "SSL_CERT_FILE" not in without and "HTTPS_PROXY" in without
    # A profile without egress gets none of it.
    assert egress_env(Profile(name="p"), ca_bundle=True) == {}
    assert spec(Profile(name="p"))["environment"] == Profile(name="p").env
