"""The working layer's host-side mounts on the real kernel (substrate.layer.mounts.overlay;
the plan they follow is tested in test_plan.py).

Needs root (CAP_SYS_ADMIN) and overlayfs: a failing mount fails the test, never skips it.
Every test that mounts checks at the end, by mountinfo, that it left no mount behind.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from substrate.errors import ConfinementUnmet
from substrate.layer.mounts import overlay, passthrough
from substrate.layer.mounts.mountinfo import Mount
from substrate.layer.mounts.plan import LayerPlan, layers_dir, plan
from substrate.sandbox.mounts import git_paths

# -- the mounts (real kernel) -------------------------------------------------------------


class Layer:
    """A checkout with a `.git` dir, a nested repo's `.git` dir and a worktree's `.git`
    file, its held root fd, and a state dir for the layers."""

    def __init__(self, tmp: Path) -> None:
        self.checkout = tmp / "checkout"
        self.state = tmp / "state"
        (self.checkout / ".git").mkdir(parents=True)
        (self.checkout / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
        (self.checkout / "sub" / "nested" / ".git").mkdir(parents=True)
        (self.checkout / "wt").mkdir()
        (self.checkout / "wt" / ".git").write_text("gitdir: ../.git/worktrees/wt\n")
        (self.checkout / "src.txt").write_text("original\n")
        self.state.mkdir(mode=0o700)
        self.root_fd = os.open(self.checkout, os.O_RDONLY | os.O_DIRECTORY)

    def plan(self, generation: int) -> LayerPlan:
        return plan(str(self.state), "sb1", generation, git_paths(self.root_fd))


@pytest.fixture
def layer(tmp_path: Path) -> Iterator[Layer]:
    made = Layer(tmp_path)
    try:
        yield made
    finally:
        leftover = overlay.sweep(layers_dir(str(made.state)))
        os.close(made.root_fd)
        assert not overlay.mounted_under(str(tmp_path)), "a mount was left behind"
        del leftover


def _write_errno(path: str) -> int:
    """0 when a child process can create and write `path`, else the errno."""
    return _in_child(lambda: _try_write(path))


def _try_write(path: str) -> int:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    except OSError as exc:
        return exc.errno or -1
    try:
        os.write(fd, b"x")
    except OSError as exc:
        return exc.errno or -1
    finally:
        os.close(fd)
    return 0


def _in_child(fn: Callable[[], int]) -> int:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer and leave, never back into pytest
        code = 1
        try:
            os.close(read_end)
            os.write(write_end, str(fn()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as answer:
        text = answer.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return int(text)


def _mount_at(point: str) -> Mount:
    return [m for m in overlay.read_mounts() if m.mount_point == point][-1]


def _check_readonly_parts(base: str) -> None:
    for rel in (".git/new", "sub/nested/.git/new", ".git/HEAD", "wt/.git"):
        assert _write_errno(f"{base}/{rel}") == errno.EROFS, rel


def test_generation_writes_go_to_upper_and_git_is_readonly(layer: Layer) -> None:
    p = layer.plan(1)
    overlay.prepare(p)
    overlay.mount_generation(p, layer.root_fd)

    assert _write_errno(f"{p.base}/made.txt") == 0
    with open(f"{p.base}/src.txt", "w") as f:
        f.write("changed\n")
    assert sorted(os.listdir(p.upper)) == ["made.txt", "src.txt"]
    assert (layer.checkout / "src.txt").read_text() == "original\n"
    assert not (layer.checkout / "made.txt").exists()
    _check_readonly_parts(p.base)
    assert (layer.checkout / ".git" / "HEAD").read_text() == "ref: refs/heads/main\n"
    assert (layer.checkout / "wt" / ".git").read_text() == "gitdir: ../.git/worktrees/wt\n"
    assert "ro" in _mount_at(f"{p.base}/wt/.git").super_options
    assert _mount_at(p.base).fstype == "overlay"
    assert not overlay.mounted_under(f"{p.sandbox_dir}/ro")  # staging mounts are gone

    overlay.teardown(p)
    assert not overlay.mounted_under(p.sandbox_dir)
    overlay.teardown(p)  # idempotent


def test_swap_keeps_the_old_upper_and_mounts_a_clean_one(layer: Layer) -> None:
    first = layer.plan(1)
    overlay.prepare(first)
    overlay.mount_generation(first, layer.root_fd)
    Path(first.base, "made.txt").write_text("gen 1\n")
    os.unlink(f"{first.base}/src.txt")

    second = layer.plan(2)
    overlay.swap(first, second, layer.root_fd)

    assert Path(first.upper, "made.txt").read_text() == "gen 1\n"  # for the change set
    assert sorted(os.listdir(first.upper)) == ["made.txt", "src.txt"]  # src.txt: whiteout
    assert not Path(second.base, "made.txt").exists()
    assert Path(second.base, "src.txt").read_text() == "original\n"
    assert os.listdir(second.upper) == []
    _check_readonly_parts(second.base)
    overlay.verify_generation(second)
    with pytest.raises(ConfinementUnmet):
        overlay.verify_generation(first)


def _passthrough_plan(layer: Layer, generation: int) -> LayerPlan:
    found = passthrough.existing(layer.root_fd, ["node_modules", "absent"])
    return plan(str(layer.state), "sb1", generation, git_paths(layer.root_fd), found)


def test_passthrough_writes_land_in_the_checkout_across_swaps(layer: Layer) -> None:
    (layer.checkout / "node_modules" / "pkg" / ".git").mkdir(parents=True)
    first = _passthrough_plan(layer, 1)
    assert [part.rel for part in first.passthrough] == ["node_modules"]
    overlay.prepare(first)
    overlay.mount_generation(first, layer.root_fd)

    Path(first.base, "node_modules", "x").write_text("direct\n")
    Path(first.base, "made.txt").write_text("layered\n")
    assert (layer.checkout / "node_modules" / "x").read_text() == "direct\n"
    assert not (layer.checkout / "made.txt").exists()
    # The bind hides the overlay beneath it: the upper layer shows nothing there.
    assert sorted(os.listdir(first.upper)) == ["made.txt"]
    assert _write_errno(f"{first.base}/node_modules/pkg/.git/new") == errno.EROFS
    bound = _mount_at(f"{first.base}/node_modules")
    assert not bound.read_only
    assert {"nosuid", "nodev"} <= set(bound.options)  # a set-id file there is inert
    assert overlay.mounted_under(f"{first.sandbox_dir}/pt") == []  # the staging bind went
    _check_readonly_parts(first.base)

    second = _passthrough_plan(layer, 2)
    overlay.swap(first, second, layer.root_fd)
    assert Path(second.base, "node_modules", "x").read_text() == "direct\n"
    Path(second.base, "node_modules", "y").write_text("again\n")
    assert (layer.checkout / "node_modules" / "y").read_text() == "again\n"
    assert os.listdir(second.upper) == []
    assert _write_errno(f"{second.base}/node_modules/pkg/.git/new") == errno.EROFS
    overlay.verify_generation(second)

    overlay.teardown(second)
    assert not overlay.mounted_under(second.sandbox_dir)


def test_a_replaced_passthrough_dir_is_refused_and_nothing_stays_mounted(layer: Layer) -> None:
    (layer.checkout / "node_modules").mkdir()
    p = _passthrough_plan(layer, 1)
    os.rename(layer.checkout / "node_modules", layer.checkout / "moved")
    (layer.checkout / "node_modules").mkdir()  # same name, another directory
    overlay.prepare(p)
    with pytest.raises(ConfinementUnmet):
        overlay.mount_generation(p, layer.root_fd)
    assert [m.mount_point for m in overlay.mounted_under(p.base)] == [p.base]


def test_a_generation_is_never_reused(layer: Layer) -> None:
    p = layer.plan(1)
    overlay.prepare(p)
    overlay.mount_generation(p, layer.root_fd)
    overlay.unmount_generation(p)
    with pytest.raises(ConfinementUnmet):
        overlay.mount_generation(p, layer.root_fd)
    assert [m.mount_point for m in overlay.mounted_under(p.base)] == [p.base]


def test_a_changed_readonly_part_is_refused_and_nothing_stays_mounted(layer: Layer) -> None:
    p = layer.plan(1)
    os.rename(layer.checkout / "sub" / "nested" / ".git", layer.checkout / "moved")
    (layer.checkout / "sub" / "nested" / ".git").mkdir()  # same name, another directory
    overlay.prepare(p)
    with pytest.raises(ConfinementUnmet):
        overlay.mount_generation(p, layer.root_fd)
    assert [m.mount_point for m in overlay.mounted_under(p.base)] == [p.base]


def test_a_busy_generation_is_kept_whole(layer: Layer) -> None:
    first = layer.plan(1)
    overlay.prepare(first)
    overlay.mount_generation(first, layer.root_fd)
    held = os.open(f"{first.base}/src.txt", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as caught:
            overlay.swap(first, layer.plan(2), layer.root_fd)
        assert caught.value.errno == errno.EBUSY
        overlay.verify_generation(first)
        _check_readonly_parts(first.base)
    finally:
        os.close(held)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return "(absent)"


def test_a_remount_shows_the_checkout_as_it_is_and_keeps_the_upper(layer: Layer) -> None:
    p = layer.plan(1)
    overlay.prepare(p)
    overlay.mount_generation(p, layer.root_fd)
    base, real = p.base, layer.checkout
    (real / "gone.txt").write_text("gone\n")
    assert _read(f"{base}/src.txt") == "original\n"  # looked up: the overlay holds it
    assert _read(f"{base}/gone.txt") == "gone\n"
    assert _read(f"{base}/new.txt") == "(absent)"
    with open(f"{base}/mine.txt", "w") as f:  # a write of the generation's: in its upper
        f.write("mine\n")
    # The host replaces one by rename, removes one, makes one the overlay saw missing.
    (real / ".src.swp").write_text("saved\n")
    os.rename(real / ".src.swp", real / "src.txt")
    os.unlink(real / "gone.txt")
    (real / "new.txt").write_text("new\n")
    # Undefined under the live mount (observed on Linux 6.18: all three still old).
    assert _read(f"{base}/src.txt") == "original\n"
    overlay.remount(p, p, layer.root_fd)
    assert _read(f"{base}/src.txt") == "saved\n"
    assert _read(f"{base}/gone.txt") == "(absent)"
    assert _read(f"{base}/new.txt") == "new\n"
    assert _read(f"{base}/mine.txt") == "mine\n"  # the upper is the same
    assert sorted(os.listdir(p.upper)) == ["mine.txt"]
    overlay.verify_generation(p)
    _check_readonly_parts(base)


def test_a_busy_generation_is_not_remounted_and_stays_whole(layer: Layer) -> None:
    p = layer.plan(1)
    overlay.prepare(p)
    overlay.mount_generation(p, layer.root_fd)
    held = os.open(f"{p.base}/src.txt", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as caught:
            overlay.remount(p, p, layer.root_fd)
        assert caught.value.errno == errno.EBUSY
        overlay.verify_generation(p)
        _check_readonly_parts(p.base)
    finally:
        os.close(held)
    with pytest.raises(ValueError):
        overlay.remount(p, layer.plan(2), layer.root_fd)


def test_swaps_propagate_into_an_rslave_bind_in_another_namespace(layer: Layer) -> None:
    """The trap the first layered sandboxes fell into: the container's view must get the new generation with
    its read-only parts still read-only (a `-o ro` bind would arrive read-write)."""
    first = layer.plan(1)
    overlay.prepare(first)
    inside = layer.state / "container-workspace"
    inside.mkdir()
    with _Container(first.base, str(inside)) as container:
        overlay.mount_generation(first, layer.root_fd)
        Path(first.base, "gen1.txt").write_text("1\n")
        assert container.ask("gen1.txt") == {"exists": True, "upper": first.upper, "erofs": 4}

        second = layer.plan(2)
        overlay.swap(first, second, layer.root_fd)
        assert container.ask("gen1.txt") == {"exists": False, "upper": second.upper, "erofs": 4}
        assert container.ask("written.txt", write=True)["exists"]
        assert Path(second.upper, "written.txt").exists()
        assert not (layer.checkout / "written.txt").exists()


def test_a_generation_in_use_in_the_container_is_not_swapped(layer: Layer) -> None:
    first = layer.plan(1)
    overlay.prepare(first)
    inside = layer.state / "container-workspace"
    inside.mkdir()
    with _Container(first.base, str(inside)) as container:
        overlay.mount_generation(first, layer.root_fd)
        container.ask("src.txt", hold=True)
        with pytest.raises(OSError) as caught:
            overlay.swap(first, layer.plan(2), layer.root_fd)
        assert caught.value.errno == errno.EBUSY
        overlay.verify_generation(first)
        assert container.ask("src.txt", release=True) == {
            "exists": True,
            "upper": first.upper,
            "erofs": 4,
        }
        overlay.swap(first, layer.plan(2), layer.root_fd)


class _Container:
    """A forked child in its own mount namespace (all of it a slave of ours) that binds
    the base at `target` (`rbind`, `rslave`) as the engine would, then answers queries
    about its view: does a name exist, which upper is mounted there, and how many of the
    four read-only probes fail with EROFS."""

    def __init__(self, base: str, target: str) -> None:
        self.base, self.target = base, target

    def __enter__(self) -> _Container:
        ask_r, self._ask_w = os.pipe()
        self._answer_r, answer_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                os.close(self._ask_w)
                os.close(self._answer_r)
                self._serve(ask_r, answer_w)
                code = 0
            finally:
                os._exit(code)
        os.close(ask_r)
        os.close(answer_w)
        assert self._read() == {"ready": True}
        return self

    def _serve(self, ask_r: int, answer_w: int) -> None:
        overlay.unshare_mount_namespace()
        overlay.mount(None, "/", None, overlay.MS_REC | overlay.MS_SLAVE)
        overlay.mount(self.base, self.target, None, overlay.MS_BIND | overlay.MS_REC)
        overlay.mount(None, self.target, None, overlay.MS_REC | overlay.MS_SLAVE)
        asks = os.fdopen(ask_r, "r")
        os.write(answer_w, b'{"ready": true}\n')
        held: list[int] = []
        for line in asks:
            query = json.loads(line)
            if query.get("hold"):
                held.append(os.open(f"{self.target}/{query['name']}", os.O_RDONLY))
            while query.get("release") and held:
                os.close(held.pop())
            if query["write"]:
                Path(self.target, query["name"]).write_text("from the container\n")
            top = [m for m in overlay.read_mounts() if m.mount_point == self.target][-1]
            opts = dict(o.partition("=")[::2] for o in top.super_options)
            erofs = sum(
                _try_write(f"{self.target}/{rel}") == errno.EROFS
                for rel in (".git/new", "sub/nested/.git/new", ".git/HEAD", "wt/.git")
            )
            answer = {
                "exists": os.path.exists(f"{self.target}/{query['name']}"),
                "upper": opts.get("upperdir"),
                "erofs": erofs,
            }
            os.write(answer_w, (json.dumps(answer) + "\n").encode())

    def ask(
        self, name: str, *, write: bool = False, hold: bool = False, release: bool = False
    ) -> dict[str, object]:
        query = {"name": name, "write": write, "hold": hold, "release": release}
        os.write(self._ask_w, (json.dumps(query) + "\n").encode())
        return self._read()

    def _read(self) -> dict[str, object]:
        line = b""
        while not line.endswith(b"\n"):
            chunk = os.read(self._answer_r, 4096)
            assert chunk, "the container child died"
            line += chunk
        answer: dict[str, object] = json.loads(line)
        return answer

    def __exit__(self, *exc: object) -> None:
        os.close(self._ask_w)
        _, status = os.waitpid(self.pid, 0)
        os.close(self._answer_r)
        assert os.waitstatus_to_exitcode(status) == 0


def test_sweep_unmounts_a_dead_daemons_leftovers_only(layer: Layer, tmp_path: Path) -> None:
    for sandbox in ("sb1", "sb2"):
        p = plan(str(layer.state), sandbox, 1, git_paths(layer.root_fd))
        overlay.prepare(p)
        overlay.mount_generation(p, layer.root_fd)
    outside = tmp_path / "outside"
    outside.mkdir()
    overlay.mount("tmpfs", str(outside), "tmpfs", 0, "size=1m")
    try:
        swept = overlay.sweep(layers_dir(str(layer.state)))
        assert layers_dir(str(layer.state)) in swept
        assert not overlay.mounted_under(layers_dir(str(layer.state)))
        assert [m.fstype for m in overlay.mounted_under(str(outside))] == ["tmpfs"]
        assert overlay.sweep(layers_dir(str(layer.state))) == []
    finally:
        overlay.umount(str(outside))
