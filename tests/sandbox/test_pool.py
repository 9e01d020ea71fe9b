"""The warm pool's pure parts: which profiles can be bound late, and its config's bounds
(docs/execution.md, "The warm pool"). The pool against the engine:
tests/integration/test_pool_engine.py."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from substrate.config import PROJECT_ROOT, WARM_SANDBOXES_MAX, ConfigError, load_config
from substrate.sandbox.pool import qualifies
from substrate.sandbox.profiles import load_profiles


def test_only_runc_layer_profiles_without_egress_are_pooled() -> None:
    profiles = load_profiles(PROJECT_ROOT / "profiles", PROJECT_ROOT / "seccomp")
    assert qualifies(profiles["default"]) is None
    rw = qualifies(profiles["interactive"])
    assert rw is not None and "binds the checkout at create" in rw
    layer = profiles["default"]
    assert qualifies(msgspec.structs.replace(layer, runtime="runsc")) is not None
    assert qualifies(msgspec.structs.replace(layer, network="egress")) is not None


def test_warm_sandboxes_is_a_bounded_table(tmp_path: Path) -> None:
    config = tmp_path / "substrate.toml"
    config.write_text("warm_sandboxes = {default = 2}\n")
    assert load_config(config, {}).warm_sandboxes == {"default": 2}
    config.write_text(f"warm_sandboxes = {{default = {WARM_SANDBOXES_MAX}}}\n")
    assert load_config(config, {}).warm_sandboxes == {"default": WARM_SANDBOXES_MAX}
    config.write_text(f"warm_sandboxes = {{default = {WARM_SANDBOXES_MAX + 1}}}\n")
    with pytest.raises(ConfigError, match=r"warm_sandboxes\.default: must be 0 to 128"):
        load_config(config, {})
    config.write_text("warm_sandboxes = {default = -1}\n")
    with pytest.raises(ConfigError, match=r"warm_sandboxes\.default"):
        load_config(config, {})
    assert load_config(None, {}).warm_sandboxes == {}
