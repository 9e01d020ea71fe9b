"""A daemon killed with SIGKILL while a `workspace = "layer"` command runs, then restarted.

The command wrote into its layer (create, replace, delete of checkout files) and was
still running: it never concluded, so none of it may land. The checkout is untouched
both while the daemon is dead and after the restart; the restart reaps the dead run's
container, sweeps its mounts and drops the generation whole, journaled
`changes.recovered {outcome: "dropped"}`.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from substrate.config import PROJECT_ROOT
from substrate.layer.mounts.overlay import mounted_under
from substrate.sandbox.containers import LABEL_DAEMON, daemon_id_for
from substrate.workspace.writes import TEMP_PREFIX
from tests.harness import wait_until
from tests.harness.engine import remove_daemon_containers, sweep_mounts

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

FILES = {"a.txt": "before a\n", "c.txt": "keep c\n", "src/app.py": "print('hi')\n"}
SCRIPT = "echo new > a.txt; echo x > b.txt; rm c.txt; rm src/app.py; touch m; sleep 300"


def _labelled(docker_client: Any, state: Path) -> list[str]:
    found = docker_client.api.containers(
        all=True, filters={"label": f"{LABEL_DAEMON}={daemon_id_for(state)}"}
    )
    return [str(c["Id"]) for c in found]


def _mounts_under(state: Path) -> list[str]:
    """Mount points at or beneath `state`, read from /proc/self/mountinfo."""
    return [m.mount_point for m in mounted_under(str(state))]


def _checkout(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


@pytest.fixture
def layer_daemon(
    daemon_factory: Callable[..., DaemonProcess],
    docker_client: Any,
    tiny_image: str,
    tmp_path: Path,
) -> Iterator[DaemonProcess]:
    """A daemon whose profiles dir has `layer` (tiny with `workspace = "layer"`). At the
    end, even on failure: the daemon is killed, its containers removed and every mount
    under its state dir undone before the factory removes its directory."""
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    tiny = (PROJECT_ROOT / "profiles" / "tiny.toml").read_text()
    shutil.copy(PROJECT_ROOT / "profiles" / "tiny.toml", profiles / "tiny.toml")
    (profiles / "layer.toml").write_text(tiny.replace('workspace = "rw"', 'workspace = "layer"'))
    d = daemon_factory(profiles_dir=str(profiles))
    try:
        yield d
    finally:
        d.close()
        remove_daemon_containers(docker_client, d.state_dir)
        sweep_mounts(d.state_dir)


def test_kill_9_mid_command_drops_the_generation_and_leaves_the_checkout(
    layer_daemon: DaemonProcess, docker_client: Any
) -> None:
    d = layer_daemon
    path = d.make_workspace(files=FILES)
    before = _checkout(path)
    ws = d.adopt(path)
    c = d.client()
    proc = c.call("proc.start", workspace=ws, profile="layer", argv=["sh", "-c", SCRIPT])["proc"]

    # `m` is written last: once the host sees it in the upper dir, every write is there.
    def upper_markers() -> list[Path]:
        return sorted(d.state_dir.glob("layers/*/upper/*/m"))

    wait_until(lambda: bool(upper_markers()), 60, interval=0.05, message="no write in the layer")
    (marker,) = upper_markers()
    generation_upper = marker.parent
    assert (generation_upper / "a.txt").read_bytes() == b"new\n"
    assert (generation_upper / "b.txt").read_bytes() == b"x\n"
    assert c.call("proc.status", proc=proc)["state"] == "running"
    assert _labelled(docker_client, d.state_dir)

    d.kill()
    # Dead daemon, command killed mid-way: the checkout was never written.
    assert _checkout(path) == before
    assert not (path / "b.txt").exists()

    d.start()
    wait_until(
        lambda: not _labelled(docker_client, d.state_dir),
        60,
        interval=0.2,
        message="the dead daemon's container was not reaped",
    )
    assert _checkout(path) == before
    assert (path / "a.txt").read_bytes() == b"before a\n"
    assert (path / "c.txt").read_bytes() == b"keep c\n"
    assert not (path / "b.txt").exists()

    recovered = [e["data"] for e in d.journal({"changes.recovered"})]
    assert recovered == [
        {"layer": generation_upper.parent.parent.name, "generation": 0, "outcome": "dropped"}
    ]
    assert not generation_upper.exists()  # dropped whole, not kept as a discarded set
    assert d.client().call("proc.status", proc=proc)["state"] == "lost"
    assert d.verify_journal()["ok"] is True
    assert _mounts_under(d.state_dir) == []


BIG = 40 << 20  # streamed (over `STREAM_BYTES`), and long enough to be caught mid-apply
BIG_NAMES = [f"b{i}.bin" for i in range(5)]


def _digest(path: Path) -> str | None:
    if not path.is_file():
        return None
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _pattern(word: str) -> bytes:
    return ((word + "\n").encode() * (BIG // (len(word) + 1) + 1))[:BIG]


def test_kill_9_mid_apply_of_big_files_leaves_each_whole_and_recovers_the_set(
    layer_daemon: DaemonProcess, docker_client: Any
) -> None:
    d = layer_daemon
    old = {name: _pattern(f"old {name}") for name in BIG_NAMES}
    new = {name: _pattern(f"n{i}") for i, name in enumerate(BIG_NAMES)}
    new["fresh.bin"] = _pattern("fresh")
    digests = {
        name: {hashlib.sha256(old[name]).hexdigest() if name in old else None}
        | {hashlib.sha256(data).hexdigest()}
        for name, data in new.items()
    }
    path = d.make_workspace(files=old)
    ws = d.adopt(path)
    script = "; ".join(
        f"yes {'fresh' if name == 'fresh.bin' else f'n{i}'} | head -c {BIG} > {name}"
        for i, name in enumerate([*BIG_NAMES, "fresh.bin"])
    )
    c = d.client()
    c.call("proc.start", workspace=ws, profile="layer", argv=["sh", "-c", script])

    def mid_apply() -> bool:  # a temp file beside a target: the set is being applied
        return any(p.name.startswith(TEMP_PREFIX) for p in path.iterdir())

    wait_until(mid_apply, 120, interval=0.005, message="the apply never began")
    d.kill()
    # Dead mid-apply: every file holds its old bytes or its new ones, never a mix.
    for name in new:
        assert _digest(path / name) in digests[name], name

    d.start()
    # The set was applied whole at the start: every file new, no temp file left.
    for name, data in new.items():
        assert _digest(path / name) == hashlib.sha256(data).hexdigest(), name
    assert not [p.name for p in path.iterdir() if p.name.startswith(TEMP_PREFIX)]
    applied = [e["data"]["path"].split(":", 1)[1] for e in d.journal({"changes.apply"})]
    assert sorted(applied) == sorted(new)  # each journaled exactly once
    recovered = [e["data"] for e in d.journal({"changes.recovered"})]
    assert [r.get("outcome") for r in recovered] == ["applied"]
    assert d.verify_journal()["ok"] is True
