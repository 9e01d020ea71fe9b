"""substrate.config: `substrate.toml` keys, flag overrides, refusals that name the key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from substrate.config import PROJECT_ROOT, Config, ConfigError, default_state_dir, load_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "substrate.toml"
    path.write_text(text)
    return path


def test_defaults_without_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SUBSTRATE_STATE_DIR", str(tmp_path / "st"))
    config = load_config(None, {})
    assert config == Config(state_dir=str(tmp_path / "st"))
    assert config.adopt_roots == []
    assert config.max_request_bytes == 1 << 20
    assert config.listen.startswith("127.0.0.1:")
    assert Path(config.profiles_dir) == PROJECT_ROOT / "profiles"
    assert Path(config.seccomp_dir) == PROJECT_ROOT / "seccomp"


def test_every_spec_key_is_accepted(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
state_dir = "/tmp/x-state"
adopt_roots = ["/srv/a", "/srv/b"]
profiles_dir = "/etc/substrate/profiles"
seccomp_dir = "/etc/substrate/seccomp"
listen = "127.0.0.1:9000"
allowed_origins = ["http://localhost:9000"]
allowed_uids = [1000, 1001]
max_request_bytes = 2048
inline_output_bytes = 100
artifact_quota_bytes = 1000000
artifact_max_age_s = 60.5
""",
    )
    config = load_config(path, {})
    assert config.state_dir == "/tmp/x-state"
    assert config.adopt_roots == ["/srv/a", "/srv/b"]
    assert config.allowed_uids == [1000, 1001]
    assert config.max_request_bytes == 2048
    assert config.artifact_max_age_s == 60.5
    assert config.effective_uids() == frozenset({1000, 1001})


def test_unknown_key_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, 'state_dir = "/tmp/s"\nadopt_root = ["/srv"]\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, {})
    assert "adopt_root" in str(info.value)
    assert str(path) in str(info.value)


def test_unknown_override_is_named() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"max_requests": 5})
    assert "max_requests" in str(info.value)
    assert "flags" in str(info.value)


def test_wrong_type_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, 'max_request_bytes = "big"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, {})
    assert "max_request_bytes" in str(info.value)


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "state_dir = \n"), {})
    assert "substrate.toml" in str(info.value)
    with pytest.raises(ConfigError):
        load_config(tmp_path / "absent.toml", {})


def test_request_limit_floor() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"max_request_bytes": 1023})
    assert "max_request_bytes" in str(info.value)
    assert load_config(None, {"max_request_bytes": 1024}).max_request_bytes == 1024


def test_connection_caps_and_idle_timeout(tmp_path: Path) -> None:
    defaults = Config()
    assert defaults.max_connections_per_uid < defaults.max_connections
    assert defaults.idle_timeout_s == 600.0
    path = write(tmp_path, "max_connections_per_uid = 8\nidle_timeout_s = 30.5\n")
    config = load_config(path, {})
    assert (config.max_connections_per_uid, config.idle_timeout_s) == (8, 30.5)
    assert defaults.max_unsent_bytes < defaults.max_unsent_bytes_per_uid
    bad_values = [("max_connections_per_uid", 0), ("idle_timeout_s", 0)]
    bad_values += [("max_unsent_bytes", 0), ("max_unsent_bytes_per_uid", 0)]
    for key, bad in bad_values:
        with pytest.raises(ConfigError) as info:
            load_config(None, {key: bad})
        assert key in str(info.value)


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'state_dir = "/tmp/from-file"\nadopt_roots = ["/srv/file"]\nlisten = "127.0.0.1:1"\n',
    )
    config = load_config(path, {"state_dir": "/tmp/from-flag", "adopt_roots": ["/srv/flag"]})
    assert config.state_dir == "/tmp/from-flag"
    assert config.adopt_roots == ["/srv/flag"]
    assert config.listen == "127.0.0.1:1"


def test_unset_flags_keep_the_file(tmp_path: Path) -> None:
    """argparse gives None for absent options and [] for absent repeated ones."""
    path = write(tmp_path, 'state_dir = "/tmp/f"\nadopt_roots = ["/srv/file"]\n')
    config = load_config(path, {"state_dir": None, "adopt_roots": [], "profiles_dir": None})
    assert config.state_dir == "/tmp/f"
    assert config.adopt_roots == ["/srv/file"]


def test_effective_uids_default_to_ours_and_root() -> None:
    assert Config(state_dir="/tmp/s").effective_uids() == frozenset({os.getuid(), 0})


def test_state_path_is_absolute(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    assert Config(state_dir="rel/state").state_path() == tmp_path / "rel" / "state"


def test_default_state_dir_sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SUBSTRATE_STATE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert default_state_dir() == tmp_path / "explicit"
    monkeypatch.delenv("SUBSTRATE_STATE_DIR")
    assert default_state_dir() == tmp_path / "xdg" / "substrate"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_state_dir() == tmp_path / "home" / ".local" / "state" / "substrate"


def test_default_state_dir_is_outside_the_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SUBSTRATE_STATE_DIR", raising=False)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    state = default_state_dir()
    assert PROJECT_ROOT not in state.parents


def test_a_command_naming_no_profile_gets_the_shipped_default() -> None:
    config = Config()
    assert config.default_profile == "default"
    assert (PROJECT_ROOT / "profiles" / f"{config.default_profile}.toml").is_file()


def test_change_set_bounds_default_and_refuse_negatives() -> None:
    config = load_config(None, {})
    assert (config.max_change_file_bytes, config.max_changeset_bytes) == (8 << 30, 32 << 30)
    for key in ("max_change_file_bytes", "max_changeset_bytes"):
        with pytest.raises(ConfigError, match=key):
            load_config(None, {key: -1})
