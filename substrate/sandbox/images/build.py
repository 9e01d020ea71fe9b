"""Build substrate's images with no container registry (docs/protocol.md §10).

Three images, each skipped when present and built from the same sources (a label holds
their digest), unless `force`:

- `substrate-base:bookworm`: a Debian root filesystem made by `debootstrap` (minbase plus
  python3, pytest, git, bash, coreutils, procps, ca-certificates; see `substrate.sandbox.images.rootfs`),
  streamed as a tar into the engine's import. The tree is cached under `cache_dir`, so a
  re-import costs seconds, not minutes.
- `substrate-sandbox:bookworm`: the top-level `Dockerfile` on top of the base (or on a
  registry base such as `debian:bookworm-slim`, when asked).
- `substrate-tiny:latest`: `FROM scratch` with the host's static busybox.

Everything here blocks (subprocesses, engine calls); call it from a worker thread in async
code. Subprocesses take argv lists only. Failures raise `RuntimeUnavailable` naming the
stage; nothing here prints, progress goes to the caller's callback one line at a time.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import struct
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors

from substrate.config import PROJECT_ROOT
from substrate.errors import RuntimeUnavailable
from substrate.sandbox.images import rootfs

Progress = Callable[[str], None]

BASE_TAG = "substrate-base:bookworm"
SANDBOX_TAG = "substrate-sandbox:bookworm"
TINY_TAG = "substrate-tiny:latest"
#: Image label holding the `source_digest` an image was built from.
SOURCE_LABEL = "substrate.source-sha256"
DEFAULT_CACHE_DIR = Path("/var/cache/substrate/rootfs-bookworm")
#: Where busybox-static installs its binary.
HOST_BUSYBOX = Path("/bin/busybox")
#: Which images `build_images` makes for each choice.
CHOICES = {"default": ("default",), "tiny": ("tiny",), "all": ("default", "tiny")}

_IMAGES_DIR = Path(__file__).resolve().parent
_ENGINE_TIMEOUT_S = 1800  # an import or build streams for minutes on a slow disk
_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8")


def _quiet(line: str) -> None:
    del line


# ---------------------------------------------------------------------------------------
# Public API


def build_images(
    which: str,
    force: bool,
    progress: Progress,
    *,
    base: str | None = None,
    cache_dir: Path = DEFAULT_CACHE_DIR,
    client: Any = None,
) -> None:
    """Make the images `which` names: "default" (base + sandbox), "tiny" or "all".

    `base` replaces the debootstrap base with a registry image for the sandbox. Refuses
    with `RuntimeUnavailable` when the engine does not answer or a stage fails; raises
    `ValueError` for an unknown `which`. Costs minutes on a fresh machine (debootstrap
    downloads ~40 MiB of packages), about a second when everything exists.
    """
    if which not in CHOICES:
        raise ValueError(f"which must be one of {sorted(CHOICES)}, not {which!r}")
    client = client if client is not None else engine_client()
    for name in CHOICES[which]:
        if name == "default":
            build_default(
                force=force, progress=progress, base=base, cache_dir=cache_dir, client=client
            )
        else:
            build_tiny(force=force, progress=progress, cache_dir=cache_dir, client=client)


def engine_client() -> Any:
    """A docker SDK client from the environment with long timeouts for builds.

    Refuses with `RuntimeUnavailable` when no engine answers.
    """
    client = None
    try:
        client = docker.from_env(timeout=_ENGINE_TIMEOUT_S)
        client.ping()
    except docker.errors.DockerException as exc:
        if client is not None:
            client.close()
        raise RuntimeUnavailable(
            "no Docker engine answers (run scripts/engine-up)", stage="engine"
        ) from exc
    return client


def image_present(client: Any, tag: str) -> bool:
    """Whether the engine holds an image under `tag` (never pulls)."""
    return _image(client, tag) is not None


def image_current(client: Any, tag: str, digest: str) -> bool:
    """Whether `tag` exists and was built from sources with this `source_digest`."""
    image = _image(client, tag)
    labels = (image.attrs.get("Config") or {}).get("Labels") or {} if image else {}
    return bool(labels.get(SOURCE_LABEL) == digest)


def source_digest(*parts: bytes) -> str:
    """SHA-256 over length-prefixed parts: what an image was built from."""
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(len(part).to_bytes(8, "big"))
        hasher.update(part)
    return hasher.hexdigest()


def base_digest(recipe: dict[str, Any] = rootfs.RECIPE) -> str:
    """The source digest of `substrate-base:bookworm`: its debootstrap recipe. Pure."""
    return source_digest(json.dumps(recipe, sort_keys=True).encode())


def sandbox_digest(
    dockerfile: bytes, base: str | None, recipe: dict[str, Any] = rootfs.RECIPE
) -> str:
    """The source digest of `substrate-sandbox:bookworm`: its Dockerfile and its base.
    On the debootstrap base (`base=None`) that includes the base's recipe, so a package
    added to the base (python3-venv) makes an existing sandbox image stale. Pure."""
    if base is not None:
        return source_digest(dockerfile, base.encode())
    return source_digest(dockerfile, BASE_TAG.encode(), base_digest(recipe).encode())


def build_base(
    *,
    force: bool = False,
    refresh: bool = False,
    progress: Progress = _quiet,
    cache_dir: Path = DEFAULT_CACHE_DIR,
    mirror: str | None = None,
    client: Any = None,
) -> str:
    """Make `substrate-base:bookworm` from a debootstrap root filesystem; return the tag.

    `force` re-imports from the cached root filesystem; `refresh` also re-runs
    debootstrap. `mirror` defaults to the host's Debian mirror (apt sources). Refuses with
    `RuntimeUnavailable` if debootstrap is missing or fails, or the import fails. Costs a
    few minutes fresh, ~10-20 s from the cache, nothing when the image exists.
    """
    client = client if client is not None else engine_client()
    with _build_lock(cache_dir):
        _build_base(client, force, refresh, progress, cache_dir, mirror)
    return BASE_TAG


def build_default(
    *,
    force: bool = False,
    progress: Progress = _quiet,
    base: str | None = None,
    cache_dir: Path = DEFAULT_CACHE_DIR,
    client: Any = None,
) -> str:
    """Make `substrate-sandbox:bookworm` from the sandbox Dockerfile (the checkout's
    top-level one, else the packaged copy); return the tag.

    With `base=None` the debootstrap base is made first (if missing, or re-imported when
    `force`) and the build runs with no network. A registry `base` (such as
    `debian:bookworm-slim`) is pulled by the engine and the build may use the network.
    Refuses with `RuntimeUnavailable` when a stage fails.
    """
    client = client if client is not None else engine_client()
    dockerfile = sandbox_dockerfile().read_bytes()
    digest = sandbox_digest(dockerfile, base)
    with _build_lock(cache_dir):
        if not force and image_current(client, SANDBOX_TAG, digest):
            progress(f"{SANDBOX_TAG}: present and current")
            return SANDBOX_TAG
        if base is None:
            _build_base(client, force, False, progress, cache_dir, None)
        _docker_build(
            client,
            _context_tar({"Dockerfile": dockerfile}),
            SANDBOX_TAG,
            digest,
            progress,
            buildargs={"BASE": base or BASE_TAG},
            offline=base is None,
        )
    return SANDBOX_TAG


def build_tiny(
    *,
    force: bool = False,
    progress: Progress = _quiet,
    busybox: Path = HOST_BUSYBOX,
    cache_dir: Path = DEFAULT_CACHE_DIR,
    client: Any = None,
) -> str:
    """Make `substrate-tiny:latest` (`FROM scratch` + static busybox); return the tag.

    Refuses with `RuntimeUnavailable` when `busybox` is missing or dynamically linked
    (install busybox-static), or the build fails. Costs a few seconds, no network.
    """
    client = client if client is not None else engine_client()
    try:
        binary = busybox.read_bytes()
    except OSError as exc:
        raise RuntimeUnavailable(
            f"{busybox} is missing: apt-get install busybox-static", stage="tiny"
        ) from exc
    if not is_static_elf(binary):
        raise RuntimeUnavailable(
            f"{busybox} is not statically linked: apt-get install busybox-static", stage="tiny"
        )
    files = {
        "Dockerfile": (_IMAGES_DIR / "tiny.Dockerfile").read_bytes(),
        "tiny-passwd": (_IMAGES_DIR / "tiny-passwd").read_bytes(),
        "tiny-group": (_IMAGES_DIR / "tiny-group").read_bytes(),
        "busybox": binary,
    }
    digest = source_digest(
        *(part for item in sorted(files.items()) for part in (item[0].encode(), item[1]))
    )
    with _build_lock(cache_dir):
        if not force and image_current(client, TINY_TAG, digest):
            progress(f"{TINY_TAG}: present and current")
            return TINY_TAG
        context = _context_tar(files, executable={"busybox"})
        _docker_build(client, context, TINY_TAG, digest, progress)
    return TINY_TAG


def sandbox_dockerfile() -> Path:
    """The sandbox Dockerfile: the checkout's top-level one, else the packaged copy."""
    top = PROJECT_ROOT / "Dockerfile"
    return top if top.is_file() else _IMAGES_DIR / "sandbox.Dockerfile"


def packaged_sandbox_dockerfile() -> Path:
    """The copy of the sandbox Dockerfile shipped as package data."""
    return _IMAGES_DIR / "sandbox.Dockerfile"


# ---------------------------------------------------------------------------------------
# Pure helpers


def is_static_elf(data: bytes) -> bool:
    """Whether `data` is an ELF executable with no program interpreter (PT_INTERP)."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] not in (1, 2):
        return False
    endian = "<" if data[5] == 1 else ">"
    if data[4] == 2:
        phoff = struct.unpack_from(endian + "Q", data, 32)[0]
        phentsize, phnum = struct.unpack_from(endian + "HH", data, 54)
    else:
        phoff = struct.unpack_from(endian + "I", data, 28)[0]
        phentsize, phnum = struct.unpack_from(endian + "HH", data, 42)
    if phentsize < 4 or phoff + phnum * phentsize > len(data):
        return False  # truncated: not something to trust as an executable
    for index in range(phnum):
        offset = phoff + index * phentsize
        if struct.unpack_from(endian + "I", data, offset)[0] == 3:  # PT_INTERP
            return False
    return True


def split_tag(tag: str) -> tuple[str, str]:
    """`repo:tag` → (repo, tag); no tag means "latest"."""
    repo, sep, name = tag.rpartition(":")
    if not sep or "/" in name:
        return tag, "latest"
    return repo, name


# ---------------------------------------------------------------------------------------
# The base: import a debootstrap tree (substrate.sandbox.images.rootfs makes it)


def _build_base(
    client: Any,
    force: bool,
    refresh: bool,
    progress: Progress,
    cache_dir: Path,
    mirror: str | None,
) -> None:
    digest = base_digest()
    if not (force or refresh) and image_current(client, BASE_TAG, digest):
        progress(f"{BASE_TAG}: present and current")
        return
    tree = rootfs.ensure_rootfs(cache_dir, refresh, progress, mirror)
    _import_rootfs(client, tree, BASE_TAG, digest, progress)


def _import_rootfs(client: Any, tree: Path, tag: str, digest: str, progress: Progress) -> None:
    """Stream `tree` into the engine as image `tag`, labelled with `digest`."""
    if rootfs.mounts_under(tree):
        raise RuntimeUnavailable(f"{tree} has mounts below it; unmount them", stage="import")
    repo, name = split_tag(tag)
    changes = [f"ENV {env}" for env in _ENV]
    changes += ['LABEL substrate.image="base"', f'LABEL {SOURCE_LABEL}="{digest}"', 'CMD ["bash"]']
    progress(f"import: {tree} as {tag}")
    started = time.monotonic()
    replaced = _image_id(client, tag)
    try:
        answer = client.api.import_image(
            src=rootfs.rootfs_tar(tree, progress),
            repository=repo,
            tag=name,
            changes=changes,
            stream_src=True,
        )
    except docker.errors.DockerException as exc:
        raise RuntimeUnavailable(f"importing {tag} failed", stage="import") from exc
    for line in str(answer).splitlines():
        with contextlib.suppress(ValueError):
            message = json.loads(line)
            if isinstance(message, dict) and message.get("error"):
                raise RuntimeUnavailable(
                    f"importing {tag} failed: {message['error']}", stage="import"
                )
    if not image_present(client, tag):
        raise RuntimeUnavailable(f"importing {tag} left no image", stage="import")
    _drop_replaced(client, replaced, tag, progress)
    progress(f"import: {tag} done in {time.monotonic() - started:.0f} s")


# ---------------------------------------------------------------------------------------
# Dockerfile builds


def _context_tar(
    files: dict[str, bytes], executable: frozenset[str] | set[str] = frozenset()
) -> bytes:
    """A build context holding exactly `files` (never the checkout around them)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o755 if name in executable else 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _docker_build(
    client: Any,
    context: bytes,
    tag: str,
    digest: str,
    progress: Progress,
    *,
    buildargs: dict[str, str] | None = None,
    offline: bool = True,
) -> None:
    """Build `context` as `tag`, streaming the engine's lines to `progress`."""
    progress(f"build: {tag}")
    started = time.monotonic()
    replaced = _image_id(client, tag)
    try:
        for chunk in client.api.build(
            fileobj=io.BytesIO(context),
            custom_context=True,
            tag=tag,
            buildargs=buildargs or {},
            labels={SOURCE_LABEL: digest},
            rm=True,
            forcerm=True,
            pull=False,
            decode=True,
            timeout=_ENGINE_TIMEOUT_S,
            # Offline builds get no network at all, so nothing can reach a registry.
            network_mode="none" if offline else None,
        ):
            if "error" in chunk:
                raise RuntimeUnavailable(f"building {tag} failed: {chunk['error']}", stage="build")
            text = chunk.get("stream") or chunk.get("status")
            if isinstance(text, str):
                for line in text.splitlines():
                    if line.strip():
                        progress(f"build: {line.rstrip()}")
    except docker.errors.DockerException as exc:
        raise RuntimeUnavailable(f"building {tag} failed", stage="build") from exc
    if not image_present(client, tag):
        raise RuntimeUnavailable(f"building {tag} left no image", stage="build")
    _drop_replaced(client, replaced, tag, progress)
    progress(f"build: {tag} done in {time.monotonic() - started:.0f} s")


def _image(client: Any, tag: str) -> Any:
    """The SDK image under `tag`, or None."""
    try:
        return client.images.get(tag)
    except docker.errors.ImageNotFound:
        return None
    except docker.errors.APIError as exc:
        raise RuntimeUnavailable(f"engine error looking up {tag}", stage="lookup") from exc


def _image_id(client: Any, tag: str) -> str | None:
    image = _image(client, tag)
    return None if image is None else str(image.id)


def _drop_replaced(client: Any, old_id: str | None, tag: str, progress: Progress) -> None:
    """Remove the image a rebuild untagged, so `--force` does not pile up old copies.

    An image still used by a container or another tag stays; that is not an error.
    """
    if old_id is None or old_id == _image_id(client, tag):
        return
    try:
        client.images.remove(old_id, noprune=False)
    except docker.errors.APIError:
        progress(f"{tag}: previous image {old_id[7:19]} still used by a container or image, kept")
        return
    progress(f"{tag}: previous image {old_id[7:19]} removed")


@contextlib.contextmanager
def _build_lock(cache_dir: Path) -> Iterator[None]:
    """One builder at a time per cache dir (two test sessions may both find images missing)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(cache_dir / "build.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _main(argv: list[str]) -> int:
    """`python -m substrate.sandbox.images.build [default|tiny|all] [--force]` (set-up scripts)."""
    args = [a for a in argv if a != "--force"]
    which = args[0] if args else "all"
    try:
        build_images(which, "--force" in argv, lambda line: print(line, flush=True))
    except (ValueError, RuntimeUnavailable) as exc:
        print(f"imagebuild: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
