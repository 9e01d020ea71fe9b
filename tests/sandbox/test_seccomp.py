"""seccomp policy loading and the shipped `strict.json`, without an engine."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from substrate.sandbox import seccomp
from substrate.sandbox.seccomp import SeccompError, Verdict, evaluate, load_seccomp

ROOT = Path(__file__).resolve().parents[2]
STRICT = ROOT / "seccomp" / "strict.json"
EPERM = Verdict("SCMP_ACT_ERRNO", 1)
ALLOW = Verdict("SCMP_ACT_ALLOW", None)

AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET, AF_ALG, AF_VSOCK = 1, 2, 10, 16, 17, 38, 40
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000
FORK_FLAGS = 0x01200011  # CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID | SIGCHLD: glibc fork()
THREAD_FLAGS = 0x003D0F00  # glibc pthread_create's clone flags

#: The syscalls docs/seccomp.md says strict denies with EPERM, whatever the args.
DENIED = [
    "unshare",
    "mount",
    "umount2",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "setns",
    "pivot_root",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
]


@pytest.fixture(scope="module")
def strict() -> dict[str, Any]:
    return load_seccomp(STRICT)


def _probe_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "syscalls_probe", ROOT / "tests/probes/syscalls.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- strict.json ---------------------------------------------------------------------------


def test_strict_defaults_to_eperm_on_native_architectures_only(strict: dict[str, Any]) -> None:
    assert strict["defaultAction"] == "SCMP_ACT_ERRNO"
    assert strict["defaultErrnoRet"] == 1
    # No 32-bit compat ABIs: their syscalls hit the bad-arch action, not the allow list.
    assert strict["architectures"] == ["SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"]
    assert "archMap" not in strict


@pytest.mark.parametrize("name", DENIED)
def test_strict_denies_with_eperm(strict: dict[str, Any], name: str) -> None:
    assert name not in seccomp.allowed_syscalls(strict)
    assert evaluate(strict, name, (0, 0, 0, 0, 0, 0)) == EPERM
    # ... and says so explicitly, so the policy documents itself.
    explicit = [r for r in strict["syscalls"] if name in r["names"] and "args" not in r]
    assert [(r["action"], r["errnoRet"]) for r in explicit] == [("SCMP_ACT_ERRNO", 1)]


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        (AF_UNIX, ALLOW),
        (AF_INET, ALLOW),
        (AF_INET6, ALLOW),
        (AF_NETLINK, ALLOW),
        (AF_ALG, EPERM),
        (AF_VSOCK, EPERM),
        (AF_PACKET, EPERM),
        (0xFFFF, EPERM),
    ],
)
def test_strict_socket_families(strict: dict[str, Any], family: int, expected: Verdict) -> None:
    assert evaluate(strict, "socket", (family, 1, 0)) == expected


def test_strict_names_af_alg_explicitly(strict: dict[str, Any]) -> None:
    rules = [
        r
        for r in strict["syscalls"]
        if r["names"] == ["socket"] and r["action"] != "SCMP_ACT_ALLOW"
    ]
    args = [(r["args"], r["errnoRet"]) for r in rules]
    assert ([{"index": 0, "value": AF_ALG, "op": "SCMP_CMP_EQ"}], 1) in args
    # ... and no rule allows socket without looking at the family (it would win).
    assert all("args" in r for r in strict["syscalls"] if "socket" in r["names"])


def test_strict_socketpair_is_unix_only(strict: dict[str, Any]) -> None:
    assert evaluate(strict, "socketpair", (AF_UNIX, 1, 0)) == ALLOW
    assert evaluate(strict, "socketpair", (AF_ALG, 5, 0)) == EPERM


def test_strict_clone_without_namespaces_only(strict: dict[str, Any]) -> None:
    assert evaluate(strict, "clone", (FORK_FLAGS,)) == ALLOW
    assert evaluate(strict, "clone", (THREAD_FLAGS,)) == ALLOW
    assert evaluate(strict, "clone", (FORK_FLAGS | CLONE_NEWUSER,)) == EPERM
    assert evaluate(strict, "clone", (CLONE_NEWNS,)) == EPERM


def test_strict_clone3_is_enosys_so_glibc_falls_back(strict: dict[str, Any]) -> None:
    assert evaluate(strict, "clone3") == Verdict("SCMP_ACT_ERRNO", 38)


def test_strict_personality_is_restricted(strict: dict[str, Any]) -> None:
    assert evaluate(strict, "personality", (0,)) == ALLOW
    assert evaluate(strict, "personality", (0xFFFFFFFF,)) == ALLOW
    assert evaluate(strict, "personality", (0x0040000,)) == EPERM  # ADDR_NO_RANDOMIZE


@pytest.mark.parametrize(
    "name",
    ["read", "write", "openat", "execve", "fork", "wait4", "futex", "mmap", "rseq", "statx",
     "getdents64", "pipe2", "epoll_pwait", "connect", "getrandom", "prlimit64", "sendfile"],
)  # fmt: skip
def test_strict_allows_ordinary_work(strict: dict[str, Any], name: str) -> None:
    assert evaluate(strict, name) == ALLOW


def test_strict_defaults_unlisted_syscalls_to_eperm(strict: dict[str, Any]) -> None:
    for name in ("get_mempolicy", "reboot", "swapon", "acct", "syslog", "not_a_syscall"):
        assert evaluate(strict, name) == EPERM


def test_strict_every_rule_is_commented(strict: dict[str, Any]) -> None:
    assert all(rule.get("comment") for rule in strict["syscalls"])


def test_probe_arguments_hit_the_rules_strict_has(strict: dict[str, Any]) -> None:
    """Each probe in tests/probes/syscalls.py, with its real arguments, gets what
    the integration test expects: EPERM for the denied, allowed for the controls."""
    probe = _probe_module()
    expected = {
        "getpid": ALLOW,
        "socket_af_unix": ALLOW,
        "socket_af_inet": ALLOW,
        "clone3": Verdict("SCMP_ACT_ERRNO", 38),
    }
    for name, (syscall, args, unfiltered) in probe.PROBES.items():
        assert syscall in probe.NUMBERS
        assert unfiltered != 1, f"{name}: an unfiltered EPERM would be indistinguishable"
        assert evaluate(strict, syscall, args) == expected.get(name, EPERM), name
    assert set(DENIED) - set(probe.PROBES) <= {
        "pivot_root",  # the kernel checks privilege first: EPERM either way
        "kexec_load",
        "kexec_file_load",
        "init_module",
        "finit_module",
        "delete_module",
    }


def test_security_opt_carries_the_document(strict: dict[str, Any]) -> None:
    opt = seccomp.security_opt(strict)
    assert opt.startswith("seccomp={")
    assert json.loads(opt.removeprefix("seccomp=")) == strict


# -- engine precedence, as modelled by evaluate ----------------------------------------------


def _policy(*rules: dict[str, Any]) -> dict[str, Any]:
    return {"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 1, "syscalls": list(rules)}


def _sock(action: str, *args: dict[str, Any], errno: int | None = None) -> dict[str, Any]:
    rule: dict[str, Any] = {"names": ["socket"], "action": action}
    if args:
        rule["args"] = list(args)
    if errno is not None:
        rule["errnoRet"] = errno
    return rule


def test_evaluate_unconditional_rule_beats_conditional_ones() -> None:
    # Observed with runc + libseccomp: the ERRNO on AF_ALG is lost, in either order.
    deny_alg = _sock("SCMP_ACT_ERRNO", {"index": 0, "value": AF_ALG, "op": "SCMP_CMP_EQ"}, errno=13)
    for rules in ([_sock("SCMP_ACT_ALLOW"), deny_alg], [deny_alg, _sock("SCMP_ACT_ALLOW")]):
        assert evaluate(_policy(*rules), "socket", (AF_ALG,)) == ALLOW


def test_evaluate_allow_wins_among_overlapping_conditions() -> None:
    allow_not_vsock = _sock("SCMP_ACT_ALLOW", {"index": 0, "value": AF_VSOCK, "op": "SCMP_CMP_NE"})
    deny_alg = _sock("SCMP_ACT_ERRNO", {"index": 0, "value": AF_ALG, "op": "SCMP_CMP_EQ"}, errno=13)
    policy = _policy(deny_alg, allow_not_vsock)
    assert evaluate(policy, "socket", (AF_ALG,)) == ALLOW
    assert evaluate(policy, "socket", (AF_VSOCK,)) == EPERM


def test_evaluate_includes_and_excludes_follow_capabilities() -> None:
    policy = _policy(
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38,
         "excludes": {"caps": ["CAP_SYS_ADMIN"]}},
        {"names": ["clone3"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_ADMIN"]}},
        {"names": ["arch_prctl"], "action": "SCMP_ACT_ALLOW", "includes": {"arches": ["amd64"]}},
    )  # fmt: skip
    assert evaluate(policy, "clone3") == Verdict("SCMP_ACT_ERRNO", 38)
    assert evaluate(policy, "clone3", caps=["CAP_SYS_ADMIN"]) == ALLOW
    assert evaluate(policy, "arch_prctl") == ALLOW
    assert evaluate(policy, "arch_prctl", arch="arm64") == EPERM


def test_evaluate_masked_eq() -> None:
    rule = {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": 0xF0, "valueTwo": 0x10, "op": "SCMP_CMP_MASKED_EQ"}]}  # fmt: skip
    assert evaluate(_policy(rule), "clone", (0x1F,)) == ALLOW
    assert evaluate(_policy(rule), "clone", (0x2F,)) == EPERM


# -- refusals ---------------------------------------------------------------------------------


def _write(tmp_path: Path, doc: Any, name: str = "bad.json") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def _refusal(tmp_path: Path, doc: Any) -> str:
    path = _write(tmp_path, doc)
    with pytest.raises(SeccompError) as info:
        load_seccomp(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    return message


def _strict_with(mutate: Any) -> dict[str, Any]:
    doc: dict[str, Any] = copy.deepcopy(json.loads(STRICT.read_text()))
    mutate(doc)
    return doc


def test_unknown_top_level_field_is_named(tmp_path: Path) -> None:
    msg = _refusal(tmp_path, _strict_with(lambda d: d.update(defaultActoin="SCMP_ACT_ALLOW")))
    assert "unknown field 'defaultActoin' at $" in msg


def test_unknown_rule_field_is_named_with_its_path(tmp_path: Path) -> None:
    msg = _refusal(tmp_path, _strict_with(lambda d: d["syscalls"][2].update(errno=1)))
    assert "unknown field 'errno' at $.syscalls[2]" in msg


def test_unknown_arg_field_is_named_with_its_path(tmp_path: Path) -> None:
    doc = _policy(
        _sock("SCMP_ACT_ALLOW", {"index": 0, "value": 1, "op": "SCMP_CMP_EQ", "valu2": 3})
    )
    assert "unknown field 'valu2' at $.syscalls[0].args[0]" in _refusal(tmp_path, doc)


@pytest.mark.parametrize(
    ("doc", "where", "why"),
    [
        ({"syscalls": []}, "$", "defaultAction"),
        ({"defaultAction": "SCMP_ACT_DENY"}, "$.defaultAction", "Invalid enum value"),
        ({"defaultAction": "SCMP_ACT_NOTIFY"}, "$.defaultAction", "Invalid enum value"),
        ({"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 13}, "$.defaultErrnoRet", "ignores"),
        ({"defaultAction": "SCMP_ACT_ALLOW", "defaultErrnoRet": 1}, "$.defaultErrnoRet", "only"),
        ({"defaultAction": "SCMP_ACT_ERRNO", "architectures": ["SCMP_ARCH_Z80"]},
         "$.architectures[0]", "Invalid enum value"),
        ({"defaultAction": "SCMP_ACT_ERRNO", "architectures": [],
          "archMap": [{"architecture": "SCMP_ARCH_X86_64"}]}, "$", "not both"),
        (_policy({"names": [], "action": "SCMP_ACT_ALLOW"}), "$.syscalls[0].names", "at least one"),
        (_policy({"names": ["read", "Read;"], "action": "SCMP_ACT_ALLOW"}),
         "$.syscalls[0].names[1]", "not a syscall name"),
        (_policy({"names": ["read"], "action": "SCMP_ACT_ALLOW", "errnoRet": 1}),
         "$.syscalls[0].errnoRet", "only"),
        (_policy({"names": ["read"], "action": "SCMP_ACT_ERRNO", "errnoRet": 4096}),
         "$.syscalls[0].errnoRet", "0..4095"),
        (_policy({"names": ["read"], "action": "SCMP_ACT_ERRNO", "errnoRet": "1"}),
         "$.syscalls[0].errnoRet", "Expected `int | null`, got `str`"),
        (_policy(_sock("SCMP_ACT_ALLOW", {"index": 6, "value": 1, "op": "SCMP_CMP_EQ"})),
         "$.syscalls[0].args[0].index", "0..5"),
        (_policy(_sock("SCMP_ACT_ALLOW", {"index": 0, "value": -1, "op": "SCMP_CMP_EQ"})),
         "$.syscalls[0].args[0].value", "unsigned 64-bit"),
        (_policy(_sock("SCMP_ACT_ALLOW", {"index": 0, "value": 1, "op": "SCMP_CMP_IN"})),
         "$.syscalls[0].args[0].op", "Invalid enum value"),
        (_policy(_sock("SCMP_ACT_ALLOW", {"index": 0, "value": 1, "op": "SCMP_CMP_NE"},
                       {"index": 0, "value": 2, "op": "SCMP_CMP_NE"})),
         "$.syscalls[0].args[1].index", "ORs"),
        (_policy({"names": ["read"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["SYS_ADMIN"]}}),
         "$.syscalls[0].includes.caps[0]", "CAP_CHOWN"),
        (_policy({"names": ["read"], "action": "SCMP_ACT_ALLOW", "excludes": {"minKernel": "four"}}),
         "$.syscalls[0].excludes.minKernel", "kernel version"),
    ],
)  # fmt: skip
def test_bad_fields_are_refused_with_their_path(
    tmp_path: Path, doc: dict[str, Any], where: str, why: str
) -> None:
    msg = _refusal(tmp_path, doc)
    assert f": {where}: " in msg or f"at {where}" in msg, msg
    assert why in msg, msg


def test_conflicting_unconditional_rules_are_refused(tmp_path: Path) -> None:
    # ptrace both allowed and (explicitly) denied: the engine would allow it.
    doc = _strict_with(
        lambda d: d["syscalls"].append({"names": ["ptrace"], "action": "SCMP_ACT_ALLOW"})
    )
    msg = _refusal(tmp_path, doc)
    assert "'ptrace' also has a rule at $.syscalls[" in msg
    assert "does not honour rule order" in msg


def test_errno_carved_out_of_a_broader_allow_is_refused(tmp_path: Path) -> None:
    deny_alg = _sock("SCMP_ACT_ERRNO", {"index": 0, "value": AF_ALG, "op": "SCMP_CMP_EQ"}, errno=1)
    assert "'socket'" in _refusal(tmp_path, _policy(_sock("SCMP_ACT_ALLOW"), deny_alg))
    allow_ne = _sock("SCMP_ACT_ALLOW", {"index": 0, "value": AF_VSOCK, "op": "SCMP_CMP_NE"})
    assert "'socket'" in _refusal(tmp_path, _policy(allow_ne, deny_alg))


def test_disjoint_and_same_outcome_rules_are_fine(tmp_path: Path) -> None:
    allow_unix = _sock("SCMP_ACT_ALLOW", {"index": 0, "value": AF_UNIX, "op": "SCMP_CMP_EQ"})
    deny_alg = _sock("SCMP_ACT_ERRNO", {"index": 0, "value": AF_ALG, "op": "SCMP_CMP_EQ"}, errno=1)
    twice = {"names": ["read", "socket"], "action": "SCMP_ACT_ERRNO"}
    doc = _policy(allow_unix, deny_alg, {"names": ["read"], "action": "SCMP_ACT_ALLOW"},
                  {"names": ["read"], "action": "SCMP_ACT_ALLOW", "comment": "again"})  # fmt: skip
    assert load_seccomp(_write(tmp_path, doc)) == doc
    # Capability-gated alternatives (Docker's own default does this) are left to the engine.
    gated = _policy(
        {"names": ["read"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_ADMIN"]}},
        dict(twice, names=["read"]),
    )
    assert load_seccomp(_write(tmp_path, gated, "gated.json")) == gated


def test_docker_style_document_with_arch_map_loads(tmp_path: Path) -> None:
    doc = {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": 1,
        "archMap": [
            {"architecture": "SCMP_ARCH_X86_64", "subArchitectures": ["SCMP_ARCH_X86", "SCMP_ARCH_X32"]},
            {"architecture": "SCMP_ARCH_RISCV64", "subArchitectures": None},
        ],
        "syscalls": [
            {"names": ["read", "write"], "action": "SCMP_ACT_ALLOW"},
            {"names": ["ptrace"], "action": "SCMP_ACT_ALLOW", "includes": {"minKernel": "4.8"}},
            {"names": ["modify_ldt"], "action": "SCMP_ACT_ALLOW", "includes": {"arches": ["amd64", "x32"]}},
        ],
    }  # fmt: skip
    assert load_seccomp(_write(tmp_path, doc)) == doc


def test_missing_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(SeccompError, match=f"^{path}: cannot read"):
        load_seccomp(path)


@pytest.mark.parametrize("text", ["{", "[]", "null", '"x"', "\udcff"])
def test_not_a_json_object_is_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(SeccompError, match=f"^{path}: "):
        load_seccomp(path)


def test_oversized_file_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, " " * (seccomp.MAX_POLICY_BYTES + 1))
    with pytest.raises(SeccompError, match="larger than"):
        load_seccomp(path)
