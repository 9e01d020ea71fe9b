"""`substrate.workspace.homes` (no Docker): a home per checkout and uid, owned by that uid,
measured by a bounded walk and removed without following anything the sandbox left;
`workspace.info` reports it and `workspace.release {keep_home}` keeps or removes it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from substrate.workspace import homes as homes_mod
from substrate.workspace.homes import Homes, home_key
from substrate.workspace.identity import checkout_identity
from tests.harness import DaemonProcess

CHECKOUT = "2049:123456:b1733000000.000000001"


@pytest.fixture
def homes(tmp_path: Path) -> Homes:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    return Homes(state)


def test_a_home_is_made_per_checkout_and_uid_owned_by_that_uid(homes: Homes) -> None:
    home = homes.prepare(CHECKOUT, 1000, 1001)
    path = Path(home.source)
    assert path == homes.directory / home_key(CHECKOUT) / "1000"
    st = os.lstat(path)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1000, 1001, 0o700)
    assert home.identity == (st.st_dev, st.st_ino)
    for parent in (homes.directory, path.parent):
        pst = os.lstat(parent)
        assert (pst.st_uid, stat.S_IMODE(pst.st_mode)) == (os.geteuid(), 0o700)
    assert homes.prepare(CHECKOUT, 1000, 1001) == home  # found again, not made again
    other_uid = homes.prepare(CHECKOUT, 2000, 2000)
    other_checkout = homes.prepare("2049:7:b1.000000002", 1000, 1000)
    assert len({home.source, other_uid.source, other_checkout.source}) == 3


def test_a_symlink_planted_in_the_path_is_refused(homes: Homes, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    homes.directory.mkdir(mode=0o700)
    os.symlink(elsewhere, homes.directory / home_key(CHECKOUT))
    with pytest.raises(OSError):
        homes.prepare(CHECKOUT, 1000, 1000)
    assert os.listdir(elsewhere) == []


def test_usage_counts_files_once_and_never_follows_a_symlink(homes: Homes, tmp_path: Path) -> None:
    assert homes.usage(CHECKOUT) is None
    root = Path(homes.prepare(CHECKOUT, 1000, 1000).source)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 100_000)
    (root / "a").write_bytes(b"12345")
    (root / "d" / "e").mkdir(parents=True)
    (root / "d" / "e" / "b").write_bytes(b"123")
    os.link(root / "a", root / "d" / "hard")  # the same file twice: counted once
    os.symlink(big, root / "link")  # its own size, not the target's
    os.symlink(tmp_path, root / "dirlink")  # never entered
    usage = homes.usage(CHECKOUT)
    assert usage is not None
    link_sizes = os.lstat(root / "link").st_size + os.lstat(root / "dirlink").st_size
    assert (usage.files, usage.bytes, usage.truncated) == (4, 5 + 3 + link_sizes, False)


def test_usage_past_its_bound_says_truncated(homes: Homes, monkeypatch: pytest.MonkeyPatch) -> None:
    root = Path(homes.prepare(CHECKOUT, 1000, 1000).source)
    for i in range(20):
        (root / f"f{i}").write_bytes(b"x")
    monkeypatch.setattr(homes_mod, "MAX_USAGE_ENTRIES", 10)
    usage = homes.usage(CHECKOUT)
    assert usage is not None and usage.truncated and usage.files <= 10
    monkeypatch.setattr(homes_mod, "MAX_USAGE_ENTRIES", 1000)
    deep = root
    for _ in range(5):
        deep = deep / "d"
        deep.mkdir()
    monkeypatch.setattr(homes_mod, "MAX_USAGE_DEPTH", 3)
    usage = homes.usage(CHECKOUT)
    assert usage is not None and usage.truncated


def test_remove_takes_the_home_and_nothing_it_points_to(homes: Homes, tmp_path: Path) -> None:
    assert homes.remove(CHECKOUT) is False
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "precious").write_text("keep\n")
    root = Path(homes.prepare(CHECKOUT, 1000, 1000).source)
    other = Path(homes.prepare("1:2:b1.000000003", 1000, 1000).source)
    (root / "venv" / "lib").mkdir(parents=True)
    (root / "venv" / "lib" / "x.py").write_text("x\n")
    os.symlink(outside, root / "to-outside")
    os.symlink(outside / "sub" / "precious", root / "venv" / "file-link")
    assert homes.remove(CHECKOUT) is True
    assert not (homes.directory / home_key(CHECKOUT)).exists()
    assert (outside / "sub" / "precious").read_text() == "keep\n"
    assert other.is_dir()  # another checkout's home is untouched
    assert homes.usage(CHECKOUT) is None


def test_info_reports_the_home_and_release_keeps_it_unless_told(
    daemon: DaemonProcess, workspace_dir: Path
) -> None:
    """Through a real daemon (no engine needed: the test makes the home a sandbox would)."""
    c = daemon.client()
    ws = daemon.adopt(workspace_dir)
    assert "home" not in c.call("workspace.info", workspace=ws)  # no sandbox yet: none
    fd = os.open(workspace_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        key = checkout_identity(fd).key
    finally:
        os.close(fd)
    home = Path(Homes(daemon.state_dir).prepare(key, 1000, 1000).source)
    (home / "note").write_bytes(b"x" * 10)
    info = c.call("workspace.info", workspace=ws)
    assert info["home"] == {"bytes": 10, "files": 1, "truncated": False}
    assert "home" not in c.call("workspace.list")["workspaces"][0]  # info only: it walks
    assert c.call("workspace.release", workspace=ws) == {
        "workspace": ws,
        "released": True,
        "home": "kept",
        "git": "kept",  # the git layer is kept too unless `keep_git: false`
    }
    ws = daemon.adopt(workspace_dir)  # the same checkout again: the same home
    assert c.call("workspace.info", workspace=ws)["home"]["bytes"] == 10
    released = c.call("workspace.release", workspace=ws, keep_home=False)
    assert released["home"] == "removed" and not home.exists()
    (entry,) = daemon.journal({"workspace.home_removed"})
    assert entry["workspace"] == ws and entry["data"] == {"root_id": info["root_id"]}
    ws = daemon.adopt(workspace_dir)
    assert c.call("workspace.release", workspace=ws, keep_home=False)["home"] == "none"


def test_remove_leaves_alone_what_it_did_not_make(homes: Homes) -> None:
    homes.directory.mkdir(mode=0o700)
    planted = homes.directory / home_key(CHECKOUT)
    planted.write_text("not a home\n")
    with pytest.raises(OSError):
        homes.remove(CHECKOUT)
    assert planted.read_text() == "not a home\n"


def test_a_home_per_secret_set(homes: Homes) -> None:
    assert homes_mod.secret_set({}) is None
    one = homes_mod.secret_set({"API_KEY": "api-key"})
    assert one == homes_mod.secret_set({"API_KEY": "api-key"})
    assert one is not None and len(one) == 32
    assert homes_mod.secret_set({"API_KEY": "other"}) != one  # another secret
    assert homes_mod.secret_set({"KEY": "api-key"}) != one  # the same one elsewhere
    two = {"A": "a", "B": "b"}
    assert homes_mod.secret_set(two) == homes_mod.secret_set(dict(reversed(two.items())))
    plain = homes.prepare(CHECKOUT, 1000, 1000)
    secret = homes.prepare(CHECKOUT, 1000, 1000, one)
    assert (plain.name, secret.name) == ("1000", f"1000-{one}")
    assert Path(secret.source).parent == Path(plain.source).parent
    assert secret.identity != plain.identity
    (Path(plain.source) / "a").write_bytes(b"12")
    (Path(secret.source) / "b").write_bytes(b"123")
    every = homes.usage(CHECKOUT)
    assert every is not None and (every.files, every.bytes) == (2, 5)  # all of them
    only = homes.usage(CHECKOUT, secret.name)
    assert only is not None and (only.files, only.bytes) == (1, 3)
    assert homes.remove(CHECKOUT) is True
    assert not Path(secret.source).exists() and not Path(plain.source).exists()


def test_claim_legacy_moves_an_old_home_once_and_never_merges(homes: Homes) -> None:
    assert homes.claim_legacy("2049:9", "2049:9:b1.000000001") == "none"
    old = homes.directory / "2049-9" / "1000"
    old.mkdir(parents=True)
    (old / "note").write_text("old\n")
    assert homes.claim_legacy("2049:9", "2049:9:b1.000000001") == "moved"
    assert not old.parent.exists()
    assert (Path(homes.prepare("2049:9:b1.000000001", 1000, 1000).source) / "note").exists()
    old.mkdir(parents=True)  # another old home of the same inode: the claimed one stays
    assert homes.claim_legacy("2049:9", "2049:9:b1.000000001") == "kept"
    assert old.is_dir()
    assert sorted(os.listdir(homes.directory)) == ["2049-9", "2049-9-b1.000000001"]


def test_usage_within_a_callers_bound(homes: Homes) -> None:
    root = Path(homes.prepare(CHECKOUT, 1000, 1000).source)
    for i in range(20):
        (root / f"f{i}").write_bytes(b"x")
    bounded = homes.usage(CHECKOUT, max_entries=5)
    assert bounded is not None and bounded.truncated and bounded.files <= 5
    whole = homes.usage(CHECKOUT, max_entries=50)
    assert whole is not None and not whole.truncated and whole.files >= 20
