"""substrate.sandbox.images.rootfs without Docker or debootstrap: sources parsing, slimming, the tar stream."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from substrate.sandbox.images import rootfs

DEB822 = """\
Types: deb-src
URIs: http://src.example/debian
Suites: bookworm
Components: main

Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://mirror.example/debian/
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://security.example/debian-security
Suites: bookworm-security
Components: main
"""


def test_mirror_from_deb822_skips_sources_and_comments() -> None:
    assert rootfs.mirror_from_sources([DEB822]) == "http://mirror.example/debian"


def test_mirror_from_deb822_skips_disabled_stanzas() -> None:
    disabled = "Types: deb\nURIs: http://off.example/debian\nSuites: bookworm\nEnabled: no\n"
    assert rootfs.mirror_from_sources([disabled, DEB822]) == "http://mirror.example/debian"


def test_mirror_from_one_line_list_with_options() -> None:
    text = (
        "# deb http://commented.example/debian bookworm main\n"
        "deb-src http://src.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://opts.example/debian bookworm main\n"
    )
    assert rootfs.mirror_from_sources([text]) == "http://opts.example/debian"


def test_mirror_for_another_suite_is_none() -> None:
    assert rootfs.mirror_from_sources([DEB822], suite="trixie") is None
    assert rootfs.mirror_from_sources([]) is None


@pytest.mark.parametrize(
    ("relpath", "is_dir", "action"),
    [
        ("usr/bin/python3.11", False, "keep"),
        ("usr/share/doc/git", True, "keep"),
        ("usr/share/doc/git/copyright", False, "keep"),
        ("usr/share/doc/git/changelog.gz", False, "drop"),
        ("usr/share/man/man1/git.1.gz", False, "drop"),
        ("usr/share/locale/de/LC_MESSAGES/git.mo", False, "drop"),
        ("usr/share/locale/locale.alias", False, "keep"),
        ("var/lib/apt/lists/deb.debian.org_debian_dists_bookworm_InRelease", False, "drop"),
        ("var/cache/apt/archives/git_1_amd64.deb", False, "drop"),
        ("var/cache/apt/archives/partial", True, "keep"),
        ("dev/null", False, "drop"),
        ("etc/resolv.conf", False, "blank"),
        ("etc/hostname", False, "blank"),
        ("etc/passwd", False, "keep"),
    ],
)
def test_tar_action(relpath: str, is_dir: bool, action: str) -> None:
    assert rootfs.tar_action(relpath, is_dir) == action


def _members(tree: Path) -> dict[str, tarfile.TarInfo]:
    data = b"".join(rootfs.rootfs_tar(tree, lambda line: None))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {member.name: member for member in tar.getmembers()}


def test_rootfs_tar_keeps_links_unfollowed_and_slims(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("host file")
    tree = tmp_path / "tree"
    (tree / "usr/bin").mkdir(parents=True)
    (tree / "usr/bin/tool").write_bytes(b"#!tool\n")
    (tree / "usr/bin/tool").chmod(0o755)
    os.link(tree / "usr/bin/tool", tree / "usr/bin/tool2")
    (tree / "bin").symlink_to("usr/bin")
    (tree / "escape").symlink_to(outside)
    (tree / "etc").mkdir()
    (tree / "etc/resolv.conf").write_text("nameserver 10.0.0.1\n")
    (tree / "usr/share/doc/pkg").mkdir(parents=True)
    (tree / "usr/share/doc/pkg/README").write_text("docs")
    (tree / "usr/share/doc/pkg/copyright").write_text("licence")

    members = _members(tree)

    assert members["bin"].issym() and members["bin"].linkname == "usr/bin"
    assert members["escape"].issym()
    assert not any(name.startswith("escape/") for name in members)
    assert members["usr/bin/tool"].isreg() and members["usr/bin/tool"].mode & 0o777 == 0o755
    assert members["usr/bin/tool2"].islnk()
    assert members["etc/resolv.conf"].isreg() and members["etc/resolv.conf"].size == 0
    assert "usr/share/doc/pkg/README" not in members
    assert members["usr/share/doc/pkg/copyright"].size == len("licence")
    assert all(member.uname == "" and member.gname == "" for member in members.values())


def test_rootfs_tar_carries_file_bytes(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    payload = os.urandom(3 << 20)  # several chunks
    (tree / "blob").write_bytes(payload)
    data = b"".join(rootfs.rootfs_tar(tree, lambda line: None))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        handle = tar.extractfile("blob")
        assert handle is not None
        assert handle.read() == payload


def test_mounts_under_finds_nothing_in_a_fresh_dir(tmp_path: Path) -> None:
    assert rootfs.mounts_under(tmp_path) == []


def test_trees_of_different_recipes_live_side_by_side(tmp_path: Path) -> None:
    other = {**rootfs.RECIPE, "include": ["python3"]}
    assert rootfs.cache_slot(rootfs.RECIPE) == rootfs.cache_slot(dict(rootfs.RECIPE))
    assert rootfs.cache_slot(other) != rootfs.cache_slot(rootfs.RECIPE)
    # Another recipe's tree (and the old single slot) stay as they are; ours is used.
    for slot, recipe in (("rootfs", other), (rootfs.cache_slot(other), other)):
        (tmp_path / slot).mkdir()
        (tmp_path / f"{slot}.json").write_text(json.dumps(recipe))
    mine = tmp_path / rootfs.cache_slot(rootfs.RECIPE)
    mine.mkdir()
    (tmp_path / f"{mine.name}.json").write_text(json.dumps(rootfs.RECIPE))
    lines: list[str] = []
    assert rootfs.ensure_rootfs(tmp_path, False, lines.append, None) == mine
    assert lines == [f"rootfs: cached at {mine}"]
    assert (tmp_path / "rootfs").is_dir() and (tmp_path / rootfs.cache_slot(other)).is_dir()
