"""The provider is Inspect's sandbox type `substrate`, found through its entry point."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from inspect_ai.util._sandbox.registry import registry_find_sandboxenv

from substrate.integrations.inspect import SubstrateSandboxConfig, SubstrateSandboxEnvironment
from substrate.integrations.inspect.sandbox import _config

ROOT = Path(__file__).resolve().parents[2]


def test_registered_as_sandbox_type_substrate() -> None:
    assert registry_find_sandboxenv("substrate") is SubstrateSandboxEnvironment


def test_the_entry_point_names_the_registering_module() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["inspect_ai"] == {"substrate": "substrate.integrations.inspect"}
    assert project["optional-dependencies"]["inspect"] == ["inspect_ai==0.3.285"]
    assert "inspect_ai==0.3.285" in project["optional-dependencies"]["dev"]


def test_config() -> None:
    assert _config(None) == SubstrateSandboxConfig(profile="default")
    assert _config("/src/project").checkout == "/src/project"
    made = SubstrateSandboxEnvironment.config_deserialize({"profile": "eval", "files": {"a": "b"}})
    assert made == SubstrateSandboxConfig(profile="eval", files={"a": "b"})
    with pytest.raises(ValueError, match="extra"):
        SubstrateSandboxConfig(profil="eval")  # type: ignore[call-arg]
