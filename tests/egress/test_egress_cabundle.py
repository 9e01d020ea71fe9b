"""`substrate.egress.cabundle`: which bundle, read bounded, copied content-addressed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from substrate.egress import cabundle

PEM = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def test_host_means_the_systems_bundle() -> None:
    path = cabundle.bundle_path("host")
    assert path in cabundle.HOST_BUNDLES and os.path.isfile(path)
    assert cabundle.bundle_path("/etc/x.pem") == "/etc/x.pem"
    with pytest.raises(ValueError, match="absolute"):
        cabundle.bundle_path("x.pem")


def test_a_bundle_is_read_bounded_and_must_hold_a_certificate(tmp_path: Path) -> None:
    good = tmp_path / "good.pem"
    good.write_bytes(PEM)
    assert cabundle.read_bundle(str(good)) == PEM
    big = tmp_path / "big.pem"
    with big.open("wb") as f:
        f.truncate(cabundle.MAX_CA_BYTES + 1)
    with pytest.raises(ValueError, match="larger"):
        cabundle.read_bundle(str(big))
    empty = tmp_path / "empty.pem"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="no PEM"):
        cabundle.read_bundle(str(empty))
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match="not a regular file"):
        cabundle.read_bundle(str(tmp_path / "fifo"))


def test_the_copy_is_content_addressed_read_only_and_repaired(tmp_path: Path) -> None:
    files = tmp_path / "files"
    path, digest = cabundle.copy_into(files, PEM)
    assert digest == cabundle.digest(PEM) and digest.startswith("sha256:")
    assert path.name == f"ca-{digest.removeprefix('sha256:')}.crt"
    assert path.read_bytes() == PEM
    assert stat.S_IMODE(path.stat().st_mode) == 0o444
    assert stat.S_IMODE(files.stat().st_mode) == 0o700
    # Kept as is when right; rewritten when its bytes went wrong; never through a link.
    assert cabundle.copy_into(files, PEM) == (path, digest)
    path.chmod(0o644)
    path.write_bytes(b"tampered")
    assert cabundle.copy_into(files, PEM)[0].read_bytes() == PEM
    path.unlink()
    os.symlink(tmp_path / "elsewhere", path)
    assert cabundle.copy_into(files, PEM)[0].read_bytes() == PEM
    assert not path.is_symlink() and not (tmp_path / "elsewhere").exists()
    assert sorted(p.name for p in files.iterdir()) == [path.name]
