"""Inspect's own sandbox-provider conformance suite (`inspect_ai.util._sandbox.self_check`)
against the `substrate` provider: a real daemon, the real engine, one sample per profile.

On `eval` (root in the container) every check passes, `test_exec_large_command` (1 MiB
of argv, past what one request carries) by staging the argv in the sandbox. On `default`
(the checkout's owner, no capabilities) the same, but the check that switches users is
refused by name (`SandboxUserUnsupportedError`), as Inspect's suite allows for a provider
whose configuration cannot run as another user.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from typing import Any

import pytest
import trio
from inspect_ai.util import SandboxUserUnsupportedError
from inspect_ai.util._sandbox.self_check import *  # noqa: F403

from substrate.integrations.inspect import SubstrateSandboxConfig, SubstrateSandboxEnvironment
from substrate.sandbox.reaper import MARKER
from tests.harness import DaemonProcess, engine, short_tempdir
from tests.harness.workspaces import remove_tree

#: Checks that switch users: on a profile that cannot, refused by name.
USER_SWITCHING = frozenset({"test_exec_as_user"})
#: 64 KiB arguments, as the suite's large command has (each under Linux's 128 KiB cap).
CHUNK = "x" * (64 << 10)


@pytest.fixture(scope="module", params=["eval", "default"])
def sample(
    request: pytest.FixtureRequest, docker_client: Any, sandbox_image: str
) -> Iterator[SubstrateSandboxEnvironment]:
    """One sample's sandbox on a daemon of its own (this module's checks share it)."""
    base = short_tempdir()
    daemon = DaemonProcess(base).start()
    config = SubstrateSandboxConfig(state_dir=str(daemon.state_dir), profile=request.param)
    try:
        envs = trio.run(SubstrateSandboxEnvironment.sample_init, "self-check", config, {})
        env = envs["default"]
        assert isinstance(env, SubstrateSandboxEnvironment)
        checkout = env.checkout
        try:
            yield env
        finally:
            trio.run(SubstrateSandboxEnvironment.sample_cleanup, "self-check", config, envs, False)
        assert not checkout.exists()  # the sample's checkout is removed at cleanup
    finally:
        if daemon.running:
            daemon.stop()
        engine.remove_daemon_containers(docker_client, daemon.state_dir)
        daemon.close()
        remove_tree(base)


@pytest.fixture
def sandbox_env(
    sample: SubstrateSandboxEnvironment, request: pytest.FixtureRequest
) -> SubstrateSandboxEnvironment:
    """What the self-check asks for; user switching refused where the profile cannot."""
    assert sample.identity is not None
    name = request.node.originalname
    if name in USER_SWITCHING and not sample.identity.root:
        why = "SandboxUserUnsupportedError: the profile runs as one non-root user"
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=why))
    return sample


# pytest-trio reports a check's exception inside an ExceptionGroup, so the refusals the
# xfails above stand for are asserted by name here.


async def test_refusals_are_named(sample: SubstrateSandboxEnvironment) -> None:
    assert sample.identity is not None
    # Past the staged argv's cap (2 MiB, Linux's usual ARG_MAX): the kernel's E2BIG.
    with pytest.raises(OSError) as over:
        await sample.exec(["printf", "%s", *([CHUNK] * 33)])
    assert over.value.errno == errno.E2BIG
    if sample.identity.root:
        assert (await sample.exec(["whoami"], user="root")).stdout == "root\n"
        assert (await sample.exec(["id", "-u"])).stdout == f"{sample.identity.owner_uid}\n"
    else:
        with pytest.raises(SandboxUserUnsupportedError):
            await sample.exec(["whoami"], user="root")
        assert (await sample.exec(["whoami"], user=sample.identity.name)).success


async def test_a_large_argv_is_staged_with_the_commands_semantics(
    sample: SubstrateSandboxEnvironment,
) -> None:
    """Past what one request carries, the argv is staged in the sandbox's /tmp: stdin,
    env, cwd, user, exit code and timeout are the command's, the environment is exactly
    the one a direct command gets, and the staged file is gone once the command runs."""
    assert sample.identity is not None
    big = [CHUNK] * 16
    script = 'printf "%s|%s|%s|%s|" "$(pwd)" "$FOO" "$(id -u)" "$#"; cat; exit 3'
    result = await sample.exec(
        ["sh", "-c", script, "sh", *big], input="in put", cwd="/tmp", env={"FOO": "b a r"}
    )
    uid = sample.identity.owner_uid if sample.identity.root else sample.identity.uid
    assert (result.returncode, result.stdout) == (3, f"/tmp|b a r|{uid}|16|in put")
    relative = await sample.exec(["sh", "-c", "pwd", "sh", *big], cwd="sub/..")
    assert relative.stdout == "/workspace\n"

    direct = await sample.exec(["sh", "-c", "exec env", "sh"], env={"A": "1"})
    staged = await sample.exec(["sh", "-c", "exec env", "sh", *big], env={"A": "1"})
    assert "A=1\n" in direct.stdout

    def environment(stdout: str) -> list[str]:  # less the command's own id (the reaper's)
        return sorted(line for line in stdout.splitlines() if not line.startswith(MARKER))

    assert environment(staged.stdout) == environment(direct.stdout)

    nowhere = await sample.exec(["true", *big], cwd="/no/such/dir")  # deleted before `cd`
    assert not nowhere.success and "/no/such/dir" in nowhere.stderr
    many = await sample.exec(["printf", "%s", *(["y"] * 5000)])  # past 4096 items
    assert many.stdout == "y" * 5000
    missing = await sample.exec(["no-such=program", *big])
    assert missing.returncode == 127
    with pytest.raises(TimeoutError):
        await sample.exec(["sh", "-c", "sleep 30", "sh", *big], timeout=2)
    if sample.identity.root:
        root = await sample.exec(["sh", "-c", "id -u", "sh", *big], user="root")
        assert root.stdout == "0\n"
        nobody = await sample.exec(["true", *big], user="no-such-user")
        assert not nobody.success and "no-such-user" in nobody.stderr
    else:
        with pytest.raises(SandboxUserUnsupportedError):
            await sample.exec(["true", *big], user="root")
    left = await sample.exec(["sh", "-c", "ls -a /tmp | grep -c substrate-argv || true"])
    assert left.stdout == "0\n"
