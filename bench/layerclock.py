"""`python -m bench.layerclock <substrate arguments>`: the `substrate` command line with
the working layer's own part of each command timed, for bench/layer.py --fresh-view.

Wraps `LayerUsers.join` and `LayerUsers.end` (substrate/layer/users.py: the fresh
view's check, the generation's accounting and the conclusion, the git layer's
included) with `perf_counter`, and, when the daemon exits, writes to the file named by
`SUBSTRATE_BENCH_CLOCK` a JSON object: workspace id → the milliseconds of each command's
join + end. Nothing else changes; a benchmark aid, never shipped in a profile.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import time
from collections import defaultdict
from typing import Any

from substrate.cli.main import main
from substrate.layer import users

_joined: dict[str, float] = {}  # user id → its join's ms
_per_ws: defaultdict[str, list[float]] = defaultdict(list)


def _install() -> None:
    join, end = users.LayerUsers.join, users.LayerUsers.end

    @functools.wraps(join)
    async def timed_join(self: Any, sandbox: Any, user_id: str, asked: Any) -> Any:
        t = time.perf_counter()
        try:
            return await join(self, sandbox, user_id, asked)
        finally:
            _joined[user_id] = (time.perf_counter() - t) * 1000

    @functools.wraps(end)
    async def timed_end(self: Any, use: Any) -> Any:
        t = time.perf_counter()
        try:
            return await end(self, use)
        finally:
            took = (time.perf_counter() - t) * 1000
            _per_ws[use.req.ws.id].append(_joined.pop(use.user.id, 0.0) + took)

    users.LayerUsers.join = timed_join  # type: ignore[method-assign]
    users.LayerUsers.end = timed_end  # type: ignore[method-assign]


def _dump() -> None:
    out = os.environ.get("SUBSTRATE_BENCH_CLOCK")
    if out:
        with open(out, "w") as f:
            json.dump(_per_ws, f)


if __name__ == "__main__":
    _install()
    atexit.register(_dump)
    raise SystemExit(main())
