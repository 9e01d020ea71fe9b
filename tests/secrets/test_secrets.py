"""`substrate.secrets.store` and `substrate secret set|list|rm` (no daemon, no Docker): files
0600 in a 0700 directory, replaced atomically, names only in listings and refusals,
every bound named, nothing followed through a symlink."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import pytest

from substrate.cli import doctor
from substrate.cli.main import main
from substrate.config import Config
from substrate.errors import InvalidParams, LimitExceeded, PathDenied, SecretUnknown, TooLarge
from substrate.secrets import MAX_VALUE_BYTES, SecretStore
from substrate.secrets import store as secret_store
from tests.harness import PACKAGE_ROOT


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_secret_is_a_0600_file_in_a_0700_dir_made_with_the_state_dir(state: Path) -> None:
    s = SecretStore(state)
    s.set("api-token", b"v1")
    assert mode(state) == 0o700 and mode(state / "secrets") == 0o700
    assert mode(state / "secrets" / "api-token") == 0o600
    assert (state / "secrets" / "api-token").read_bytes() == b"v1"
    s.set("api-token", b"v2")  # replaced whole, no temp file left
    assert sorted(os.listdir(state / "secrets")) == ["api-token"]
    assert s.load(["api-token"]) == {"api-token": "v2"}


def test_listings_and_refusals_carry_names_never_values(state: Path) -> None:
    s = SecretStore(state)
    assert s.names() == []
    s.set("b-2", b"value-b")
    s.set("A_1", b"value-a")
    (state / "secrets" / ".tmp-leftover").write_bytes(b"x")  # not a secret's name
    assert s.names() == ["A_1", "b-2"]
    with pytest.raises(SecretUnknown) as caught:
        s.load(["A_1", "nope", "gone"])
    assert caught.value.data == {"secrets": ["gone", "nope"]}
    assert "value-a" not in caught.value.message
    s.remove("b-2")
    assert s.names() == ["A_1"]
    with pytest.raises(SecretUnknown):
        s.remove("b-2")


@pytest.mark.parametrize("name", ["", ".", "..", ".x", "a/b", "a.b", "-x", "x" * 65, "é"])
def test_a_bad_name_is_invalid_params(state: Path, name: str) -> None:
    with pytest.raises(InvalidParams):
        SecretStore(state).set(name, b"v")
    assert not (state / "secrets").exists() or os.listdir(state / "secrets") == []


@pytest.mark.parametrize("value", [b"", b"a\x00b", b"\xff\xfe"])
def test_a_value_an_environment_cannot_carry_is_invalid_params(state: Path, value: bytes) -> None:
    with pytest.raises(InvalidParams) as caught:
        SecretStore(state).set("n", value)
    assert repr(value) not in caught.value.message


def test_a_value_over_the_cap_is_too_large(state: Path) -> None:
    s = SecretStore(state)
    s.set("n", b"x" * MAX_VALUE_BYTES)
    with pytest.raises(TooLarge):
        s.set("m", b"x" * (MAX_VALUE_BYTES + 1))
    # A file grown past the cap on disk is refused when loaded, not read whole.
    (state / "secrets" / "n").write_bytes(b"x" * (MAX_VALUE_BYTES + 1))
    with pytest.raises(TooLarge):
        s.load(["n"])


def test_more_secrets_than_the_cap_is_limit_exceeded(
    state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(secret_store, "MAX_SECRETS", 2)
    s = SecretStore(state)
    s.set("a", b"1")
    s.set("b", b"2")
    with pytest.raises(LimitExceeded):
        s.set("c", b"3")
    s.set("a", b"again")  # replacing one is not a new one


def test_a_symlink_is_never_followed(state: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"not a secret")
    s = SecretStore(state)
    s.set("real", b"v")
    os.symlink(outside, state / "secrets" / "linked")
    assert s.names() == ["real"]
    with pytest.raises(SecretUnknown):
        s.load(["linked"])
    # A symlinked secrets directory is refused as a whole.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    other = tmp_path / "other-state"
    other.mkdir(mode=0o700)
    os.symlink(elsewhere, other / "secrets")
    with pytest.raises(PathDenied):
        SecretStore(other).set("x", b"v")
    assert os.listdir(elsewhere) == []


def test_a_loosened_directory_is_set_back_to_0700(state: Path) -> None:
    s = SecretStore(state)
    s.set("n", b"v")
    os.chmod(state / "secrets", 0o755)
    assert s.names() == ["n"]
    assert mode(state / "secrets") == 0o700


def test_the_version_changes_when_a_value_is_set_again_or_removed(state: Path) -> None:
    s = SecretStore(state)
    assert s.version(["a"]) == (None,)
    s.set("a", b"one")
    first = s.version(["a"])
    s.set("a", b"two")
    second = s.version(["a"])
    assert None not in first and first != second
    s.remove("a")
    assert s.version(["a"]) == (None,)


class _Stdin(io.TextIOWrapper):
    def isatty(self) -> bool:
        return False


def _cli(state: Path, monkeypatch: pytest.MonkeyPatch, *args: str, stdin: bytes = b"") -> int:
    monkeypatch.setattr("sys.stdin", _Stdin(io.BytesIO(stdin)))
    return main(["--state-dir", str(state), "secret", *args])


def test_the_command_line_sets_lists_and_removes(
    state: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli(state, monkeypatch, "set", "tok", stdin=b"s3cret-value\n") == 0
    assert (state / "secrets" / "tok").read_bytes() == b"s3cret-value"  # one newline dropped
    assert _cli(state, monkeypatch, "set", "crlf", stdin=b"two\r\n\n") == 0
    assert (state / "secrets" / "crlf").read_bytes() == b"two\r\n"  # only the last one
    assert _cli(state, monkeypatch, "list") == 0
    captured = capsys.readouterr()
    assert captured.out.split() == ["crlf", "tok"]
    assert "s3cret-value" not in captured.out + captured.err
    assert _cli(state, monkeypatch, "rm", "tok") == 0
    assert _cli(state, monkeypatch, "rm", "tok") == 2
    assert "secret_unknown" in capsys.readouterr().err
    assert _cli(state, monkeypatch, "set", "bad/name", stdin=b"v") == 2
    too_big = b"x" * (MAX_VALUE_BYTES + 1) + b"\n"
    assert _cli(state, monkeypatch, "set", "big", stdin=too_big) == 2
    assert "too_large" in capsys.readouterr().err


def test_doctor_names_the_secrets_profiles_need_that_are_not_set(
    state: Path, tmp_path: Path
) -> None:
    root = PACKAGE_ROOT
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    tiny = (root / "profiles" / "tiny.toml").read_text()
    (profiles / "tok.toml").write_text(tiny.replace("secrets = {}", 'secrets = { T = "tok" }'))
    config = Config(
        state_dir=str(state), profiles_dir=str(profiles), seccomp_dir=str(root / "seccomp")
    )
    ok, detail = doctor._secrets(config)
    assert not ok and "tok: tok" in detail
    SecretStore(state).set("tok", b"value")
    ok, detail = doctor._secrets(config)
    assert ok and "value" not in detail


def test_load_sets_one_secret_per_file_of_a_mounted_kubernetes_secret(
    state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The kubelet's layout: NAME -> ..data/NAME, ..data -> ..<timestamp>/ (swapped atomically).
    mounted = tmp_path / "mounted"
    stamp = mounted / "..2026_12_02_00_00_00.1"
    stamp.mkdir(parents=True)
    (stamp / "anthropic").write_bytes(b"sk-ant-value\n")
    (stamp / "pg-password").write_bytes(b"pw")
    (mounted / "..data").symlink_to(stamp.name)
    for name in ("anthropic", "pg-password"):
        (mounted / name).symlink_to(f"..data/{name}")
    assert _cli(state, monkeypatch, "load", str(mounted)) == 0
    assert (state / "secrets" / "anthropic").read_bytes() == b"sk-ant-value"
    assert (state / "secrets" / "pg-password").read_bytes() == b"pw"
    # `..data` and the stamp directory are not secrets' names; no value is printed.
    assert sorted(p.name for p in (state / "secrets").iterdir()) == ["anthropic", "pg-password"]
    captured = capsys.readouterr()
    assert "sk-ant-value" not in captured.out + captured.err
    (stamp / "empty").write_bytes(b"")
    (mounted / "empty").symlink_to("..data/empty")
    assert _cli(state, monkeypatch, "load", str(mounted)) == 2
    assert "invalid_params" in capsys.readouterr().err
