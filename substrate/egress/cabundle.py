"""The CA bundle an egress sandbox trusts: the host's, or an operator's file.

Behind an inspecting proxy the host's system bundle trusts an authority the sandbox
image does not; a profile's `ca_bundle = "host"` (or an absolute file path) gives the
sandbox the same trust. The daemon copies the bundle's bytes, bounded, into a
content-addressed file of its own (`copy_into`), binds that read-only into the sandbox
at `CA_BUNDLE_TARGET`, and requires its digest as the `ca_bundle` confinement fact: a
host file that changes later reaches the next sandbox, never a running one, and a
symlink swapped in on the host never reaches a sandbox at all.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
from pathlib import Path

#: Where the bundle appears inside an egress sandbox.
CA_BUNDLE_TARGET = "/etc/substrate/ca-bundle.crt"
#: The host's system bundle, by distribution (the first that exists is "host").
HOST_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",  # Debian, Ubuntu, Alpine, Arch
    "/etc/pki/tls/certs/ca-bundle.crt",  # Fedora, RHEL
    "/etc/ssl/ca-bundle.pem",  # openSUSE
    "/etc/ssl/cert.pem",  # BSDs, macOS
)
#: Largest bundle accepted (a full public bundle is about 220 KiB).
MAX_CA_BYTES = 8 << 20


def bundle_path(value: str) -> str:
    """The host path a profile's `ca_bundle` names ("host" or an absolute path).
    Raises ValueError for a relative path or "host" with no system bundle found."""
    if value == "host":
        for candidate in HOST_BUNDLES:
            if os.path.isfile(candidate):
                return candidate
        raise ValueError("no system CA bundle found on this host")
    if not value.startswith("/") or "\x00" in value:
        raise ValueError(f'"host" or an absolute file path, not {value!r}')
    return value


def read_bundle(path: str) -> bytes:
    """The bytes of the bundle at `path` (a regular file of at most `MAX_CA_BYTES`; the
    operator's path may be a symlink, followed here, on the host's side only). Raises
    ValueError saying why not. Cost: one open and one bounded read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ValueError(f"cannot open {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if st.st_size > MAX_CA_BYTES:
            raise ValueError(f"{path} is larger than {MAX_CA_BYTES} bytes")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_CA_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_CA_BYTES:
        raise ValueError(f"{path} is larger than {MAX_CA_BYTES} bytes")
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise ValueError(f"{path} holds no PEM certificate")
    return data


def digest(data: bytes) -> str:
    """`sha256:<hex>` of a bundle (the `ca_bundle` fact)."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def copy_into(directory: Path, data: bytes) -> tuple[Path, str]:
    """Write `data` as `directory/ca-<sha256>.crt` (0444; written whole, then renamed;
    an existing file is kept only when its bytes hash right) and return (path, digest).
    `directory` is the daemon's own (0700, under the state dir). Blocking; one small
    read or write."""
    found = digest(data)
    target = directory / f"ca-{found.removeprefix('sha256:')}.crt"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(OSError, ValueError):
        if digest(read_bundle_nofollow(target)) == found:
            return target, found
    tmp = directory / f".{target.name}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), 0o444)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target, found


def read_bundle_nofollow(path: Path | str) -> bytes:
    """The bytes of a regular file at `path` (never through a symlink at its last
    component), at most `MAX_CA_BYTES`. Raises OSError or ValueError. Blocking."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError(f"{path} is not a regular file")
        data = f.read(MAX_CA_BYTES + 1)
    if len(data) > MAX_CA_BYTES:
        raise ValueError(f"{path} is larger than {MAX_CA_BYTES} bytes")
    return data
