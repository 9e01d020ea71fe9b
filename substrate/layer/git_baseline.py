"""A git layer's baseline: the refs its sandbox's view showed at the last conclusion
(docs/working-layer.md, "The git layer").

Written when the git layer is made (`mounts.git_layer`: the checkout's refs then) and
after each conclusion (`changes.git_refs`), read by the next: a ref the sandbox moved
since is one whose view differs from it. One msgpack file `baseline` in the git layer's
directory, replaced atomically. Blocking: callers use worker threads.
"""

from __future__ import annotations

import os
import stat

import msgspec

from substrate.fs import fsops

#: The baseline holds at most this many refs (every `read_refs` of a git layer too).
MAX_REFS = 100_000
#: Its file in the git layer's directory.
BASELINE = "baseline"
#: Largest baseline read (a ref name and id are well under 1 KiB each).
MAX_BASELINE_BYTES = 64 << 20
_decoder = msgspec.msgpack.Decoder(dict[str, str])
_encoder = msgspec.msgpack.Encoder()


def exists(layer_dir: str) -> bool:
    """Is there a baseline in `layer_dir` (a regular file, no symlink followed)?"""
    try:
        return stat.S_ISREG(os.lstat(f"{layer_dir}/{BASELINE}").st_mode)
    except FileNotFoundError:
        return False


def load(layer_dir: str) -> dict[str, str]:
    """The baseline ({} when it is missing or unreadable)."""
    try:
        fd = os.open(f"{layer_dir}/{BASELINE}", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    try:
        data = fsops.read_fd(fd, MAX_BASELINE_BYTES)
    finally:
        os.close(fd)
    if data is None:
        return {}
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError:
        return {}


def save(layer_dir: str, refs: dict[str, str]) -> None:
    """Replace the baseline with `refs`, atomically and durably."""
    fd = os.open(layer_dir, fsops.DIR_FLAGS)
    try:
        fsops.atomic_write(fd, BASELINE, _encoder.encode(refs), mode=0o600)
    finally:
        os.close(fd)
