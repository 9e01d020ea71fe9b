"""seccomp policies against the real engine: what a sandboxed process actually gets.

The probe (tests/probes/syscalls.py) runs inside the sandbox image as uid 1000 with every
capability dropped and no-new-privileges, like a `default`-profile command. Under
`strict` each denied syscall must answer exactly EPERM; without a filter the same probes
must answer something else, which shows the EPERMs come from the filter. Two more tests
pin the engine behaviour that `substrate.sandbox.seccomp` refuses policies over (rule order is
not honoured; `defaultErrnoRet` is ignored), and one pins that runsc enforces no OCI
policy (why the `gvisor` profile says "engine-default").
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest

from substrate.sandbox import profiles, seccomp

ROOT = Path(__file__).resolve().parents[2]
PROBE = (ROOT / "tests" / "probes" / "syscalls.py").read_text()
EPERM, ENOSYS = 1, 38

#: Probes that must succeed under strict; clone3 answers ENOSYS; every other one EPERM.
ALLOWED_PROBES = {"getpid", "socket_af_unix", "socket_af_inet"}


def _strict() -> dict[str, Any]:
    return seccomp.load_seccomp(ROOT / "seccomp" / "strict.json")


class Sandbox:
    """Runs argv in the sandbox image confined like a default-profile command."""

    def __init__(self, client: Any, image: str, labels: dict[str, str]) -> None:
        self.client, self.image, self.labels = client, image, labels

    def run(
        self, argv: list[str], security_opt: list[str], *, runtime: str = "runc"
    ) -> tuple[int, str, str]:
        """Return (exit code, stdout, stderr); the container is removed either way."""
        container = self.client.containers.create(
            self.image,
            argv,
            labels=self.labels,
            network_mode="none",
            user="1000:1000",
            cap_drop=["ALL"],
            security_opt=security_opt,
            read_only=True,
            tmpfs={"/tmp": "size=64m"},
            working_dir="/tmp",
            runtime=runtime,
        )
        try:
            container.start()
            status = container.wait(timeout=120)
            out = container.logs(stdout=True, stderr=False).decode("utf-8", "replace")
            err = container.logs(stdout=False, stderr=True).decode("utf-8", "replace")
        finally:
            container.remove(force=True)
        return int(status["StatusCode"]), out, err

    def probe(self, security_opt: list[str], *, runtime: str = "runc") -> dict[str, int]:
        """The probe's {name: errno} under `security_opt`."""
        code, out, err = self.run(["python3", "-c", PROBE], security_opt, runtime=runtime)
        assert code == 0, err
        result: dict[str, int] = json.loads(out)
        return result


@pytest.fixture
def sandbox(docker_client: Any, sandbox_image: str, test_labels: dict[str, str]) -> Sandbox:
    return Sandbox(docker_client, sandbox_image, test_labels)


def _raw_policy(policy: dict[str, Any]) -> list[str]:
    """security_opt for a policy that load_seccomp would refuse (engine behaviour tests)."""
    return ["no-new-privileges", seccomp.security_opt(policy)]


def test_strict_answers_eperm_to_each_denied_probe(sandbox: Sandbox) -> None:
    default = profiles.load_profile(ROOT / "profiles" / "default.toml", ROOT / "seccomp")
    result = sandbox.probe(profiles.security_opts(default, ROOT / "seccomp"))
    expected = {
        name: 0 if name in ALLOWED_PROBES else ENOSYS if name == "clone3" else EPERM
        for name in result
    }
    assert result == expected
    assert {"unshare", "mount", "keyctl", "add_key", "bpf", "perf_event_open", "userfaultfd",
            "io_uring_setup", "ptrace", "socket_af_alg"} <= set(result)  # fmt: skip


def test_without_a_filter_no_probe_sees_eperm(sandbox: Sandbox) -> None:
    """The control: the probes' arguments make the kernel itself answer something else."""
    result = sandbox.probe(["no-new-privileges", "seccomp=unconfined"])
    assert {name: errno for name, errno in result.items() if errno == EPERM} == {}
    assert result["getpid"] == 0


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["python3", "-c", "print(1)"], "1\n"),
        (["git", "--version"], "git version "),
        (["python3", "-m", "pytest", "--version"], "pytest "),
        (
            # Threads (clone3 → ENOSYS → clone fallback), fork+exec, AF_UNIX socketpair.
            [
                "python3",
                "-c",
                "import socket, subprocess, threading\n"
                "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
                "a, b = socket.socketpair(); a.send(b'pair'); print(b.recv(4).decode())\n"
                "print(subprocess.run(['true']).returncode)\n",
            ],
            "thread\npair\n0\n",
        ),
        (
            # A fixed script: a git commit and a pytest run in the tmpfs.
            [
                "sh",
                "-c",
                "set -e; cd /tmp; git init -q r; cd r;"
                " git -c user.name=a -c user.email=a@b commit -q --allow-empty -m x;"
                " printf 'def test_x():\\n    assert True\\n' > test_x.py;"
                " python3 -m pytest -q -p no:cacheprovider test_x.py | tail -n 1",
            ],
            "1 passed",
        ),
    ],
)
def test_ordinary_work_runs_under_strict(sandbox: Sandbox, argv: list[str], expected: str) -> None:
    opts = ["no-new-privileges", seccomp.security_opt(_strict())]
    code, out, err = sandbox.run(argv, opts)
    assert code == 0, err
    if expected.endswith("\n"):  # the whole output
        assert out == expected
    else:  # a version line or a summary
        assert out.startswith(expected), out


def test_engine_default_confines_too(sandbox: Sandbox) -> None:
    code, out, err = sandbox.run(
        ["grep", "-E", "^(Seccomp|NoNewPrivs):", "/proc/self/status"],
        ["no-new-privileges"],
    )  # fmt: skip
    assert code == 0, err
    assert out.split() == ["NoNewPrivs:", "1", "Seccomp:", "2"]
    result = sandbox.probe(["no-new-privileges"])
    assert result["mount"] == EPERM and result["getpid"] == 0


def test_engine_does_not_honour_rule_order(sandbox: Sandbox) -> None:
    """Why load_seccomp refuses overlapping rules: an ERRNO carved out of an ALLOW is lost,
    wherever it stands in the file (and evaluate() predicts it)."""
    deny_alg = {"names": ["socket"], "action": "SCMP_ACT_ERRNO", "errnoRet": 13,
                "args": [{"index": 0, "value": 38, "op": "SCMP_CMP_EQ"}]}  # fmt: skip
    allow_all = {"names": ["socket"], "action": "SCMP_ACT_ALLOW"}
    base = _strict()
    base["syscalls"] = [r for r in base["syscalls"] if "socket" not in r["names"]]
    for rules in ([deny_alg, allow_all], [allow_all, deny_alg]):
        policy = copy.deepcopy(base)
        policy["syscalls"] = rules + policy["syscalls"]
        assert seccomp.evaluate(policy, "socket", (38, 5, 0)).action == "SCMP_ACT_ALLOW"
        result = sandbox.probe(_raw_policy(policy))
        assert result["socket_af_alg"] not in (EPERM, 13)  # the kernel's own answer


def test_engine_ignores_default_errno_ret(sandbox: Sandbox) -> None:
    """Why load_seccomp accepts only defaultErrnoRet = 1: other values are not applied."""
    policy = _strict()
    policy["defaultErrnoRet"] = 13
    result = sandbox.probe(_raw_policy(policy))
    assert result["get_mempolicy"] == EPERM  # allowed by no rule: the default action


def test_runsc_enforces_no_seccomp_policy(sandbox: Sandbox) -> None:
    """Why a runsc profile must say "engine-default": a policy passed to runsc (registered
    without --oci-seccomp) changes nothing inside the sandbox."""
    if "runsc" not in sandbox.client.info().get("Runtimes", {}):
        message = "the engine has no runsc runtime (scripts/engine-up registers it)"
        if os.environ.get("SUBSTRATE_REQUIRE_DOCKER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    opts = ["no-new-privileges", seccomp.security_opt(_strict())]
    code, out, err = sandbox.run(
        ["grep", "^Seccomp:", "/proc/self/status"], opts,
        runtime="runsc",
    )  # fmt: skip
    assert code == 0, err
    assert out.split() == ["Seccomp:", "0"]
    strict = sandbox.probe(opts, runtime="runsc")
    unconfined = sandbox.probe(["seccomp=unconfined"], runtime="runsc")
    assert strict == unconfined
    assert strict["socket_af_alg"] != EPERM
