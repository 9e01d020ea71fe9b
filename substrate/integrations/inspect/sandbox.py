"""`SubstrateSandboxEnvironment`: Inspect's sandbox type `substrate` over the daemon's protocol.

Theory of operation (docs/integrations.md): each sample gets a fresh checkout, made under
one of the daemon's adopt roots (a copy of `config.checkout` if one is named, plus
`config.files`), adopted as a workspace; its commands run under `config.profile` in that
workspace's sandbox, which the daemon creates on the first command and keeps for the
sample. A file inside the workspace (a relative path, or one under `/workspace`) is read
and written through the daemon's bounded reads and guarded writes, with the permission
its owner's mode bits give (the sample's default user is the checkout's owner); a file
elsewhere is read and written in the sandbox's own filesystem by a command. At cleanup
the workspace is released (its persistent home removed) and the checkout deleted.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shlex
import shutil
from pathlib import Path, PurePosixPath
from typing import Any, Literal, overload

import anyio.to_thread
from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxConnection,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    sandboxenv,
)
from pydantic import BaseModel

from substrate.integrations.inspect.calls import Daemon, owner_of, writable
from substrate.integrations.inspect.commands import (
    READ_SCRIPT,
    SH,
    WRITE_SCRIPT,
    ExecArgv,
    Identity,
    exec_argv,
    exec_parts,
    exec_permission_error,
    file_error,
    parse_id,
    run_staged_argv,
    stage_argv,
    staged_argv,
    staged_path,
    workspace_path,
)
from substrate.integrations.inspect.config import SubstrateSandboxConfig
from substrate.protocol.client import RpcError

#: The owner permission bit a read of a checkout file needs (the default user is its owner).
OWNER_READ = 0o400


def _config(config: SandboxEnvironmentConfigType | None) -> SubstrateSandboxConfig:
    """The task's config: none, ours, or a string naming the checkout to copy."""
    if config is None:
        return SubstrateSandboxConfig()
    if isinstance(config, SubstrateSandboxConfig):
        return config
    if isinstance(config, str):
        return SubstrateSandboxConfig(checkout=config)
    raise ValueError(f"the substrate sandbox takes a SubstrateSandboxConfig, not {config!r}")


def make_checkout(daemon: Daemon, config: SubstrateSandboxConfig, task_name: str) -> Path:
    """A fresh checkout for one sample under an adopt root: the copy and the files, owned
    by `config.owner` when made by root."""
    if config.adopt_root is not None:
        # Checked by the daemon too: `workspace.adopt` refuses a path outside its roots.
        if daemon.adopt_roots and config.adopt_root not in daemon.adopt_roots:
            raise ValueError(f"{config.adopt_root} is not an adopt root of the daemon")
        root = config.adopt_root
    else:
        usable = [r for r in daemon.adopt_roots if writable(r)]
        if not usable:
            raise ValueError(
                "no adopt root of the daemon this process can write to is known: set the"
                " config's adopt_root (or $SUBSTRATE_ADOPT_ROOT)"
            )
        root = usable[0]
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in task_name)[:40]
    path = Path(root) / f"inspect-{name}-{secrets.token_hex(6)}"
    path.mkdir(mode=0o755)
    try:
        if config.checkout is not None:
            shutil.copytree(config.checkout, path, symlinks=True, dirs_exist_ok=True)
        for rel, text in config.files.items():
            pure = PurePosixPath(rel)
            if pure.is_absolute() or ".." in pure.parts:
                raise ValueError(f"files: {rel} is not a path inside the checkout")
            target = path / pure
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        if os.geteuid() == 0:
            uid, gid = owner_of(config.owner)
            for entry in [path, *path.rglob("*")]:
                os.lchown(entry, uid, gid)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


@sandboxenv(name="substrate")
class SubstrateSandboxEnvironment(SandboxEnvironment):
    """One sample's sandbox: a workspace of the daemon and the profile its commands use."""

    def __init__(
        self, daemon: Daemon, config: SubstrateSandboxConfig, workspace: str, checkout: Path
    ) -> None:
        super().__init__()
        self.daemon = daemon
        self.config = config
        self.workspace = workspace
        self.checkout = checkout
        self.identity: Identity | None = None
        #: The profile's command timeout, seconds: a longer `exec` timeout is lowered to it.
        self.max_timeout: float | None = None

    # -- lifecycle -----------------------------------------------------------------------

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return SubstrateSandboxConfig(**config)

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        """Fails early when no daemon answers (`SandboxUnavailableError`)."""
        cfg = _config(config)
        await anyio.to_thread.run_sync(Daemon.open, cfg.state_dir, cfg.adopt_root)

    @classmethod
    async def sample_init(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        metadata: dict[str, str],
    ) -> dict[str, SandboxEnvironment]:
        """A fresh checkout, adopted; the profile's user probed with one `id` (which also
        makes the sandbox, so the sample's first command does not pay for it)."""
        cfg = _config(config)
        daemon = await anyio.to_thread.run_sync(Daemon.open, cfg.state_dir, cfg.adopt_root)
        checkout = await anyio.to_thread.run_sync(make_checkout, daemon, cfg, task_name)
        try:
            adopted = await anyio.to_thread.run_sync(
                lambda: daemon.call("workspace.adopt", path=str(checkout))
            )
            env = cls(daemon, cfg, str(adopted["workspace"]), checkout)
            await env._probe()
        except BaseException:
            await anyio.to_thread.run_sync(lambda: shutil.rmtree(checkout, ignore_errors=True))
            raise
        return {"default": env}

    @classmethod
    async def sample_cleanup(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        environments: dict[str, SandboxEnvironment],
        interrupted: bool,
    ) -> None:
        """Release each workspace (and its persistent home), then remove its checkout."""
        for env in environments.values():
            if isinstance(env, SubstrateSandboxEnvironment):
                await anyio.to_thread.run_sync(env._release)

    def _release(self) -> None:
        try:
            self.daemon.call("workspace.release", workspace=self.workspace, keep_home=False)
        finally:
            shutil.rmtree(self.checkout, ignore_errors=True)

    async def _probe(self) -> None:
        profile = await anyio.to_thread.run_sync(
            lambda: self.daemon.call("profile.get", name=self.config.profile)
        )
        self.max_timeout = float(profile["timeout_s"])
        owner = self.checkout.stat()
        result = await self._run(["id"], cwd=".", stdin=None, timeout=None)
        stdout = result.get("stdout", {})
        text = self.daemon.output(stdout, 1 << 16, "64 KiB").decode("utf-8", "replace")
        self.identity = parse_id(text, (owner.st_uid, owner.st_gid))

    async def _run(
        self,
        argv: list[str],
        *,
        cwd: str,
        stdin: bytes | None,
        timeout: int | None,  # noqa: ASYNC109 - the daemon's timeout_s
    ) -> dict[str, Any]:
        profile = self.config.profile
        return await anyio.to_thread.run_sync(
            lambda: self.daemon.run(
                self.workspace, profile, argv, cwd=cwd, stdin=stdin, timeout=timeout
            )
        )

    # -- commands --------------------------------------------------------------------------

    async def exec(
        self,
        cmd: list[str],
        input: str | bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        timeout: int | None = None,  # noqa: ASYNC109 - Inspect's signature; the daemon's timeout_s
        timeout_retry: bool = True,
        concurrency: bool = True,
    ) -> ExecResult[str]:
        """Run `cmd` in the sample's sandbox (docs/integrations.md "exec"). A timeout is the
        daemon's (`timeout_s`: it kills every process of the command) and raises
        `TimeoutError`; it is not retried, since a retry would run the command again. An
        argv bigger than one request carries is staged in the sandbox first (`_staged`)."""
        assert self.identity is not None, "sample_init probes the identity"
        parts = exec_parts(cmd, cwd=cwd, env=env, user=user, identity=self.identity)
        stdin = input.encode("utf-8") if isinstance(input, str) else input
        if timeout is not None and self.max_timeout is not None:
            # A request may only lower the profile's limit; past it the operator's stands.
            timeout = min(timeout, int(self.max_timeout))
        try:
            if self.daemon.carries(
                self.workspace, self.config.profile, parts.argv, cwd=parts.cwd, timeout=timeout
            ):
                result = await self._run(parts.argv, cwd=parts.cwd, stdin=stdin, timeout=timeout)
            else:
                result = await self._staged(parts, stdin=stdin, timeout=timeout)
        except RpcError as exc:
            big = exc.refusal == "argv_denied" and "larger" in str(exc)
            if big or exc.refusal == "request_too_large":
                # The daemon's argv cap (1 MiB) or line limit: as the kernel's E2BIG.
                raise OSError(errno.E2BIG, f"Argument list too long ({exc})", cmd[0]) from exc
            raise
        if result.get("timed_out"):
            raise TimeoutError(f"command timed out after {timeout} s: {cmd[0]}")
        limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
        limit_str = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR
        stdout, stderr = await anyio.to_thread.run_sync(
            lambda: (
                self.daemon.output(result.get("stdout", {}), limit, limit_str),
                self.daemon.output(result.get("stderr", {}), limit, limit_str),
            )
        )
        code = result.get("exit_code")
        returncode = -1 if code is None else int(code)
        err = stderr.decode("utf-8", "replace")
        denied = exec_permission_error(returncode, err, cmd)
        if denied is not None:
            raise denied
        return ExecResult(
            success=returncode == 0,
            returncode=returncode,
            stdout=stdout.decode("utf-8", "replace"),
            stderr=err,
        )

    async def _staged(
        self,
        parts: ExecArgv,
        *,
        stdin: bytes | None,
        timeout: int | None,  # noqa: ASYNC109 - the daemon's timeout_s
    ) -> dict[str, Any]:
        """Run an argv too big for one request (docs/integrations.md "exec"): staged in a
        private file of the sandbox's /tmp as the command's user, then run by a fixed
        wrapper that reads it, deletes it and execs it, with the command's stdin, cwd and
        timeout. The result of a failed staging (a user that does not exist, a full
        /tmp) is the command's."""
        payload = staged_argv(parts.rest)  # E2BIG past the cap, before anything runs
        staged = await self._run(stage_argv(parts.user), cwd=".", stdin=payload, timeout=None)
        if staged.get("exit_code") != 0:
            return staged
        out = await anyio.to_thread.run_sync(
            lambda: self.daemon.output(staged.get("stdout", {}), 1 << 12, "4 KiB")
        )
        path = staged_path(out.decode("utf-8", "replace"))
        argv = run_staged_argv(parts.user, path)
        try:
            return await self._run(argv, cwd=parts.cwd, stdin=stdin, timeout=timeout)
        except RpcError:
            # Refused before it ran (the wrapper deletes the file as its first act).
            rm = [*parts.user, "/bin/rm", "-f", "--", path]
            with contextlib.suppress(RpcError, RuntimeError):  # the refusal is what tells
                await self._run(rm, cwd=".", stdin=None, timeout=None)
            raise

    # -- files -----------------------------------------------------------------------------

    async def write_file(self, file: str, contents: str | bytes) -> None:
        """`WRITE_SCRIPT` as the sample's default user, inside the workspace too: there
        the file lands through the working layer's change set at the command's end, the
        guarded path (docs/integrations.md "Files")."""
        data = contents.encode("utf-8") if isinstance(contents, str) else contents
        await self._file_script(WRITE_SCRIPT, file, data)

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        """Inside the workspace a bounded read; elsewhere `READ_SCRIPT` as the sample's
        default user. Over Inspect's read limit: `OutputLimitExceededError`, before any
        byte is sent. Text keeps its newlines as they are."""
        limit = SandboxEnvironmentLimits.MAX_READ_FILE_SIZE
        limit_str = SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR
        rel = workspace_path(file)
        if rel is None:
            data = await self._file_script(READ_SCRIPT, file, None, limit, limit_str)
        else:

            def read(path: str) -> bytes:
                stat = self.daemon.stat(self.workspace, path, file)
                if stat["kind"] == "dir":
                    raise IsADirectoryError(errno.EISDIR, "Is a directory", file)
                if not int(stat["mode"]) & OWNER_READ:
                    raise PermissionError(errno.EACCES, "Permission denied", file)
                if int(stat["size"]) > limit:
                    raise OutputLimitExceededError(limit_str, truncated_output=None)
                return self.daemon.read(self.workspace, path, file)

            data = await anyio.to_thread.run_sync(read, rel)
        return data.decode("utf-8") if text else data

    async def _file_script(
        self,
        script: str,
        file: str,
        stdin: bytes | None,
        limit: int = 1 << 16,
        limit_str: str = "64 KiB",
    ) -> bytes:
        assert self.identity is not None
        argv, _ = exec_argv(
            [SH, "-c", script, "sh", file], cwd=None, env=None, user=None, identity=self.identity
        )
        result = await self._run(argv, cwd=".", stdin=stdin, timeout=None)
        stderr = await anyio.to_thread.run_sync(
            lambda: self.daemon.output(result.get("stderr", {}), 1 << 16, "64 KiB")
        )
        code = result.get("exit_code")
        error = file_error(
            -1 if code is None else int(code), file, stderr.decode("utf-8", "replace")
        )
        if error is not None:
            raise error
        return await anyio.to_thread.run_sync(
            lambda: self.daemon.output(result.get("stdout", {}), limit, limit_str)
        )

    async def connection(self, *, user: str | None = None) -> SandboxConnection:
        """A command a person can run to work in this sample's sandbox (`substrate exec`)."""
        argv = ["substrate", "--state-dir", str(self.daemon.socket.parent), "exec"]
        argv += ["--profile", self.config.profile, "--workspace", str(self.checkout), "--", "bash"]
        return SandboxConnection(type="substrate", command=shlex.join(argv))
