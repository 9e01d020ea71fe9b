"""Real git repositories for the tests of `substrate.git`, made by the host's `git`.

The test acts as a person here: it runs `git` in directories it made itself, with
hooks off (`core.hooksPath=/dev/null`), no system or global configuration, and fixed
identities and dates, so every run makes the same objects. Also: a pack written by hand
with dulwich (for the packs git would never write: delta loops, chains too deep).
"""

from __future__ import annotations

import binascii
import hashlib
import io
import os
import subprocess
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from dulwich.object_format import SHA1
from dulwich.pack import create_delta, pack_object_header, write_pack_index_v2

GIT_CONFIG = (
    "-c",
    "core.hooksPath=/dev/null",
    "-c",
    "init.defaultBranch=main",
    "-c",
    "gc.auto=0",
    "-c",
    "core.fsmonitor=false",
)


class Repo:
    """A repository at `path` (its work tree), driven by the host's `git`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._when = 1_700_000_000

    @classmethod
    def init(cls, path: Path) -> Repo:
        path.mkdir(parents=True)
        repo = cls(path)
        repo.git("init", "-q")
        return repo

    @property
    def git_dir(self) -> Path:
        return self.path / ".git"

    @property
    def objects(self) -> Path:
        return self.git_dir / "objects"

    def git(self, *args: str, check: bool = True, stdin: bytes | None = None) -> str:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.path.parent),
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": "/dev/null",
            "GIT_AUTHOR_NAME": "Person",
            "GIT_AUTHOR_EMAIL": "person@example.com",
            "GIT_COMMITTER_NAME": "Person",
            "GIT_COMMITTER_EMAIL": "person@example.com",
            "GIT_AUTHOR_DATE": f"{self._when} +0000",
            "GIT_COMMITTER_DATE": f"{self._when} +0000",
        }
        done = subprocess.run(
            ["git", *GIT_CONFIG, *args],
            cwd=self.path,
            env=env,
            input=stdin,
            capture_output=True,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"git {args}: {done.stderr.decode()}")
        return done.stdout.decode() + (done.stderr.decode() if not check else "")

    def commit(self, files: dict[str, str], message: str) -> str:
        """Write `files`, commit them all, and return the new commit's id."""
        for name, text in files.items():
            target = self.path / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        self.git("add", "-A")
        self.git("commit", "-q", "--allow-empty", "-m", message)
        self._when += 60
        return self.rev("HEAD")

    def rev(self, spec: str) -> str:
        return self.git("rev-parse", spec).strip()

    def object_ids(self) -> set[str]:
        """Every object the repository holds, loose or packed."""
        out = self.git("cat-file", "--batch-all-objects", "--batch-check=%(objectname)")
        return set(out.split())

    def fsck(self) -> subprocess.CompletedProcess[str]:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_CONFIG_NOSYSTEM": "1"}
        return subprocess.run(
            ["git", *GIT_CONFIG, "fsck", "--full", "--no-dangling"],
            cwd=self.path,
            env={**env, "GIT_CONFIG_GLOBAL": "/dev/null", "HOME": str(self.path.parent)},
            capture_output=True,
            text=True,
            check=False,
        )

    def loose_path(self, oid: str) -> Path:
        return self.objects / oid[:2] / oid[2:]

    def packs(self) -> list[Path]:
        return sorted((self.objects / "pack").glob("pack-*.pack"))


def history(repo: Repo, commits: int, *, size: int = 4000) -> list[str]:
    """`commits` commits each appending a line to one large file (git deltifies it)."""
    ids = []
    body = "".join(
        f"line {i} of a file big enough to be worth a delta\n" for i in range(size // 50)
    )
    for i in range(commits):
        body += f"change {i}\n"
        ids.append(repo.commit({"big.txt": body, f"small/{i}.txt": f"{i}\n"}, f"commit {i}"))
    return ids


@contextmanager
def dir_fd(path: Path) -> Iterator[int]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        yield fd
    finally:
        os.close(fd)


def loose_bytes(type_name: bytes, content: bytes) -> tuple[str, bytes]:
    """(id, file bytes) of a loose object as git writes it."""
    raw = type_name + b" " + str(len(content)).encode() + b"\0" + content
    return hashlib.sha1(raw).hexdigest(), zlib.compress(raw)


def blob_id(content: bytes) -> bytes:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).digest()


#: An entry of a hand-made pack: a whole blob (its content), or a REF_DELTA: (the id
#: the index claims for it, the base's id, the delta's bytes).
Entry = bytes | tuple[bytes, bytes, bytes]


def hand_pack(dest: Path, entries: Sequence[Entry]) -> str:
    """Write the pack of `entries` and its v2 index into the directory `dest`; returns
    the pack's name (`pack-<checksum>`). The index gives each entry the id claimed."""
    out = io.BytesIO()
    out.write(b"PACK" + (2).to_bytes(4, "big") + len(entries).to_bytes(4, "big"))
    rows = []
    for entry in entries:
        offset = out.tell()
        if isinstance(entry, bytes):
            raw = bytes(pack_object_header(3, None, len(entry), SHA1)) + zlib.compress(entry)
            claimed = blob_id(entry)
        else:
            claimed, base, delta = entry
            raw = bytes(pack_object_header(7, base, len(delta), SHA1)) + zlib.compress(delta)
        out.write(raw)
        rows.append((claimed, offset, binascii.crc32(raw)))
    body = out.getvalue()
    checksum = hashlib.sha1(body).digest()
    name = f"pack-{checksum.hex()}"
    dest.mkdir(parents=True, exist_ok=True)
    (dest / f"{name}.pack").write_bytes(body + checksum)
    with (dest / f"{name}.idx").open("wb") as idx:
        write_pack_index_v2(idx, sorted(rows), checksum)
    return name


def delta(base: bytes, target: bytes) -> bytes:
    return b"".join(create_delta(base, target))
