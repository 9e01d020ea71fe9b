"""The checkout's watch (substrate.layer.mounts.lower_watch): what the events mean (pure),
and the real inotify on a temporary checkout: every kind of host change is seen, in a
directory made since too, none is after `mounted` until the next change, the
passthrough dirs are not watched, a directory move or a queue overflow walks the
checkout again, and a watch that cannot be kept is degraded (every command remounts).
No engine, no mount."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from substrate.layer.mounts import lower_watch
from substrate.layer.mounts.lower_watch import (
    IN_CREATE,
    IN_DELETE,
    IN_IGNORED,
    IN_ISDIR,
    IN_MODIFY,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    IN_Q_OVERFLOW,
    Event,
    LowerWatch,
    parse_events,
    read_events,
)

# -- what the events mean (pure) ----------------------------------------------------------


def _raw(wd: int, mask: int, name: bytes = b"") -> bytes:
    padded = name + b"\0" * (-len(name) % 16 or (16 if name else 0))
    return struct.pack("iIII", wd, mask, 0, len(padded)) + padded


def test_parse_events_reads_every_event_of_a_read() -> None:
    buf = _raw(1, IN_MODIFY, b"a.txt") + _raw(2, IN_Q_OVERFLOW) + _raw(3, IN_CREATE, b"\xff")
    assert parse_events(buf) == [
        Event(1, IN_MODIFY, "a.txt"),
        Event(2, IN_Q_OVERFLOW, ""),
        Event(3, IN_CREATE, os.fsdecode(b"\xff")),
    ]


def test_read_events() -> None:
    paths = {1: "", 2: "src"}
    assert read_events([], paths) == lower_watch.Reading(False, (), False, ())
    # A dropped watch alone is no change (its removal was its parent's event).
    assert read_events([Event(2, IN_IGNORED, "")], paths).changed is False
    made = read_events(
        [Event(1, IN_CREATE | IN_ISDIR, "new"), Event(2, IN_MOVED_TO | IN_ISDIR, "in")], paths
    )
    assert (made.changed, made.new_dirs, made.rewalk) == (True, ("new", "src/in"), False)
    # A directory moved, an overflow, a new directory under an unknown watch: walk again.
    for ev in (
        Event(2, IN_MOVED_FROM | IN_ISDIR, "old"),
        Event(-1, IN_Q_OVERFLOW, ""),
        Event(9, IN_CREATE | IN_ISDIR, "x"),
    ):
        reading = read_events([ev], paths)
        assert reading.changed and reading.rewalk, ev
    # A file moved is a change, not a re-walk.
    assert read_events([Event(2, IN_MOVED_FROM, "f")], paths).rewalk is False
    # The names changed, by directory ("" the directory itself); unknown after a loss.
    named = read_events([Event(2, IN_MODIFY, "a.py"), Event(1, IN_DELETE, "x")], paths)
    assert named.names == (("src", "a.py"), ("", "x"))
    assert read_events([Event(-1, IN_Q_OVERFLOW, "")], paths).names is None
    assert read_events([Event(9, IN_MODIFY, "a")], paths).names is None


# -- the real watch -----------------------------------------------------------------------


class Checkout:
    def __init__(self, root: Path, skip: tuple[str, ...] = ()) -> None:
        self.root = root
        for rel in ("src/deep/er", ".git/refs/heads", "node_modules/pkg", "docs"):
            (root / rel).mkdir(parents=True)
        for rel in ("src/a.py", "src/deep/er/b.py", ".git/HEAD", "node_modules/pkg/i.js"):
            (root / rel).write_text("x\n")
        self.fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        self.watch = LowerWatch.open(self.fd, skip=skip)
        if self.watch.degraded is None:
            self.mounted()

    def mounted(self) -> None:
        self.watch.drain(self.fd)
        self.watch.mounted()
        assert not self.watch.pending()

    def changed(self) -> bool:
        """Does the next command get a fresh mount? (and it got one)."""
        seen = self.watch.pending() and self.watch.drain(self.fd)
        self.mounted()
        return seen


@pytest.fixture
def checkout(tmp_path: Path) -> Iterator[Checkout]:
    made = Checkout(tmp_path / "c", skip=("node_modules",))
    try:
        yield made
    finally:
        made.watch.close()
        os.close(made.fd)


def test_every_host_change_is_seen_once(checkout: Checkout) -> None:
    root = checkout.root
    assert checkout.watch.degraded is None and checkout.watch.dirs == 8
    assert not checkout.changed()  # nothing happened
    steps = [
        lambda: (root / "src/a.py").write_text("in place\n"),
        lambda: ((root / ".b").write_text("saved\n"), os.rename(root / ".b", root / "src/a.py")),
        lambda: (root / "src/deep/er/new.py").write_text("made\n"),
        lambda: (root / "src/deep/er/new.py").unlink(),
        lambda: os.chmod(root / "src/a.py", 0o755),
        lambda: os.rename(root / "src/deep", root / "docs/deep"),
        lambda: (root / "docs/deep/er/b.py").write_text("in the moved dir\n"),
        lambda: (root / ".git/HEAD").write_text("ref: refs/heads/other\n"),
        lambda: os.link(root / "src/a.py", root / "docs/link.py"),
        lambda: os.utime(root / "docs/link.py", (1, 1)),
    ]
    for i, step in enumerate(steps):
        step()
        assert checkout.changed(), i
        assert not checkout.changed(), i  # seen once: the next mount shows it


def test_the_names_changed_since_a_mount(checkout: Checkout) -> None:
    root = checkout.root
    names = checkout.watch.host_names()
    assert names is not None and names["src"] == frozenset() and "node_modules" not in names
    (root / "src/a.py").write_text("edited\n")
    (root / "src/new.py").write_text("made\n")
    os.chmod(root / "docs", 0o700)
    checkout.watch.drain(checkout.fd)
    names = checkout.watch.host_names()
    assert names is not None
    assert (names["src"], names["docs"], names[""]) == (
        frozenset({"a.py", "new.py"}),
        frozenset({""}),
        frozenset({"docs"}),
    )
    checkout.mounted()  # a new mount: counted from here
    assert checkout.watch.host_names() == dict.fromkeys(names, frozenset())
    os.rename(root / "src/deep", root / "docs/deep")  # paths go stale: not known
    checkout.watch.drain(checkout.fd)
    assert checkout.watch.host_names() is None
    checkout.mounted()
    checkout.watch.forget_names()
    assert checkout.watch.host_names() is None


def test_what_a_new_directory_holds_is_watched_before_the_next_mount(checkout: Checkout) -> None:
    root = checkout.root
    (root / "new/a/b").mkdir(parents=True)  # a whole tree before the drain sees `new`
    assert checkout.changed()
    (root / "new/a/b/f.txt").write_text("deep in it\n")
    assert checkout.changed()
    assert checkout.watch.walks == 1  # no re-walk for that: only the new tree


def test_passthrough_dirs_are_not_watched_but_their_own_names_are(checkout: Checkout) -> None:
    root = checkout.root
    (root / "node_modules/pkg/i.js").write_text("the bind shows it\n")
    (root / "node_modules/pkg/more").mkdir()
    assert not checkout.changed()
    os.rename(root / "node_modules", root / "nm")
    assert checkout.changed()


def test_a_queue_overflow_walks_the_checkout_again(checkout: Checkout) -> None:
    root = checkout.root
    limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    for i in range(limit // 2 + 10):  # two events each: past the queue
        (root / "docs" / f"t{i}").touch()
        (root / "docs" / f"t{i}").unlink()
    (root / "docs/lost").mkdir()  # its event is lost in the overflow
    assert checkout.changed()
    assert checkout.watch.walks == 2  # the re-walk found `lost`
    (root / "docs/lost/f").write_text("seen\n")
    assert checkout.changed()


def test_a_watch_that_cannot_be_kept_remounts_every_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lower_watch, "MAX_WATCHED_DIRS", 3)
    made = Checkout(tmp_path / "c")
    try:
        assert made.watch.degraded == "too_many_dirs" and made.watch.dirs == 0
        made.watch.mounted()
        assert made.watch.pending() and made.watch.drain(made.fd)
    finally:
        os.close(made.fd)


def test_a_directory_past_the_depth_bound_degrades_the_watch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lower_watch, "MAX_WATCH_DEPTH", 2)
    root = tmp_path / "c"
    (root / "a/b").mkdir(parents=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        watch = LowerWatch.open(fd)
        assert watch.degraded is None
        watch.mounted()
        (root / "a/b/c").mkdir()  # depth 3: cannot be watched
        assert watch.drain(fd) and watch.degraded == "too_deep"
        watch.mounted()
        assert watch.changed
    finally:
        os.close(fd)
