"""Big files and bad input through the working layer, on the shipped `default` profile.

A file far over what the guarded path holds in memory is applied streamed, its exact
bytes in the checkout; past the configured `max_change_file_bytes` or
`max_changeset_bytes` a file is blocked `too_large` by name and stays in the layer; a
path longer than the guarded path takes is blocked `too_long` (docs/working-layer.md,
"Big files" and the scan's bounds).
"""

from __future__ import annotations

import hashlib
import tracemalloc
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from substrate.protocol.client import AsyncClient, open_client
from tests.harness.inprocess import in_process_config, owned_project, profiles_dir, serving

#: The bytes a command writes: `dd` of a pattern the host can make again.
WRITE = (
    'python3 -c \'import sys; n=int(sys.argv[2]); f=open(sys.argv[1],"wb"); '
    "[f.write(bytes([i % 251]) * (1 << 20)) for i in range(n)]' {path} {mib}"
)


def expected(mib: int) -> str:
    digest = hashlib.sha256()
    for i in range(mib):
        digest.update(bytes([i % 251]) * (1 << 20))
    return digest.hexdigest()


@dataclass
class Env:
    client: AsyncClient
    ws: str
    path: Path

    async def sh(self, script: str) -> Any:
        result = await self.client.call(
            "proc.run", workspace=self.ws, profile="default", argv=["sh", "-c", script]
        )
        assert result["exit_code"] == 0, result["stderr"]
        return result["changes"]


Opener = Callable[..., AbstractAsyncContextManager[Env]]


@pytest.fixture
def opened(sandbox_image: str, engine_state: Path, tmp_path: Path) -> Opener:
    @asynccontextmanager
    async def open_env(**config: Any) -> AsyncIterator[Env]:
        profiles = profiles_dir(tmp_path / "profiles", ["default"])
        project = owned_project(tmp_path / "roots" / "project", {"keep.txt": "kept\n"})
        conf = in_process_config(engine_state, project.parent, profiles, **config)
        async with (
            serving(conf),
            open_client(engine_state / "substrate.sock") as client,
        ):
            ws = await client.call("workspace.adopt", path=str(project))
            yield Env(client, ws["workspace"], project)

    return open_env


def _reasons(changes: dict[str, Any]) -> dict[str, str]:
    return {e["path"]: e["reason"] for e in changes.get("blocked", [])}


async def test_a_150_mb_file_lands_with_its_exact_bytes_and_is_replaced(opened: Opener) -> None:
    async with opened() as env:
        changes = await env.sh("mkdir out && " + WRITE.format(path="out/big.bin", mib=150))
        assert [e["path"] for e in changes["applied"]] == ["out", "out/big.bin"]
        assert "blocked" not in changes and "conflicts" not in changes
        big = env.path / "out" / "big.bin"
        assert big.stat().st_size == 150 << 20
        with big.open("rb") as f:
            assert hashlib.file_digest(f, "sha256").hexdigest() == expected(150)
        assert big.stat().st_uid == 1000
        # Replaced by other big bytes: bound to the big base, streamed again.
        changes = await env.sh(WRITE.format(path="out/big.bin", mib=80))
        assert [(e["path"], e["op"]) for e in changes["applied"]] == [("out/big.bin", "replace")]
        with big.open("rb") as f:
            assert hashlib.file_digest(f, "sha256").hexdigest() == expected(80)
        assert not [p for p in (env.path / "out").iterdir() if p.name != "big.bin"]


async def test_past_the_configured_bounds_files_are_too_large(opened: Opener) -> None:
    async with opened(max_change_file_bytes=3 << 20, max_changeset_bytes=7 << 20) as env:
        changes = await env.sh(
            WRITE.format(path="a.bin", mib=2)
            + " && "
            + WRITE.format(path="b.bin", mib=4)
            + " && "
            + WRITE.format(path="c.bin", mib=3)
            + " && "
            + WRITE.format(path="d.bin", mib=3)
        )
        # b is past the file bound; a and c fit the set's 7 MiB, d does not.
        assert [e["path"] for e in changes["applied"]] == ["a.bin", "c.bin"]
        assert _reasons(changes) == {"b.bin": "too_large", "d.bin": "too_large"}
        assert not (env.path / "b.bin").exists() and not (env.path / "d.bin").exists()
        assert (env.path / "a.bin").stat().st_size == 2 << 20


async def test_a_path_of_4096_bytes_is_too_long(opened: Opener) -> None:
    async with opened() as env:
        # 18 directories of 240 bytes: the 18th is past the 4,096 bytes the guarded
        # path takes (17 make 4,096 exactly).
        script = (
            'python3 -c \'import os\nfor _ in range(18):\n os.mkdir("d" * 240)\n'
            ' os.chdir("d" * 240)\nopen("f", "w").write("x")\''
        )
        changes = await env.sh(script)
        deep = _reasons(changes)
        assert list(deep.values()) == ["too_long"]
        [path] = deep
        assert len(path.encode()) > 4096 and path.count("/") == 17
        assert len(changes["applied"]) == 17  # the directories above it land


@pytest.mark.slow  # a million files made in the sandbox: minutes on a busy disk
async def test_a_million_files_are_blocked_by_the_entry_bound_in_bounded_memory(
    opened: Opener,
) -> None:
    async with opened() as env:
        make = "import os\nos.mkdir('many')\nfor i in range(1000000):\n os.close(os.open('many/%d' % i, os.O_CREAT | os.O_WRONLY))"
        script = f'python3 -c "{make}" && echo x > small.txt'
        tracemalloc.start()
        try:
            changes = await env.sh(script)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # The directory is listed up to the scan's 200,000 names, never past: what it
        # holds is blocked whole by its name (the directory itself is made); the rest of
        # the set lands.
        assert _reasons(changes) == {"many": "too_many"}
        assert [e["path"] for e in changes["applied"]] == ["many", "small.txt"]
        assert list((env.path / "many").iterdir()) == []
        # What the daemon held meanwhile (this process is the daemon): the bounded
        # listing, not a million names.
        assert peak < 96 << 20, peak
