"""Each checkout's git layer under the state dir: made, held by one sandbox at a time,
measured and removed (`git_layer.GitLayers`; docs/working-layer.md, "The git layer")."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from substrate.layer import git_baseline
from substrate.layer.mounts.git_layer import GitLayers

OID = "a" * 40


@pytest.fixture
def checkout(tmp_path: Path) -> Iterator[int]:
    root = tmp_path / "checkout"
    (root / ".git" / "refs" / "heads").mkdir(parents=True)
    (root / ".git" / "refs" / "heads" / "main").write_text(OID + "\n")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def test_a_checkout_has_one_git_layer_held_by_one_sandbox_at_a_time(
    tmp_path: Path, checkout: int
) -> None:
    (tmp_path / "state").mkdir()
    layers = GitLayers(str(tmp_path / "state"))
    outcome, claim = layers.claim("1:2:3", checkout)
    assert outcome == "mounted" and claim is not None
    assert claim.part.upper == f"{tmp_path}/state/gitlayers/1-2-3/upper"
    assert git_baseline.load(claim.dir).refs == {"refs/heads/main": OID}
    assert layers.claim("1:2:3", checkout) == ("held", None)
    with pytest.raises(OSError) as refused:
        layers.remove("1:2:3")
    assert refused.value.errno == errno.EBUSY
    layers.release(claim.part)
    again, second = layers.claim("1:2:3", checkout)
    assert again == "mounted" and second is not None and second.part.upper == claim.part.upper
    layers.release(second.part)
    (Path(claim.part.upper) / "HEAD").write_text("ref: refs/heads/agent/x\n")
    assert layers.usage("1:2:3") == len("ref: refs/heads/agent/x\n") + os.path.getsize(
        f"{claim.dir}/baseline"
    ) + os.path.getsize(f"{claim.dir}/stamp")
    assert layers.remove("1:2:3") is True
    assert layers.usage("1:2:3") is None and layers.remove("1:2:3") is False


def test_a_git_file_or_symlink_gets_none(tmp_path: Path) -> None:
    layers = GitLayers(str(tmp_path / "state"))
    for name, make in (
        ("gitfile", lambda p: p.write_text("gitdir: elsewhere\n")),
        ("not_a_directory", lambda p: p.symlink_to(tmp_path)),
        ("absent", lambda p: None),
    ):
        root = tmp_path / name
        root.mkdir()
        make(root / ".git")
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert layers.claim(name, fd) == (name, None)
        finally:
            os.close(fd)
    assert not (tmp_path / "state" / "gitlayers").exists()
