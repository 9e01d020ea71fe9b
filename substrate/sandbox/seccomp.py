"""Operator seccomp policies: `seccomp/<name>.json` in the engine's (Docker's) format.

`load_seccomp` reads one file and validates every field; anything the engine would
silently ignore or misread is refused with a `SeccompError` naming the file and the field,
because a policy that does not mean what it says is worse than none. The validated
document is handed to the engine unchanged (`security_opt`).

Theory of operation (verified against dockerd 20.10 + runc 1.1 + libseccomp 2.5; see
docs/seccomp.md for the experiments):

- Rule order in the file means nothing. For one syscall, an unconditional rule beats
  every conditional one, and of two overlapping conditional rules the ALLOW wins: a
  narrow ERRNO rule cannot carve an exception out of a broader ALLOW. Policies must
  therefore *allow-list* (non-overlapping ALLOW rules, default deny); `load_seccomp`
  refuses a syscall whose rules could overlap with different outcomes.
- runc drops rules whose outcome equals the default action, so explicit EPERM rules in a
  default-EPERM policy are documentation; what denies is that nothing allows.
- dockerd 20.10 ignores `defaultErrnoRet` (the default ERRNO is always EPERM), so any
  other value is refused rather than silently not applied.
- Several conditions on the same argument index in one rule are ORed by runc (it splits
  them into separate rules), which reads like AND; such rules are refused.

`evaluate` answers "what does this policy do to syscall X with these arguments" with the
same precedence, without a kernel, for tests and `doctor`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import msgspec

#: Largest policy file read; the engine's own default is about 20 KiB.
MAX_POLICY_BYTES = 1 << 20
#: Largest errno the kernel lets a filter return (MAX_ERRNO).
MAX_ERRNO = 4095
#: The only `defaultErrnoRet` the engine here applies (dockerd 20.10 ignores the field).
ENGINE_DEFAULT_ERRNO = 1
#: seccomp policy names (file stems), same shape as profile names.
NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")

Action = Literal[
    "SCMP_ACT_ALLOW",
    "SCMP_ACT_ERRNO",
    "SCMP_ACT_KILL",
    "SCMP_ACT_KILL_THREAD",
    "SCMP_ACT_KILL_PROCESS",
    "SCMP_ACT_TRAP",
    "SCMP_ACT_TRACE",
    "SCMP_ACT_LOG",
]  # SCMP_ACT_NOTIFY is absent: it needs a listener substrate does not run.
Operator = Literal[
    "SCMP_CMP_NE",
    "SCMP_CMP_LT",
    "SCMP_CMP_LE",
    "SCMP_CMP_EQ",
    "SCMP_CMP_GE",
    "SCMP_CMP_GT",
    "SCMP_CMP_MASKED_EQ",
]
Architecture = Literal[
    "SCMP_ARCH_X86",
    "SCMP_ARCH_X86_64",
    "SCMP_ARCH_X32",
    "SCMP_ARCH_ARM",
    "SCMP_ARCH_AARCH64",
    "SCMP_ARCH_MIPS",
    "SCMP_ARCH_MIPS64",
    "SCMP_ARCH_MIPS64N32",
    "SCMP_ARCH_MIPSEL",
    "SCMP_ARCH_MIPSEL64",
    "SCMP_ARCH_MIPSEL64N32",
    "SCMP_ARCH_PPC",
    "SCMP_ARCH_PPC64",
    "SCMP_ARCH_PPC64LE",
    "SCMP_ARCH_S390",
    "SCMP_ARCH_S390X",
    "SCMP_ARCH_RISCV64",
]

_SYSCALL_NAME_RE = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_CAP_RE = re.compile(r"CAP_[A-Z_]{2,32}")
_ARCH_TAG_RE = re.compile(r"[a-z0-9]{1,16}")
_KERNEL_RE = re.compile(r"\d{1,3}\.\d{1,3}")


class SeccompError(Exception):
    """A seccomp policy file cannot be used as written.

    Raised at startup (or when a profile naming the policy is loaded), never on the wire;
    the message names the file and the field (`seccomp/x.json: $.syscalls[3].op: ...`).
    """


class _Arg(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    index: int
    value: int
    op: Operator
    value_two: int = 0


class _Filter(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    arches: list[str] = msgspec.field(default_factory=list)
    caps: list[str] = msgspec.field(default_factory=list)
    min_kernel: str = ""


class _Rule(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    names: list[str]
    action: Action
    errno_ret: int | None = None
    args: list[_Arg] = msgspec.field(default_factory=list)
    comment: str = ""
    includes: _Filter | None = None
    excludes: _Filter | None = None


class _ArchMap(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    architecture: Architecture
    sub_architectures: list[Architecture] | None = None


class _Policy(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    default_action: Action
    default_errno_ret: int | None = None
    architectures: list[Architecture] | None = None
    arch_map: list[_ArchMap] | None = None
    syscalls: list[_Rule] = msgspec.field(default_factory=list)


class Verdict(NamedTuple):
    """What a policy does to one call: an action and, for ERRNO/TRACE, the errno."""

    action: str
    errno: int | None


def read_bounded(path: Path, limit: int, error: type[Exception]) -> bytes:
    """An operator config file's bytes, at most `limit`; `error` names the file otherwise."""
    try:
        with path.open("rb") as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(raw) > limit:
        raise error(f"{path}: larger than {limit} bytes")
    return raw


def load_seccomp(path: Path) -> dict[str, Any]:
    """Read and validate `path`; return the JSON document exactly as the engine will get it.

    Refuses (SeccompError naming the file and field) a missing or oversized file, bad
    JSON, unknown fields, and everything `validate_seccomp` refuses. Costs one read of at
    most MAX_POLICY_BYTES and a pass over the rules (well under a millisecond for
    `strict.json`).
    """
    source = str(path)
    raw = read_bounded(path, MAX_POLICY_BYTES, SeccompError)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SeccompError(f"{source}: not JSON: {exc}") from None
    return validate_seccomp(doc, source=source)


def validate_seccomp(doc: object, *, source: str) -> dict[str, Any]:
    """Validate a parsed policy document; return it unchanged. Pure; see `load_seccomp`."""
    if not isinstance(doc, dict):
        raise SeccompError(f"{source}: $: expected a JSON object")
    try:
        policy = msgspec.convert(doc, _Policy, strict=True)
    except msgspec.ValidationError as exc:
        raise SeccompError(_describe(source, exc)) from None
    _check_policy(policy, source)
    return doc


def security_opt(policy: Mapping[str, Any]) -> str:
    """The `security_opt` entry that hands `policy` to the engine (`seccomp=<json>`).

    The engine takes the document itself, not a path (the Docker CLI reads the file
    client-side too).
    """
    return "seccomp=" + json.dumps(policy, separators=(",", ":"), sort_keys=True)


def evaluate(
    policy: Mapping[str, Any],
    syscall: str,
    args: Sequence[int] = (),
    *,
    caps: Iterable[str] = (),
    arch: str = "amd64",
) -> Verdict:
    """What `policy` (as validated) does to `syscall(args...)` in a container holding `caps`.

    Models the engine's observed precedence (module docstring): applicable unconditional
    rules first, then matching conditional rules, ALLOW winning among overlapping rules of
    different outcome, else the default action. `caps` are "CAP_X" names; `arch` is
    Docker's tag ("amd64", "arm64") for `includes.arches`; `minKernel` is assumed met.
    Pure; cost is linear in the number of rules.
    """
    p = msgspec.convert(policy, _Policy, strict=True)
    held = frozenset(caps)
    default = Verdict(p.default_action, _errno_of(p.default_action, p.default_errno_ret))
    unconditional: list[Verdict] = []
    conditional: list[Verdict] = []
    for rule in p.syscalls:
        if syscall not in rule.names or not _applies(rule, held, arch):
            continue
        verdict = Verdict(rule.action, _errno_of(rule.action, rule.errno_ret))
        if not rule.args:
            unconditional.append(verdict)
        elif all(_holds(a, args) for a in rule.args):
            conditional.append(verdict)
    for candidates in (unconditional, conditional):
        if candidates:
            return _pick(candidates, default)
    return default


def allowed_syscalls(policy: Mapping[str, Any]) -> frozenset[str]:
    """Names some rule of `policy` allows, with or without argument conditions. Pure."""
    p = msgspec.convert(policy, _Policy, strict=True)
    return frozenset(n for r in p.syscalls if r.action == "SCMP_ACT_ALLOW" for n in r.names)


# -- validation ------------------------------------------------------------------------


def _check_policy(p: _Policy, source: str) -> None:
    if p.default_errno_ret is not None:
        if p.default_action not in ("SCMP_ACT_ERRNO", "SCMP_ACT_TRACE"):
            _fail(source, "$.defaultErrnoRet", "only meaningful with SCMP_ACT_ERRNO or _TRACE")
        if p.default_errno_ret != ENGINE_DEFAULT_ERRNO:
            _fail(
                source,
                "$.defaultErrnoRet",
                f"must be {ENGINE_DEFAULT_ERRNO} (EPERM): the engine ignores other values",
            )
    if p.architectures is not None and p.arch_map is not None:
        _fail(source, "$", "give either 'architectures' or 'archMap', not both")
    for i, rule in enumerate(p.syscalls):
        _check_rule(rule, f"$.syscalls[{i}]", source)
    _check_overlaps(p, source)


def _check_rule(rule: _Rule, where: str, source: str) -> None:
    if not rule.names:
        _fail(source, f"{where}.names", "must name at least one syscall")
    for j, name in enumerate(rule.names):
        if not _SYSCALL_NAME_RE.fullmatch(name):
            _fail(source, f"{where}.names[{j}]", f"not a syscall name: {name!r}")
    if rule.errno_ret is not None:
        if rule.action not in ("SCMP_ACT_ERRNO", "SCMP_ACT_TRACE"):
            _fail(source, f"{where}.errnoRet", "only meaningful with SCMP_ACT_ERRNO or _TRACE")
        if not 0 <= rule.errno_ret <= MAX_ERRNO:
            _fail(source, f"{where}.errnoRet", f"must be 0..{MAX_ERRNO}")
    if len(rule.args) > 6:
        _fail(source, f"{where}.args", "a syscall has at most 6 arguments")
    seen: set[int] = set()
    for k, arg in enumerate(rule.args):
        at = f"{where}.args[{k}]"
        if not 0 <= arg.index <= 5:
            _fail(source, f"{at}.index", "must be 0..5")
        for field, value in (("value", arg.value), ("valueTwo", arg.value_two)):
            if not 0 <= value < (1 << 64):
                _fail(source, f"{at}.{field}", "must be an unsigned 64-bit integer")
        if arg.index in seen:
            _fail(
                source,
                f"{at}.index",
                f"argument {arg.index} is compared twice: the engine ORs such conditions; "
                "write separate rules",
            )
        seen.add(arg.index)
    for label, flt in (("includes", rule.includes), ("excludes", rule.excludes)):
        if flt is not None:
            _check_filter(flt, f"{where}.{label}", source)


def _check_filter(flt: _Filter, where: str, source: str) -> None:
    for j, cap in enumerate(flt.caps):
        if not _CAP_RE.fullmatch(cap):
            _fail(source, f"{where}.caps[{j}]", f"not a capability name like CAP_CHOWN: {cap!r}")
    for j, arch in enumerate(flt.arches):
        if not _ARCH_TAG_RE.fullmatch(arch):
            _fail(source, f"{where}.arches[{j}]", f"not an architecture tag: {arch!r}")
    if flt.min_kernel and not _KERNEL_RE.fullmatch(flt.min_kernel):
        _fail(source, f"{where}.minKernel", f"not a kernel version like 4.8: {flt.min_kernel!r}")


def _check_overlaps(p: _Policy, source: str) -> None:
    """Refuse rules for one syscall that could both match a call with different outcomes.

    Rules gated by `includes`/`excludes` are left alone (the engine picks among them by
    the container's capabilities and architecture, as Docker's own default does).
    """
    by_name: dict[str, list[tuple[int, _Rule]]] = {}
    for i, rule in enumerate(p.syscalls):
        if rule.includes is None and rule.excludes is None:
            for name in rule.names:
                by_name.setdefault(name, []).append((i, rule))
    for name, rules in by_name.items():
        for a in range(len(rules)):
            for b in range(a + 1, len(rules)):
                (i, r1), (j, r2) = rules[a], rules[b]
                same = (r1.action, _errno_of(r1.action, r1.errno_ret)) == (
                    r2.action,
                    _errno_of(r2.action, r2.errno_ret),
                )
                if same or _disjoint(r1.args, r2.args):
                    continue
                _fail(
                    source,
                    f"$.syscalls[{j}]",
                    f"'{name}' also has a rule at $.syscalls[{i}] with a different outcome "
                    "that can match the same call; the engine does not honour rule order "
                    "(allow-list instead: see docs/seccomp.md)",
                )


def _disjoint(a: list[_Arg], b: list[_Arg]) -> bool:
    """True when no call can satisfy both condition lists (EQ on one index, two values)."""
    eq_a = {x.index: x.value for x in a if x.op == "SCMP_CMP_EQ"}
    return any(y.op == "SCMP_CMP_EQ" and y.index in eq_a and eq_a[y.index] != y.value for y in b)


# -- evaluation ------------------------------------------------------------------------


def _errno_of(action: str, errno_ret: int | None) -> int | None:
    if action == "SCMP_ACT_ERRNO":
        return ENGINE_DEFAULT_ERRNO if errno_ret is None else errno_ret
    if action == "SCMP_ACT_TRACE":
        return errno_ret
    return None


def _applies(rule: _Rule, caps: frozenset[str], arch: str) -> bool:
    inc, exc = rule.includes, rule.excludes
    if inc is not None:
        if inc.caps and not set(inc.caps) <= caps:
            return False
        if inc.arches and arch not in inc.arches:
            return False
    if exc is not None:
        if exc.caps and set(exc.caps) & caps:
            return False
        if exc.arches and arch in exc.arches:
            return False
    return True


def _holds(arg: _Arg, args: Sequence[int]) -> bool:
    actual = (args[arg.index] if arg.index < len(args) else 0) & ((1 << 64) - 1)
    match arg.op:
        case "SCMP_CMP_NE":
            return actual != arg.value
        case "SCMP_CMP_LT":
            return actual < arg.value
        case "SCMP_CMP_LE":
            return actual <= arg.value
        case "SCMP_CMP_EQ":
            return actual == arg.value
        case "SCMP_CMP_GE":
            return actual >= arg.value
        case "SCMP_CMP_GT":
            return actual > arg.value
        case "SCMP_CMP_MASKED_EQ":
            return (actual & arg.value) == arg.value_two
    return False  # pragma: no cover - Operator is exhaustive


def _pick(candidates: list[Verdict], default: Verdict) -> Verdict:
    # runc drops rules equal to the default action; ALLOW beats other outcomes.
    live = [v for v in candidates if v != default] or candidates
    for v in live:
        if v.action == "SCMP_ACT_ALLOW":
            return v
    return live[-1]


# -- errors ------------------------------------------------------------------------------


def _fail(source: str, where: str, message: str) -> None:
    raise SeccompError(f"{source}: {where}: {message}")


_UNKNOWN_RE = re.compile(
    r"Object contains unknown field `(?P<field>[^`]*)`(?: - at `(?P<at>[^`]*)`)?"
)
_AT_RE = re.compile(r"^(?P<msg>.*?) - at `(?P<at>[^`]*)`$")


def _describe(source: str, exc: msgspec.ValidationError) -> str:
    """`source: unknown field 'x' at $.syscalls[2]` / `source: $.path: message`."""
    text = str(exc)
    m = _UNKNOWN_RE.fullmatch(text)
    if m:
        at = m.group("at") or "$"
        return f"{source}: unknown field '{m.group('field')}' at {at}"
    m = _AT_RE.fullmatch(text)
    if m:
        return f"{source}: {m.group('at')}: {m.group('msg')}"
    return f"{source}: $: {text}"


__all__ = [
    "ENGINE_DEFAULT_ERRNO",
    "NAME_RE",
    "SeccompError",
    "Verdict",
    "allowed_syscalls",
    "evaluate",
    "load_seccomp",
    "security_opt",
    "validate_seccomp",
]
