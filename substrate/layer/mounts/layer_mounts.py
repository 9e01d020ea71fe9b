"""`LayerMounts`: the working layers' host mounts as the containers use them.

The working layers' host mounts as `substrate.sandbox.containers` uses them: made,
torn down and identified through worker threads (`substrate.layer.mounts.working_layer`
blocks), and swept of what a previous run left (`substrate.layer.mounts.overlay.sweep`).

No layer is made before the sweep at start has run: a leftover mount of a previous run
must not be mistaken for, or stacked under, a new one.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from substrate.errors import RuntimeUnavailable
from substrate.layer.mounts import overlay, working_layer
from substrate.layer.mounts.git_layer import GitLayers
from substrate.layer.mounts.plan import layers_dir
from substrate.layer.mounts.working_layer import WorkingLayer
from substrate.schema.facts import FactValue
from substrate.schema.profile import SymlinkMode

log = logging.getLogger("substrate.layer.mounts.layer_mounts")

#: `Containers._journal_async`: (kind, data, workspace).
JournalAsync = Callable[[str, dict[str, Any], str | None], Awaitable[None]]


class LayerMounts:
    """The working layers under `<state_dir>/layers` (None: this daemon keeps none, and
    "layer" profiles are refused `runtime_unavailable`)."""

    def __init__(
        self,
        state_dir: str | None,
        fs_limiter: trio.CapacityLimiter | None,
        journal: JournalAsync,
    ) -> None:
        self._state_dir = state_dir
        self._fs_limiter = fs_limiter
        self._journal = journal
        #: Each checkout's persistent git layer (docs/working-layer.md, "The git layer").
        self.git_layers = None if state_dir is None else GitLayers(state_dir)
        # Set once a previous run's layer mounts are swept: no layer is made before.
        self._swept = trio.Event()

    async def open(
        self,
        ro_dirs: list[tuple[str, tuple[int, int]]],
        passthrough_dirs: list[str],
        symlinks: SymlinkMode = "any",
        git: tuple[str, int] | None = None,
    ) -> WorkingLayer:
        """Plan and prepare a sandbox's layer (`working_layer.open_layer`), once swept.
        `git`: (checkout identity key, held root fd) to mount the checkout's git layer
        on `.git` (`git_layer.GitLayers.claim`; journaled `layer.git` when the sandbox
        gets none: its `.git` stays read-only)."""
        if self._state_dir is None or self.git_layers is None:
            raise RuntimeUnavailable("this daemon keeps no working layers")
        await self._swept.wait()
        part = None
        if git is not None:
            outcome, claim = await trio.to_thread.run_sync(
                self.git_layers.claim, *git, limiter=self._fs_limiter
            )
            part = None if claim is None else claim.part
            if outcome not in ("mounted", "absent"):
                await self._journal("layer.git", {"outcome": outcome}, None)
        try:
            return await trio.to_thread.run_sync(
                working_layer.open_layer,
                self._state_dir,
                ro_dirs,
                passthrough_dirs,
                symlinks,
                part,
                limiter=self._fs_limiter,
            )
        except BaseException:
            self.git_layers.release(part)
            raise

    async def close(self, layer: WorkingLayer) -> None:
        """Tear a layer down (`working_layer.close`); its git layer is free again."""
        # Shielded: a layer left mounted would outlive its sandbox until the next start.
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(working_layer.close, layer, limiter=self._fs_limiter)
            if layer.unmounted and self.git_layers is not None:
                self.git_layers.release(layer.plan.git)

    async def identities(self, layer: WorkingLayer) -> dict[str, FactValue]:
        """The identity facts of the generation mounted now (`identity_required`)."""
        return await trio.to_thread.run_sync(
            working_layer.identity_required, layer, limiter=self._fs_limiter
        )

    async def sweep(self) -> None:
        """Unmount every layer mount a previous run left (`overlay.sweep`); until this ran
        at start, no layer is made. Also at shutdown (the layer directory's own
        self-bind goes too). A failure is logged (a leftover still in use stays
        mounted; new layers get new directories)."""
        try:
            if self._state_dir is not None:
                gone = await trio.to_thread.run_sync(
                    overlay.sweep, layers_dir(self._state_dir), limiter=self._fs_limiter
                )
                if gone:
                    await self._journal("layer.swept", {"mounts": len(gone)}, None)
        except OSError as exc:
            log.error("sweeping a previous run's layer mounts failed: %s", exc)
        finally:
            self._swept.set()
