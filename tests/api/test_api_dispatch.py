"""The dispatcher gives each handler its group's bundle of services (`substrate.api.base`),
and refuses at once, before anything is served, a group left without one."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from substrate import api
from substrate.api import HANDLERS, services
from substrate.protocol.caller import Caller
from substrate.schema.common import Empty
from substrate.schema.pty import SessionList


async def _no_notify(method: str, params: Any) -> None:
    raise AssertionError("no notification expected")


CALLER = Caller(actor="agent", uid=1000, connection=1, notify=_no_notify)


def bundles(**given: object) -> dict[type, object]:
    """One bundle of each type in `substrate.api.services`, every service a placeholder
    but those in `given` (by bundle type name)."""
    made: dict[type, object] = {}
    for name in services.__all__:
        cls = getattr(services, name)
        made[cls] = given.get(name) or cls(**{f.name: object() for f in dataclasses.fields(cls)})
    return made


def test_every_group_of_handlers_has_a_bundle_type_and_every_bundle_a_group() -> None:
    used = {r.services for r in HANDLERS.values()}
    assert used == {getattr(services, name) for name in services.__all__}
    assert all(dataclasses.is_dataclass(t) and t.__dataclass_params__.frozen for t in used)


async def test_a_handler_is_given_its_own_groups_bundle() -> None:
    listed = SessionList(sessions=[])

    class Sessions:
        def list(self) -> object:
            return listed

    made = bundles(PtyServices=api.PtyServices(sessions=Sessions()))
    dispatch = api.dispatcher(*made.values())
    assert await dispatch("pty.list", CALLER, Empty()) is listed


def test_a_group_without_its_bundle_is_refused_before_serving() -> None:
    made = bundles()
    del made[api.PtyServices]
    with pytest.raises(RuntimeError, match="PtyServices"):
        api.dispatcher(*made.values())


def test_two_bundles_of_one_type_are_refused() -> None:
    made = list(bundles().values())
    with pytest.raises(RuntimeError, match="two service bundles"):
        api.dispatcher(*made, api.NoServices())
