"""The `substrate` sandbox's sample lifecycle: a fresh checkout per sample from the
config (a checkout copied, files placed), released and removed at cleanup."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from substrate.integrations.inspect import SubstrateSandboxConfig, SubstrateSandboxEnvironment
from tests.harness import DaemonProcess


async def test_a_sample_gets_its_own_checkout_and_leaves_nothing(
    engine_daemons: Callable[..., DaemonProcess], sandbox_image: str, tmp_path: Path
) -> None:
    daemon = engine_daemons()
    source = tmp_path / "project"
    (source / "src").mkdir(parents=True)
    (source / "src" / "app.py").write_text("print('app')\n")
    config = SubstrateSandboxConfig(
        state_dir=str(daemon.state_dir), checkout=str(source), files={"notes/task.md": "do it\n"}
    )
    first = await SubstrateSandboxEnvironment.sample_init("lifecycle", config, {})
    second = await SubstrateSandboxEnvironment.sample_init("lifecycle", config, {})
    one, two = first["default"], second["default"]
    assert isinstance(one, SubstrateSandboxEnvironment)
    assert isinstance(two, SubstrateSandboxEnvironment)
    assert one.checkout != two.checkout and one.workspace != two.workspace
    assert one.checkout.parent == daemon.adopt_root
    listing = await one.exec(["find", ".", "-type", "f", "-not", "-path", "./.git/*"])
    assert sorted(listing.stdout.split()) == ["./notes/task.md", "./src/app.py"]
    # A sample's changes are its own: the other sample's checkout does not see them.
    await one.write_file("src/app.py", "print('changed')\n")
    assert await two.read_file("src/app.py") == "print('app')\n"
    assert (source / "src" / "app.py").read_text() == "print('app')\n"
    # A timeout above the profile's is lowered to it, not refused.
    assert (await one.exec(["true"], timeout=10**6)).success
    await SubstrateSandboxEnvironment.sample_cleanup("lifecycle", config, first, False)
    await SubstrateSandboxEnvironment.sample_cleanup("lifecycle", config, second, False)
    assert not one.checkout.exists() and not two.checkout.exists()
    released = {e["workspace"] for e in daemon.journal({"workspace.released"})}
    assert {one.workspace, two.workspace} <= released
