"""A Debian root filesystem made by debootstrap, cached, and streamed as a tar.

This is the registry-free base of the sandbox image (docs/protocol.md §10). `ensure_rootfs` runs
`debootstrap --variant=minbase` once into a cache dir (downloaded packages kept under
`debs/` so a refresh re-downloads nothing unchanged) and reuses the tree while its recipe
stays the same; `rootfs_tar` streams the tree for the engine's import, slimmed like
Debian's own slim images and without the host's resolv.conf or hostname.

Blocks (subprocesses, disk); argv lists only; never follows a symlink in the tree.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from substrate.errors import RuntimeUnavailable

Progress = Callable[[str], None]

SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
#: Packages debootstrap adds to minbase; the sandbox Dockerfile then needs no network.
BASE_PACKAGES = (
    "python3",
    "python3-pytest",
    # A Python project sets itself up (docs/environments.md): pip, venv (with the pip and
    # setuptools wheels ensurepip installs), and what builds pure-Python wheels offline.
    "python3-pip",
    "python3-venv",
    "python3-setuptools",
    "python3-wheel",
    "git",
    "bash",
    "coreutils",
    "procps",
    "ca-certificates",
    # What agents' projects and the agent CLIs need (docs/protocol.md §17): Node and npm
    # (both agent CLIs are npm packages), a C toolchain for native modules and wheels,
    # and the tools agents reach for.
    "nodejs",
    "gcc",
    "g++",
    "make",
    "curl",
    "ripgrep",
    "jq",
    "unzip",
)
#: Installed with apt inside the tree once debootstrap is done: debootstrap's own
#: resolver cannot configure npm's Debian dependencies (virtual packages it does not
#: follow), apt can.
APT_PACKAGES = ("npm",)
#: What the cached tree is made from; a change makes debootstrap run again.
RECIPE: dict[str, Any] = {
    "suite": SUITE,
    "variant": "minbase",
    "include": list(BASE_PACKAGES),
    "apt": list(APT_PACKAGES),
}
_CHUNK = 1 << 20  # tar bytes handed on per yield
_REPORT = 64 << 20  # progress line every this many tar bytes


def mirror_from_sources(texts: list[str], suite: str = SUITE) -> str | None:
    """The first `deb` URI serving `suite`, from deb822 `.sources` or one-line lists.

    `texts` are file contents in apt's reading order. Returns None when none fits.
    """
    for text in texts:
        for stanza in text.split("\n\n"):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line or line[:1].isspace():
                    continue
                key, _, value = line.partition(":")
                fields[key.strip().lower()] = value.strip()
            if (
                "deb" in fields.get("types", "").split()
                and suite in fields.get("suites", "").split()
                and fields.get("enabled", "yes").lower() != "no"
                and fields.get("uris")
            ):
                return fields["uris"].split()[0].rstrip("/")
        for line in text.splitlines():
            words = line.split("#", 1)[0].split()
            if len(words) >= 3 and words[0] == "deb":
                rest = words[1:]
                if rest[0].startswith("["):
                    while rest and not rest[0].endswith("]"):
                        rest = rest[1:]
                    rest = rest[1:]
                if len(rest) >= 2 and rest[1] == suite:
                    return rest[0].rstrip("/")
    return None


#: Trees whose files the base image leaves out (directories stay, apt recreates the rest);
#: the same cut as Debian's own slim images: docs, manuals, translations.
_SLIM_TREES = (
    "usr/share/doc/",
    "usr/share/man/",
    "usr/share/info/",
    "usr/share/locale/",
    "usr/share/groff/",
    "usr/share/lintian/",
    "usr/share/linda/",
    "var/lib/apt/lists/",
    "var/cache/apt/",
    "var/log/",
    "dev/",
    "proc/",
    "sys/",
    "run/",
    "tmp/",
)
#: Files the engine provides per container; the image carries empty ones, not the host's.
_BLANKED = frozenset({"etc/resolv.conf", "etc/hostname", "etc/hosts", "etc/mailname"})
#: Files kept inside the slimmed trees: the locale aliases libc reads.
_SLIM_KEEP = frozenset({"usr/share/locale/locale.alias"})


def tar_action(relpath: str, is_dir: bool) -> str:
    """What the base import does with one root-filesystem entry: keep, drop or blank."""
    if relpath in _BLANKED and not is_dir:
        return "blank"
    if is_dir or relpath in _SLIM_KEEP:
        return "keep"
    for tree in _SLIM_TREES:
        if relpath.startswith(tree):
            licence = tree == "usr/share/doc/" and relpath.rsplit("/", 1)[-1] == "copyright"
            return "keep" if licence else "drop"
    return "keep"


def cache_slot(recipe: dict[str, Any]) -> str:
    """The cache name of a recipe's tree, `rootfs-<12 hex>`: trees of different recipes
    live side by side, so checkouts with different package lists on one machine each
    keep theirs instead of re-running debootstrap in turn."""
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()
    return f"rootfs-{digest[:12]}"


def ensure_rootfs(cache_dir: Path, refresh: bool, progress: Progress, mirror: str | None) -> Path:
    """A complete debootstrap tree under `cache_dir/<cache_slot(RECIPE)>`, made if missing
    or stale.

    `refresh` re-runs debootstrap even when the cached tree fits the recipe. `mirror`
    defaults to the host's Debian mirror from its apt sources. Refuses with
    `RuntimeUnavailable` when debootstrap is missing or fails. Costs about a minute and
    a half and ~65 MiB of downloads fresh (the packages are cached), nothing when cached.
    """
    slot = cache_slot(RECIPE)
    rootfs, stamp_path = cache_dir / slot, cache_dir / f"{slot}.json"
    wanted = dict(RECIPE)
    try:
        stamp = json.loads(stamp_path.read_text())
    except (OSError, ValueError):
        stamp = None
    if (
        not refresh
        and isinstance(stamp, dict)
        and {k: stamp.get(k) for k in wanted} == wanted
        and rootfs.is_dir()
    ):
        progress(f"rootfs: cached at {rootfs}")
        return rootfs
    if shutil.which("debootstrap") is None:
        raise RuntimeUnavailable(
            "debootstrap is not installed: apt-get install debootstrap", stage="debootstrap"
        )
    mirror = mirror or mirror_from_sources(apt_sources()) or DEFAULT_MIRROR
    work, debs = cache_dir / f"{slot}.tmp", cache_dir / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    _remove_tree(work)
    argv = [
        "debootstrap",
        "--variant=minbase",
        "--include=" + ",".join(BASE_PACKAGES),
        f"--cache-dir={debs}",
        SUITE,
        str(work),
        mirror,
    ]
    progress(f"debootstrap: {SUITE} from {mirror} into {work}")
    started = time.monotonic()
    run_streaming(argv, progress, "debootstrap")
    _apt_install(work, APT_PACKAGES, progress)
    # debootstrap leaves a second copy of every package in the tree; `debs/` keeps one.
    archives = work / "var/cache/apt/archives"
    if archives.is_dir() and not archives.is_symlink():
        for deb in archives.iterdir():
            if deb.suffix == ".deb" and not deb.is_symlink() and deb.is_file():
                deb.unlink()
    # The swap is not atomic across the two renames; the stamp, written last, is what
    # makes a tree count as complete.
    stamp_path.unlink(missing_ok=True)
    _remove_tree(rootfs)
    work.rename(rootfs)
    stamp = dict(wanted, mirror=mirror, built=time.time())
    stamp_path.write_text(json.dumps(stamp, indent=2) + "\n")
    progress(f"debootstrap: done in {time.monotonic() - started:.0f} s")
    return rootfs


def _apt_install(tree: Path, packages: tuple[str, ...], progress: Progress) -> None:
    """`apt-get install` of `packages` inside the fresh tree (chroot; the host's network,
    as debootstrap's downloads), then its package lists dropped."""
    if not packages:
        return
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive",
           "LANG": "C.UTF-8"}  # fmt: skip
    chroot = ["chroot", str(tree)]
    run_streaming([*chroot, "apt-get", "update"], progress, "apt", env=env)
    install = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    run_streaming([*chroot, *install], progress, "apt", env=env)
    run_streaming([*chroot, "apt-get", "clean"], progress, "apt", env=env)
    lists = tree / "var/lib/apt/lists"
    if lists.is_dir() and not lists.is_symlink():
        for entry in lists.iterdir():
            if entry.is_file() and not entry.is_symlink():
                entry.unlink()


def apt_sources() -> list[str]:
    """The host's apt source files' contents, in apt's reading order."""
    paths = [Path("/etc/apt/sources.list")]
    with contextlib.suppress(OSError):
        paths += sorted(Path("/etc/apt/sources.list.d").iterdir())
    texts = []
    for path in paths:
        if path.suffix in (".sources", ".list") and path.is_file():
            with contextlib.suppress(OSError, UnicodeDecodeError):
                texts.append(path.read_text())
    return texts


def run_streaming(
    argv: list[str], progress: Progress, stage: str, env: dict[str, str] | None = None
) -> None:
    """Run argv, passing each output line to `progress`; refuse on a non-zero exit."""
    try:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
    except OSError as exc:
        raise RuntimeUnavailable(f"{argv[0]} could not start", stage=stage) from exc
    assert proc.stdout is not None
    with proc:
        for line in proc.stdout:
            progress(f"{stage}: {line.rstrip()}")
    if proc.returncode != 0:
        raise RuntimeUnavailable(f"{argv[0]} exited with {proc.returncode}", stage=stage)


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path` (debootstrap mounts /proc and /sys while it runs)."""
    prefix = str(path).rstrip("/") + "/"
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == prefix[:-1] or point.startswith(prefix):
                found.append(point)
    return sorted(found, key=len, reverse=True)


def _remove_tree(path: Path) -> None:
    """Delete a root filesystem tree, unmounting what a killed debootstrap left mounted."""
    if not path.exists() and not path.is_symlink():
        return
    for point in mounts_under(path):
        subprocess.run(["umount", point], check=False, stdin=subprocess.DEVNULL)
    if mounts_under(path):
        raise RuntimeUnavailable(f"{path} still has mounts; unmount them", stage="cache")
    # rmtree never follows symlinks; a symlinked `path` itself is only unlinked.
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path)


class _Sink(io.RawIOBase):
    """Collects what tarfile writes so a generator can hand it on in chunks."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.buffer += data
        return len(data)


def rootfs_tar(rootfs: Path, progress: Progress) -> Iterator[bytes]:
    """Stream `rootfs` as an uncompressed tar, numeric owners, without following links."""
    sink = _Sink()
    sent = 0
    next_report = _REPORT
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for relpath, path in _walk(rootfs):
            is_dir = path.is_dir() and not path.is_symlink()
            action = tar_action(relpath, is_dir)
            if action == "drop":
                continue
            info = tar.gettarinfo(str(path), arcname=relpath)
            if info is None:  # sockets: nothing to carry
                continue
            info.uname = info.gname = ""
            if action == "blank":
                info.type, info.size, info.linkname = tarfile.REGTYPE, 0, ""
                tar.addfile(info, io.BytesIO(b""))
            elif info.isreg():
                with open(path, "rb", opener=_nofollow) as handle:
                    tar.addfile(info, handle)
            else:
                tar.addfile(info)
            if len(sink.buffer) >= _CHUNK:
                sent += len(sink.buffer)
                yield bytes(sink.buffer)
                sink.buffer.clear()
                if sent >= next_report:
                    progress(f"import: {sent >> 20} MiB sent")
                    next_report += _REPORT
    sent += len(sink.buffer)
    yield bytes(sink.buffer)
    progress(f"import: {sent >> 20} MiB sent in all")


def _nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


def _walk(root: Path) -> Iterator[tuple[str, Path]]:
    """(relative path, path) for every entry under root, parents first, sorted."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        base = Path(dirpath)
        rel = base.relative_to(root).as_posix()
        for name in sorted(dirnames + filenames):
            yield (name if rel == "." else f"{rel}/{name}"), base / name
