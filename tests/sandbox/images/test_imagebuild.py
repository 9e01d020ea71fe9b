"""substrate.sandbox.images.build without Docker: the pure helpers and the shipped build inputs."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from substrate.sandbox.images import build as imagebuild
from substrate.sandbox.images import rootfs


def _elf64(*p_types: int) -> bytes:
    """A minimal little-endian ELF64 header followed by program headers of these types."""
    phoff, phentsize = 64, 56
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 32, phoff)
    struct.pack_into("<HH", header, 54, phentsize, len(p_types))
    body = b"".join(struct.pack("<I", p_type) + bytes(phentsize - 4) for p_type in p_types)
    return bytes(header) + body


def test_static_elf_has_no_interpreter() -> None:
    assert imagebuild.is_static_elf(_elf64(1, 1, 4))
    assert not imagebuild.is_static_elf(_elf64(6, 3, 1))  # PT_PHDR, PT_INTERP: dynamic
    assert not imagebuild.is_static_elf(b"#!/bin/sh\n" + bytes(100))
    assert not imagebuild.is_static_elf(_elf64(1, 1)[:-10])  # truncated headers


def test_host_busybox_is_static_when_installed() -> None:
    if not imagebuild.HOST_BUSYBOX.is_file():
        pytest.skip("busybox-static is not installed on this host")
    assert imagebuild.is_static_elf(imagebuild.HOST_BUSYBOX.read_bytes())


@pytest.mark.parametrize(
    ("tag", "split"),
    [
        ("substrate-base:bookworm", ("substrate-base", "bookworm")),
        ("substrate-tiny", ("substrate-tiny", "latest")),
        ("localhost:5000/x", ("localhost:5000/x", "latest")),
        ("localhost:5000/x:1", ("localhost:5000/x", "1")),
    ],
)
def test_split_tag(tag: str, split: tuple[str, str]) -> None:
    assert imagebuild.split_tag(tag) == split


def test_source_digest_separates_parts() -> None:
    assert imagebuild.source_digest(b"ab", b"c") != imagebuild.source_digest(b"a", b"bc")
    assert imagebuild.source_digest(b"x") == imagebuild.source_digest(b"x")


def test_a_new_base_package_makes_the_sandbox_image_stale() -> None:
    # A sandbox image built on a base without python3-venv must not pass as current.
    recipe = dict(rootfs.RECIPE)
    older = {**recipe, "include": [p for p in recipe["include"] if p != "python3-venv"]}
    assert imagebuild.sandbox_digest(b"FROM x", None, recipe) != imagebuild.sandbox_digest(
        b"FROM x", None, older
    )
    assert imagebuild.sandbox_digest(b"FROM x", None) == imagebuild.sandbox_digest(
        b"FROM x", None, recipe
    )
    # A registry base is named by its tag alone (the engine pulls what it names).
    assert imagebuild.sandbox_digest(b"FROM x", "debian:bookworm-slim") == (
        imagebuild.sandbox_digest(b"FROM x", "debian:bookworm-slim", older)
    )
    assert imagebuild.sandbox_digest(b"FROM y", None) != imagebuild.sandbox_digest(b"FROM x", None)


def test_build_images_rejects_unknown_choice() -> None:
    with pytest.raises(ValueError, match="which must be one of"):
        imagebuild.build_images("everything", False, lambda line: None)


def test_tiny_context_files_are_shipped() -> None:
    images = Path(imagebuild.__file__).parent
    dockerfile = (images / "tiny.Dockerfile").read_text()
    assert dockerfile.splitlines()[-1] == 'CMD ["/bin/sh"]'
    assert "FROM scratch" in dockerfile
    passwd = (images / "tiny-passwd").read_text().splitlines()
    assert "agent:x:1000:1000:agent:/home/agent:/bin/sh" in passwd
    assert "agent:x:1000:" in (images / "tiny-group").read_text().splitlines()
