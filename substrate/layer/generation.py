"""Who uses a working layer's current generation, and when it concludes
(docs/working-layer.md, "Per command"). Pure bookkeeping: no I/O.

Theory of operation. Commands (`proc.run`, `proc.start`) and terminal sessions on one
layer sandbox that overlap in time **share** the generation mounted when they joined:
none waits for another to end. A user that ends while others still use the generation
is *deferred*: what it wrote stays in the generation, to be applied with the rest. The
generation *concludes* when its last user ends (the sandbox goes idle on it): then, and
only then, it is swapped, scanned and applied, once, by whoever ended last. While it
concludes, a newcomer waits (`wait_joinable`) and then joins the next generation, so a
change belongs to exactly one generation and is applied at most once.

The mode of a conclusion is the most conservative its users asked (`combined`): any
"review" makes it "review", "discard" only when every user asked "discard", else
"apply". A conclusion that could not swap (the generation was still busy: something no
kill reaches holds it) keeps its users as *carried*: their changes are still in the
generation and go with its next conclusion, in a mode that counts theirs (which does
not carry them again: `layer.conclusion`).

A user that never ran (its exec never started) changes nothing: it concludes the
generation only when others' changes wait in it (`leave(ran=False)`).

A generation nobody uses may be mounted again for a newcomer, its checkout having
changed (docs/working-layer.md, "The fresh view"): between `refreshing_begins` and
`refreshed` nobody joins, as during a conclusion.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import trio

from substrate.schema.proc import ChangesMode


@dataclass(frozen=True)
class User:
    """One command or terminal session on a generation."""

    id: str  # a process id (`p_…`) or a terminal session id (`t-…`)
    actor: str  # who asked, for the journal
    mode: ChangesMode  # what it asked done with its changes


@dataclass(frozen=True)
class Deferred:
    """The user ended; others still use its generation: its changes wait for them."""

    generation: int


@dataclass(frozen=True)
class Conclusion:
    """The generation's last user ended: swap, scan and apply it now, once."""

    generation: int
    mode: ChangesMode  # `combined` over every user that ran on it
    actor: str  # the last user that ran: the applied set's entries are its
    users: tuple[str, ...]  # every user whose changes it holds: carried, then as they ended


def combined(modes: Iterable[ChangesMode]) -> ChangesMode:
    """The most conservative of `modes`: "review" if any, "discard" only if all (and at
    least one), else "apply"."""
    seen = set(modes)
    if "review" in seen:
        return "review"
    if seen == {"discard"}:
        return "discard"
    return "apply"


@dataclass
class Users:
    """The users of one layer's current generation."""

    generation: int = -1  # the generation they joined (the one mounted)
    active: dict[str, User] = field(default_factory=dict)
    #: Ran and ended on this generation while others still used it.
    ended: list[User] = field(default_factory=list)
    #: Concluded on this generation, but it could not be swapped (busy): their changes
    #: are still in it.
    carried: list[User] = field(default_factory=list)
    concluding: bool = False  # between a `Conclusion` and `concluded`
    #: Between `refreshing_begins` and `refreshed`: the generation is being mounted
    #: again for a newcomer (its checkout changed); nobody joins meanwhile.
    refreshing: bool = False
    _done: trio.Event = field(default_factory=trio.Event)

    async def wait_joinable(self) -> None:
        """Wait while a conclusion or a refresh runs (bounded by its apply, or its
        mounts)."""
        while self.concluding or self.refreshing:
            await self._done.wait()

    def refreshing_begins(self) -> None:
        """A newcomer mounts the generation again before joining it: only when nobody
        uses it and nothing concludes (`wait_joinable` first)."""
        if self.concluding or self.refreshing or self.active:
            raise RuntimeError("a generation in use is never mounted again")
        self.refreshing = True

    def refreshed(self) -> None:
        """The refresh is over (done or not): wakes every waiting newcomer."""
        self.refreshing = False
        self._done.set()
        self._done = trio.Event()

    def join(self, user: User, generation: int) -> None:
        """Count `user` on `generation` (the one mounted now). Only while no conclusion
        or refresh runs (`wait_joinable` first); a user id joins once."""
        if self.concluding or self.refreshing:
            raise RuntimeError("a generation is concluding: wait_joinable first")
        if user.id in self.active:
            raise ValueError(f"user {user.id} already uses the layer")
        self.generation = generation
        self.active[user.id] = user

    def leave(self, user_id: str, *, ran: bool) -> Deferred | Conclusion | None:
        """`user_id` ended. `ran`: its process ran (it may have written). Returns what to
        do: `Deferred` (it ran, others still use the generation), `Conclusion` (it was the
        last and some user's changes wait: conclude now, then call `concluded`), or None
        (it never ran, and nothing is to be concluded for it)."""
        user = self.active.pop(user_id)
        if ran:
            self.ended.append(user)
        if self.active:
            return Deferred(self.generation) if ran else None
        if not self.ended:
            return None  # nobody ran since the last conclusion: keep the generation
        self.concluding = True
        holders = [*self.carried, *self.ended]
        return Conclusion(
            generation=self.generation,
            mode=combined(u.mode for u in holders),
            actor=self.ended[-1].actor,
            users=tuple(dict.fromkeys(u.id for u in holders)),
        )

    def concluded(self, *, kept: bool) -> None:
        """The conclusion is over. `kept`: the generation could not be swapped and still
        holds its changes (`layer_busy`): its users are carried to the next conclusion.
        Wakes every waiting newcomer."""
        self.carried = [*self.carried, *self.ended] if kept else []
        self.ended = []
        self.concluding = False
        self._done.set()
        self._done = trio.Event()
