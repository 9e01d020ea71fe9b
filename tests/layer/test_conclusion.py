"""`substrate.layer.conclusion` without Docker: what a conclusion does with a generation
that stays busy (the swap itself and the sweep are stand-ins here; the real ones are
exercised in tests/integration/test_layer_engine.py and test_tree_kill_engine.py)."""

from __future__ import annotations

import errno
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from substrate.layer import conclusion
from substrate.layer.conclusion import LayerSandbox, Sandboxes
from substrate.layer.generation import User, Users
from substrate.layer.mounts.working_layer import WorkingLayer
from substrate.workspace.registry import Workspace


@dataclass
class Forgetting:
    forgotten: list[str] = field(default_factory=list)

    async def forget(self, sandbox: Any, reason: str) -> None:
        self.forgotten.append(reason)


@dataclass
class Layer:
    users: Users = field(default_factory=Users)
    plan: Any = field(default_factory=lambda: type("Plan", (), {"generation": 3})())


def always_busy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []

    def swap(layer: Any, ws: Any) -> None:
        calls.append("swap")
        raise OSError(errno.EBUSY, "busy")

    async def sweep(sandbox: Any, limiter: Any) -> int:
        calls.append("sweep")
        return 0

    monkeypatch.setattr(conclusion, "_swap", swap)
    monkeypatch.setattr(conclusion, "_sweep", sweep)
    return calls


async def test_busy_once_is_carried_after_one_more_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = always_busy(monkeypatch)
    containers, layer = Forgetting(), Layer()
    with pytest.raises(OSError) as raised:
        await conclusion._swap_or_settle(
            cast(Sandboxes[Any], containers),
            cast(LayerSandbox, type("S", (), {"id": "c" * 64})()),
            cast(WorkingLayer, layer),
            cast(Workspace, None),
            None,
        )
    assert raised.value.errno == errno.EBUSY  # -> `layer_busy`, its users carried
    assert calls == ["swap", "sweep", "swap"] and containers.forgotten == []


async def test_busy_again_after_a_carry_removes_the_sandbox(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = always_busy(monkeypatch)
    containers, layer = Forgetting(), Layer()
    layer.users.carried = [User(id="p_1", actor="a", mode="apply")]  # busy before
    old = await conclusion._swap_or_settle(
        cast(Sandboxes[Any], containers),
        cast(LayerSandbox, type("S", (), {"id": "c" * 64})()),
        cast(WorkingLayer, layer),
        cast(Workspace, None),
        None,
    )
    assert old is None  # the caller concludes the generation as it is
    assert calls == ["swap", "sweep", "swap"] and containers.forgotten == ["layer_busy"]
