"""Profile loading and validation, and the shipped profiles, without an engine."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import msgspec
import pytest

from substrate.process.argv import exec_env
from substrate.sandbox import profiles
from substrate.sandbox.profiles import (
    MAX_PROFILE_SECRETS,
    Profile,
    ProfileError,
    load_profile,
    load_profiles,
    parse_size,
    profile_public,
    with_secrets,
)
from substrate.sandbox.spec import HOME_TARGET, WORKSPACE_TARGET
from substrate.schema.profile import GitIdentity

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "profiles"
SECCOMP = ROOT / "seccomp"
SHIPPED = sorted(p.stem for p in PROFILES.glob("*.toml"))

#: A complete, valid profile body; tests replace one line of it.
GOOD = """\
description = "test"
image = "substrate-sandbox:bookworm"
runtime = "runc"
user = "owner"
workspace = "rw"
tmpfs = { "/tmp" = "256m" }
memory = "1g"
cpus = 2.0
pids = 256
timeout_s = 600
max_output_bytes = 1073741824
seccomp = "strict"
capabilities = []
env = { LANG = "C.UTF-8", PATH = "/usr/bin:/bin", HOME = "/tmp" }
"""


def _write(directory: Path, body: str, name: str = "x") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.toml"
    path.write_text(body)
    return path


def _with(key: str, line: str) -> str:
    """GOOD with the line for `key` replaced by `line` (or `line` appended if new)."""
    lines = [ln for ln in GOOD.splitlines() if not ln.startswith(f"{key} =")]
    return "\n".join([*lines, line]) + "\n"


def _refusal(tmp_path: Path, body: str, seccomp_dir: Path = SECCOMP) -> str:
    path = _write(tmp_path / "profiles", body)
    with pytest.raises(ProfileError) as info:
        load_profile(path, seccomp_dir)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    return message


# -- shipped profiles ---------------------------------------------------------------------


def test_the_promised_profiles_are_shipped() -> None:
    assert {"default", "readonly", "gvisor", "interactive", "tiny"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_loads(name: str) -> None:
    profile = load_profile(PROFILES / f"{name}.toml", SECCOMP)
    assert profile.name == name
    assert profile.description


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_lists_and_comments_every_key(name: str) -> None:
    """nsjail style: every key is written out, each under a comment saying what it is."""
    lines = (PROFILES / f"{name}.toml").read_text().splitlines()
    keys = []
    for i, line in enumerate(lines):
        m = re.match(r"([a-z_]+) = ", line)
        if m:
            keys.append(m.group(1))
            assert lines[i - 1].startswith("# "), f"{name}: no comment above {m.group(1)}"
    assert sorted(keys) == sorted(f for f in Profile.__struct_fields__ if f != "name")


def test_load_profiles_reads_the_directory() -> None:
    loaded = load_profiles(PROFILES, SECCOMP)
    assert sorted(loaded) == SHIPPED
    assert all(loaded[name].name == name for name in loaded)


def test_default_profile_is_the_promised_confinement() -> None:
    p = load_profile(PROFILES / "default.toml", SECCOMP)
    assert p == Profile(
        name="default",
        description=p.description,
        image="substrate-sandbox:bookworm",
        runtime="runc",
        user="owner",
        allow_root=False,
        workspace="layer",
        network="none",
        read_only_rootfs=True,
        tmpfs={"/tmp": "256m"},
        memory="1g",
        cpus=2.0,
        pids=256,
        timeout_s=600.0,
        max_output_bytes=1 << 30,
        seccomp="strict",
        capabilities=[],
        no_new_privileges=True,
        env={"LANG": "C.UTF-8", "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/home/agent"},
        secrets={},
        argv_allow=[],
        interactive=False,
        git_refs_allow=["refs/heads/agent/**"],
        git_identity=GitIdentity(name="substrate agent", email="agent@substrate.invalid"),
    )


def _differences(name: str) -> dict[str, object]:
    base = msgspec.to_builtins(load_profile(PROFILES / "default.toml", SECCOMP))
    other = msgspec.to_builtins(load_profile(PROFILES / f"{name}.toml", SECCOMP))
    return {k: v for k, v in other.items() if v != base[k] and k not in ("name", "description")}


def test_readonly_differs_from_default_only_in_workspace() -> None:
    assert _differences("readonly") == {"workspace": "ro"}


def test_gvisor_differs_from_default_in_runtime_and_seccomp() -> None:
    # pids is higher: gVisor's Sentry threads count against the container's pids limit.
    # workspace is "rw": the working layer reaches a container by mount propagation, which
    # gVisor's gofer does not follow.
    assert _differences("gvisor") == {
        "runtime": "runsc",
        "seccomp": "engine-default",
        "pids": 1024,
        "workspace": "rw",
    }


def test_interactive_differs_from_default_in_pty_and_term() -> None:
    diff = _differences("interactive")
    assert diff.pop("interactive") is True
    env = diff.pop("env")
    assert isinstance(env, dict)
    assert env["TERM"] == "xterm-256color"
    assert env["HOME"] == "/home/agent"
    # A person's terminal writes the checkout directly (the reactive gate, which never
    # reverts what it cannot attribute to the sandbox: docs/write-gate.md).
    assert diff == {"workspace": "rw"}


def test_tiny_differs_from_default_in_image_and_limits() -> None:
    assert _differences("tiny") == {
        "image": "substrate-tiny:latest",
        "memory": "256m",
        "pids": 128,
        # The fast-test profile keeps the plain bind: the rw path and its gate are tested
        # with it.
        "workspace": "rw",
    }


# -- helpers --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("4096", 4096),
        ("10b", 10),
        ("1k", 1024),
        ("1K", 1024),
        ("256m", 256 << 20),
        ("1g", 1 << 30),
        ("64G", 64 << 30),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", "1q", "1.5g", "1gb", "1 g", "-1", "g", "1t", " 1", "99999999999999999999"]
)
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


def test_numbers_the_engine_and_kernel_see() -> None:
    p = load_profile(PROFILES / "tiny.toml", SECCOMP)
    assert profiles.memory_bytes(p) == 256 << 20
    assert profiles.tmpfs_bytes(p) == {"/tmp": 256 << 20}
    assert profiles.nano_cpus(p) == 2_000_000_000
    assert profiles.cpu_quota_us(p) == 200_000
    assert profiles.user_ids(p) is None
    fixed = msgspec.structs.replace(p, user="1000:1001", cpus=0.5)
    assert profiles.user_ids(fixed) == (1000, 1001)
    assert profiles.cpu_quota_us(fixed) == 50_000


def test_capability_mask_matches_proc_status_bits() -> None:
    assert profiles.capability_mask([]) == 0
    assert profiles.capability_mask(["CHOWN", "KILL"]) == 0x21
    assert profiles.capability_mask(["NET_BIND_SERVICE", "SYS_ADMIN"]) == (1 << 10) | (1 << 21)
    assert max(profiles.CAPABILITIES.values()) == 40  # CHECKPOINT_RESTORE
    assert len(profiles.CAPABILITIES) == 41


def test_security_opts() -> None:
    default = load_profile(PROFILES / "default.toml", SECCOMP)
    opts = profiles.security_opts(default, SECCOMP)
    assert opts[0] == "no-new-privileges"
    assert json.loads(opts[1].removeprefix("seccomp=")) == json.loads(
        (SECCOMP / "strict.json").read_text()
    )
    gvisor = load_profile(PROFILES / "gvisor.toml", SECCOMP)
    assert profiles.security_opts(gvisor, SECCOMP) == ["no-new-privileges"]


def test_profile_public_is_json_and_round_trips() -> None:
    p = load_profile(PROFILES / "interactive.toml", SECCOMP)
    public = profiles.profile_public(p)
    assert json.loads(json.dumps(public)) == public
    assert public["name"] == "interactive"
    assert msgspec.convert(public, Profile) == p


# -- refusals ---------------------------------------------------------------------------------


def test_good_body_loads(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD)
    assert load_profile(path, SECCOMP).name == "x"


def test_unknown_key_names_file_and_key(tmp_path: Path) -> None:
    msg = _refusal(tmp_path, _with("netwrok", 'netwrok = "none"'))
    assert msg.endswith(": unknown key 'netwrok'")


def test_name_key_is_refused(tmp_path: Path) -> None:
    assert "unknown key 'name'" in _refusal(tmp_path, _with("name", 'name = "other"'))


@pytest.mark.parametrize(
    ("line", "where", "why"),
    [
        ('memory = "1q"', "$.memory", "invalid size '1q'"),
        ('memory = "0"', "$.memory", "minimum"),
        ("memory = 1024", "$.memory", "Expected `str`, got `int`"),
        ('tmpfs = { "/tmp" = "lots" }', "$.tmpfs.'/tmp'", "invalid size"),
        ('tmpfs = { "/tmp" = "0" }', "$.tmpfs.'/tmp'", "unlimited"),
        ('tmpfs = { "/" = "1m" }', "$.tmpfs.'/'", "absolute"),
        ('tmpfs = { "tmp" = "1m" }', "$.tmpfs.'tmp'", "absolute"),
        ('tmpfs = { "/a/../b" = "1m" }', "$.tmpfs.'/a/../b'", "normalised"),
        ('tmpfs = { "/tmp,exec" = "1m" }', "$.tmpfs.'/tmp,exec'", "absolute"),
        ('tmpfs = { "/workspace" = "1m" }', "$.tmpfs.'/workspace'", "may not cover"),
        ('tmpfs = { "/workspace/.git" = "1m" }', "$.tmpfs.'/workspace/.git'", "may not cover"),
        ('tmpfs = { "/proc" = "1m" }', "$.tmpfs.'/proc'", "may not cover"),
        ("cpus = 0", "$.cpus", "more than 0"),
        ("cpus = 65", "$.cpus", "at most 64"),
        ("cpus = nan", "$.cpus", "more than 0"),
        ("cpus = inf", "$.cpus", "more than 0"),
        ("pids = 0", "$.pids", "1.."),
        ('pids = "256"', "$.pids", "Expected `int`, got `str`"),
        ("pids = 2.5", "$.pids", "Expected `int`, got `float`"),
        ("timeout_s = 0", "$.timeout_s", "positive"),
        ("timeout_s = -1.5", "$.timeout_s", "positive"),
        ("max_output_bytes = -1", "$.max_output_bytes", "0 or more"),
        ('user = "root"', "$.user", '"owner" or "UID:GID"'),
        ('user = "1000"', "$.user", '"owner" or "UID:GID"'),
        ('user = "-1:0"', "$.user", '"owner" or "UID:GID"'),
        ('user = "4294967295:0"', "$.user", "ids must be"),
        ('user = "0:0"', "$.user", "allow_root"),
        ('capabilities = ["CAP_CHOWN"]', "$.capabilities[0]", "write 'CHOWN'"),
        ('capabilities = ["chown"]', "$.capabilities[0]", "unknown capability 'chown'"),
        ('capabilities = ["SYS_WIZARD"]', "$.capabilities[0]", "unknown capability"),
        ('capabilities = ["KILL", "KILL"]', "$.capabilities[1]", "twice"),
        ('env = { "1X" = "a" }', "$.env.1X", "variable name"),
        ('env = { "A=B" = "a" }', "$.env.A=B", "variable name"),
        ('env = { A = "a\\u0000b" }', "$.env.A", "NUL"),
        ('secrets = { "1X" = "tok" }', "$.secrets.1X", "variable name"),
        ('secrets = { SUBSTRATE_PROC = "tok" }', "$.secrets.SUBSTRATE_PROC", "variable name"),
        ('secrets = { LANG = "tok" }', "$.secrets.LANG", "also set in env"),
        ('secrets = { T = "../x" }', "$.secrets.T", "secret name must match"),
        ('secrets = { T = "" }', "$.secrets.T", "secret name must match"),
        ("secrets = { T = 1 }", "$.secrets[...]", "Expected `str`, got `int`"),
        ('tmpfs = { "/home/agent" = "1m" }', "$.tmpfs.'/home/agent'", "may not cover"),
        ('argv_allow = [""]', "$.argv_allow[0]", "empty"),
        ('runtime = "kata"', "$.runtime", "Invalid enum value 'kata'"),
        ('workspace = "rwx"', "$.workspace", "Invalid enum value"),
        ('network = "bridge"', "$.network", "Invalid enum value 'bridge'"),
        ('image = "Has Space"', "$.image", "image reference"),
        ('description = "two\\nlines"', "$.description", "one line"),
        ('seccomp = "nope"', "$.seccomp", "no policy file"),
        ('seccomp = "../seccomp/strict"', "$.seccomp", "policy name"),
        ("interactive = 1", "$.interactive", "Expected `bool`, got `int`"),
    ],
)
def test_bad_value_names_file_and_key(tmp_path: Path, line: str, where: str, why: str) -> None:
    key = line.split(" =")[0]
    msg = _refusal(tmp_path, _with(key, line))
    assert f": {where}: " in msg, msg
    assert why in msg, msg


def test_root_is_fine_when_allowed(tmp_path: Path) -> None:
    body = _with("user", 'user = "0:0"') + "allow_root = true\n"
    assert load_profile(_write(tmp_path, body), SECCOMP).user == "0:0"


def test_a_layer_workspace_is_accepted_under_runc_only(tmp_path: Path) -> None:
    path = _write(tmp_path / "ok", _with("workspace", 'workspace = "layer"'))
    assert load_profile(path, SECCOMP).workspace == "layer"
    body = _with("workspace", 'workspace = "layer"').replace(
        'seccomp = "strict"', 'seccomp = "engine-default"'
    )
    body = "\n".join(ln for ln in body.splitlines() if not ln.startswith("runtime ="))
    msg = _refusal(tmp_path, body + '\nruntime = "runsc"\n')
    assert ': $.workspace: "layer" (the default) needs runtime "runc"' in msg
    # A terminal on a layer profile shares its generation (docs/terminals.md).
    body = _with("workspace", 'workspace = "layer"') + "interactive = true\n"
    terminal = load_profile(_write(tmp_path / "i", body), SECCOMP)
    assert (terminal.workspace, terminal.interactive) == ("layer", True)


def test_runsc_with_a_seccomp_policy_is_refused(tmp_path: Path) -> None:
    msg = _refusal(tmp_path, _with("runtime", 'runtime = "runsc"'))
    assert ': $.seccomp: runtime "runsc" does not enforce seccomp policies' in msg


def test_engine_default_needs_no_file(tmp_path: Path) -> None:
    body = _with("seccomp", 'seccomp = "engine-default"')
    assert load_profile(_write(tmp_path, body), tmp_path / "empty").seccomp == "engine-default"


def test_bad_seccomp_file_is_named(tmp_path: Path) -> None:
    seccomp_dir = tmp_path / "seccomp"
    seccomp_dir.mkdir()
    policy = json.loads((SECCOMP / "strict.json").read_text())
    policy["syscalls"][0]["acton"] = "SCMP_ACT_ALLOW"
    (seccomp_dir / "strict.json").write_text(json.dumps(policy))
    msg = _refusal(tmp_path, GOOD, seccomp_dir)
    assert ": $.seccomp: policy 'strict' is invalid: " in msg
    assert f"{seccomp_dir / 'strict.json'}: unknown field 'acton' at $.syscalls[0]" in msg


def test_toml_syntax_error_names_file(tmp_path: Path) -> None:
    assert "not valid TOML" in _refusal(tmp_path, GOOD + "memory = \n")


def test_non_utf8_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_bytes(b'description = "\xff"\n')
    with pytest.raises(ProfileError, match=f"^{path}: not valid TOML"):
        load_profile(path, SECCOMP)


@pytest.mark.parametrize("stem", ["Default", "-x", "a b", "x" * 65, "_x"])
def test_bad_file_stem_is_refused(tmp_path: Path, stem: str) -> None:
    path = _write(tmp_path, GOOD, stem)
    with pytest.raises(ProfileError, match="profile name"):
        load_profile(path, SECCOMP)


def test_load_profiles_ignores_other_files_and_stops_at_a_bad_one(tmp_path: Path) -> None:
    directory = tmp_path / "profiles"
    _write(directory, GOOD, "good")
    (directory / "README").write_text("not a profile")
    (directory / "old.toml.bak").write_text("netwrok = 1")
    assert list(load_profiles(directory, SECCOMP)) == ["good"]
    _write(directory, _with("pids", "pids = 0"), "bad")
    with pytest.raises(ProfileError, match=re.escape(f"{directory / 'bad.toml'}: $.pids")):
        load_profiles(directory, SECCOMP)


def test_load_profiles_refuses_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cannot list"):
        load_profiles(tmp_path / "nowhere", SECCOMP)


def test_shipped_profiles_load_from_a_copy(tmp_path: Path) -> None:
    """The shipped files carry no dependency on where the checkout lives."""
    shutil.copytree(PROFILES, tmp_path / "profiles")
    shutil.copytree(SECCOMP, tmp_path / "seccomp")
    loaded = load_profiles(tmp_path / "profiles", tmp_path / "seccomp")
    assert loaded == load_profiles(PROFILES, SECCOMP)


def test_secrets_name_variables_and_secret_names_only(tmp_path: Path) -> None:
    body = _with("secrets", 'secrets = { API_TOKEN = "api-token", B = "api-token" }')
    profile = load_profile(_write(tmp_path / "profiles", body), SECCOMP)
    assert profile.secrets == {"API_TOKEN": "api-token", "B": "api-token"}
    assert profile_public(profile)["secrets"] == {"API_TOKEN": "api-token", "B": "api-token"}
    given = with_secrets(profile, {"api-token": "v"})
    assert given.env == {**profile.env, "API_TOKEN": "v", "B": "v"}
    assert "v" not in profile.env.values()  # the loaded profile is untouched
    assert with_secrets(load_profile(PROFILES / "default.toml", SECCOMP), {}).secrets == {}
    many = ", ".join(f'V{i} = "s"' for i in range(MAX_PROFILE_SECRETS + 1))
    assert "at most" in _refusal(tmp_path, _with("secrets", f"secrets = {{ {many} }}"))


def test_the_home_and_workspace_targets_are_never_covered_by_a_tmpfs() -> None:
    assert {WORKSPACE_TARGET, HOME_TARGET} <= set(profiles._TMPFS_FORBIDDEN)


# -- egress ---------------------------------------------------------------------------------

EGRESS = GOOD + 'network = "egress"\n'


def _no_pip() -> tuple[list[str], str | None]:
    raise AssertionError("@pip-index was not asked for")


def test_an_egress_profile_loads_its_allow_list_normalised(tmp_path: Path) -> None:
    body = EGRESS + 'egress_allow = ["Pkg.Example.org.", "*.cdn.example", "pkg.example.org"]\n'
    p = load_profile(_write(tmp_path, body), SECCOMP, pip_index=_no_pip)
    assert p.network == "egress"
    assert p.egress_allow == ["*.cdn.example", "pkg.example.org"]


def test_pip_index_is_replaced_by_what_pip_names(tmp_path: Path) -> None:
    body = EGRESS + 'egress_allow = ["@pip-index", "extra.example"]\n'
    path = _write(tmp_path, body)
    found = load_profile(
        path, SECCOMP, pip_index=lambda: (["index.example", "files.example"], None)
    )
    assert found.egress_allow == ["extra.example", "files.example", "index.example"]
    # pip's configuration unreadable: the token allows nothing (and the log says why).
    nothing = load_profile(path, SECCOMP, pip_index=lambda: ([], "no pip here"))
    assert nothing.egress_allow == ["extra.example"]


def test_the_shipped_setup_profile_allows_only_pips_index_and_npms_registry(
    tmp_path: Path,
) -> None:
    setup = load_profile(
        PROFILES / "setup.toml",
        SECCOMP,
        pip_index=lambda: (["index.example"], None),
        npm_registry=lambda: (["npm.example"], None),
    )
    assert setup.egress_allow == ["index.example", "npm.example"]
    assert (setup.network, setup.ca_bundle) == ("egress", "host")
    diff = {
        k: v
        for k, v in msgspec.to_builtins(setup).items()
        if v != msgspec.to_builtins(load_profile(PROFILES / "default.toml", SECCOMP))[k]
        and k not in ("name", "description")
    }
    npm_env = {
        **msgspec.to_builtins(load_profile(PROFILES / "default.toml", SECCOMP))["env"],
        "PATH": "/home/agent/.npm-global/bin:/usr/local/bin:/usr/bin:/bin",
        "NPM_CONFIG_PREFIX": "/home/agent/.npm-global",
        "NPM_CONFIG_CACHE": "/home/agent/.npm",
        "NPM_CONFIG_UPDATE_NOTIFIER": "false",
        "NPM_CONFIG_FUND": "false",
        "NPM_CONFIG_AUDIT": "false",
    }
    assert diff == {
        "network": "egress",
        "egress_allow": ["index.example", "npm.example"],
        "ca_bundle": "host",
        "env": npm_env,
    }


@pytest.mark.parametrize(
    ("body", "where", "why"),
    [
        (GOOD + 'egress_allow = ["a.example"]\n', "$.egress_allow", 'only a network = "egress"'),
        (GOOD + 'ca_bundle = "host"\n', "$.ca_bundle", 'only a network = "egress"'),
        (EGRESS + 'egress_allow = ["*"]\n', "$.egress_allow[0]", "whole first label"),
        (EGRESS + 'egress_allow = ["a.example", "a b"]\n', "$.egress_allow[1]", "not a host"),
        (EGRESS + 'egress_allow = ["*.org"]\n', "$.egress_allow[0]", "two labels"),
        (EGRESS + 'egress_allow = ["@index"]\n', "$.egress_allow[0]", "not a host"),
        (EGRESS + 'ca_bundle = "certs.pem"\n', "$.ca_bundle", "absolute file path"),
        (EGRESS + 'ca_bundle = "/nonexistent/ca.pem"\n', "$.ca_bundle", "cannot open"),
        (EGRESS + 'ca_bundle = "/etc"\n', "$.ca_bundle", "not a regular file"),
        (EGRESS + 'ca_bundle = "/etc/hostname"\n', "$.ca_bundle", "no PEM certificate"),
    ],
)
def test_bad_egress_settings_name_file_and_key(
    tmp_path: Path, body: str, where: str, why: str
) -> None:
    msg = _refusal(tmp_path, body)
    assert f": {where}: " in msg, msg
    assert why in msg, msg


def test_an_egress_profile_may_not_set_what_substrate_sets(tmp_path: Path) -> None:
    for name in ("HTTPS_PROXY", "no_proxy", "SSL_CERT_FILE", "PIP_CERT"):
        body = EGRESS.replace('HOME = "/tmp" }', f'HOME = "/tmp", {name} = "x" }}')
        msg = _refusal(tmp_path / name, body)
        assert f": $.env.{name}: substrate sets it" in msg, msg
    # A profile without egress may set them (they lead nowhere there).
    plain = GOOD.replace('HOME = "/tmp" }', 'HOME = "/tmp", HTTPS_PROXY = "x" }')
    assert load_profile(_write(tmp_path / "plain", plain), SECCOMP).env["HTTPS_PROXY"] == "x"


def test_egress_needs_runc(tmp_path: Path) -> None:
    body = EGRESS.replace('runtime = "runc"', 'runtime = "runsc"').replace(
        'seccomp = "strict"', 'seccomp = "engine-default"'
    )
    assert ': $.network: "egress" needs runtime "runc"' in _refusal(tmp_path, body)


INJECT = EGRESS + 'egress_allow = ["api.example.com", "*.cdn.example"]\nca_bundle = "host"\n'


def test_an_inject_table_is_loaded_with_names_only(tmp_path: Path) -> None:
    body = INJECT + '[egress_inject."api.example.com"]\nheader = "x-api-key"\nsecret = "model"\n'
    found = load_profile(_write(tmp_path, body), SECCOMP)
    assert msgspec.to_builtins(found.egress_inject) == {
        "api.example.com": {"header": "x-api-key", "secret": "model"}
    }


@pytest.mark.parametrize(
    ("body", "where", "why"),
    [
        (
            GOOD + '[egress_inject."a.example"]\nheader = "x"\nsecret = "s"\n',
            "$.egress_inject",
            'only a network = "egress"',
        ),
        (
            EGRESS + 'egress_allow = ["a.example"]\n'
            '[egress_inject."a.example"]\nheader = "x"\nsecret = "s"\n',
            "$.egress_inject",
            "needs ca_bundle",
        ),
        (
            INJECT + '[egress_inject."other.example"]\nheader = "x"\nsecret = "s"\n',
            "$.egress_inject.other.example",
            "not in egress_allow",
        ),
        (
            INJECT + '[egress_inject."*.cdn.example"]\nheader = "x"\nsecret = "s"\n',
            "$.egress_inject.*.cdn.example",
            "no wildcard",
        ),
        (
            INJECT + '[egress_inject."API.example.com"]\nheader = "x"\nsecret = "s"\n',
            "$.egress_inject.API.example.com",
            "lower case",
        ),
        (
            INJECT + '[egress_inject."api.example.com"]\nheader = "Host"\nsecret = "s"\n',
            "$.egress_inject.api.example.com.header",
            "not a header name",
        ),
        (
            INJECT + '[egress_inject."api.example.com"]\nheader = "x y"\nsecret = "s"\n',
            "$.egress_inject.api.example.com.header",
            "not a header name",
        ),
        (
            INJECT + '[egress_inject."api.example.com"]\nheader = "x"\nsecret = "../s"\n',
            "$.egress_inject.api.example.com.secret",
            "a secret name must match",
        ),
    ],
)
def test_bad_inject_tables_name_file_and_key(
    tmp_path: Path, body: str, where: str, why: str
) -> None:
    msg = _refusal(tmp_path, body)
    assert f": {where}: " in msg, msg
    assert why in msg, msg


def test_a_ca_bundle_file_is_accepted(tmp_path: Path) -> None:
    bundle = tmp_path / "ca.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    body = EGRESS + f'ca_bundle = "{bundle}"\n'
    assert load_profile(_write(tmp_path / "p", body), SECCOMP).ca_bundle == str(bundle)


# -- reloads: digests and what changed -----------------------------------------------------------


def test_a_profile_set_digests_each_profile_and_its_seccomp_policy(tmp_path: Path) -> None:
    seccomp_dir = tmp_path / "seccomp"
    shutil.copytree(SECCOMP, seccomp_dir)
    _write(tmp_path / "profiles", GOOD, "a")
    _write(tmp_path / "profiles", _with("pids", "pids = 64"), "b")
    first = profiles.load_profile_set(tmp_path / "profiles", seccomp_dir)
    assert sorted(first.profiles) == ["a", "b"] and len(set(first.digests.values())) == 2
    # Same files, same digests: nothing changed.
    again = profiles.load_profile_set(tmp_path / "profiles", seccomp_dir)
    assert again.changes(first.digests) == ([], [], [])
    # The seccomp policy both name, edited in place: its bytes are in the digest.
    policy = json.loads((seccomp_dir / "strict.json").read_text())
    policy["syscalls"][0]["names"] = policy["syscalls"][0]["names"][:-1]  # one call fewer
    (seccomp_dir / "strict.json").write_text(json.dumps(policy))
    (tmp_path / "profiles" / "a.toml").unlink()
    _write(tmp_path / "profiles", GOOD, "c")
    edited = profiles.load_profile_set(tmp_path / "profiles", seccomp_dir)
    assert edited.changes(first.digests) == (["c"], ["a"], ["b"])


def test_replace_in_place_keeps_the_dict_readers_hold() -> None:
    held = {"a": Profile(name="a"), "b": Profile(name="b")}
    same = held
    profiles.replace_in_place(held, {"c": Profile(name="c")})
    assert same is held and list(held) == ["c"]


# -- git ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ('git_refs_allow = ["heads/*"]', "git_refs_allow[0]"),
        ('git_refs_allow = ["refs/a\\\\b"]', "git_refs_allow"),
        ('git_identity = { name = "a", email = "" }', "git_identity"),
        ('git_identity = { name = "a<b>", email = "e@x" }', "git_identity.name"),
    ],
)
def test_git_keys_are_checked(tmp_path: Path, line: str, key: str) -> None:
    assert f"{key}:" in _refusal(tmp_path, _with(line.split(" ")[0], line))


def test_git_identity_is_set_over_env_in_every_command() -> None:
    p = load_profile(PROFILES / "default.toml", SECCOMP)
    mine = msgspec.structs.replace(p, env={**p.env, "GIT_AUTHOR_NAME": "someone else"})
    env = profiles.git_env(mine)
    assert env["GIT_AUTHOR_NAME"] == env["GIT_COMMITTER_NAME"] == "substrate agent"
    assert env["GIT_AUTHOR_EMAIL"] == env["GIT_COMMITTER_EMAIL"] == "agent@substrate.invalid"
    assert exec_env(mine, "p1")["GIT_AUTHOR_NAME"] == "substrate agent"
    assert profiles.git_env(msgspec.structs.replace(p, git_identity=GitIdentity())) == {}
