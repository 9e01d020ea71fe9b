"""substrate.layer.changes.reclaim: a settled layer is gone at once (renamed aside) and
removed by a background thread; what a crash left renamed aside goes at the next start."""

from __future__ import annotations

import os
from pathlib import Path

from substrate.layer.changes.reclaim import RECLAIM_PREFIX, Reclaimer, sweep
from substrate.layer.recovery import drop_unconcluded


def _layer(root: Path, files: int) -> Path:
    d = root / "sub"
    d.mkdir(parents=True)
    for i in range(files):
        (d / f"f{i}").write_bytes(b"x")
    os.symlink("/etc/passwd", root / "link")  # removed, never followed
    return root


def test_removed_dirs_are_gone_at_once_and_removed_in_the_background(tmp_path: Path) -> None:
    upper = _layer(tmp_path / "upper" / "3", 50)
    work = _layer(tmp_path / "work" / "3", 2)
    reclaimer = Reclaimer()
    reclaimer.remove(str(upper), str(work), str(tmp_path / "absent"))
    assert not upper.exists() and not work.exists()
    assert reclaimer.wait_idle(60)
    assert os.listdir(tmp_path / "upper") == [] and os.listdir(tmp_path / "work") == []
    assert Path("/etc/passwd").exists()


def test_what_a_crash_left_aside_is_swept_at_start(tmp_path: Path) -> None:
    sandbox = tmp_path / "layers" / "sb"
    _layer(sandbox / "upper" / f"{RECLAIM_PREFIX}3-abc", 3)
    _layer(sandbox / "work" / f"{RECLAIM_PREFIX}3-abc", 1)
    (sandbox / "upper" / "keep-me").mkdir()  # not a reclaimer's name: never touched
    assert sweep(str(sandbox / "upper")) == 1

    class NoSets:
        def uppers(self) -> set[str]:
            return set()

    _layer(sandbox / "work" / f"{RECLAIM_PREFIX}4-def", 1)
    drop_unconcluded(NoSets(), None, [str(sandbox)])  # type: ignore[arg-type]
    assert sorted(os.listdir(sandbox / "upper")) == ["keep-me"]
    assert os.listdir(sandbox / "work") == []
