"""A complete agent loop on substrate's Python client (docs/quickstart.md).

    python docs/examples/agent_loop.py [--state-dir DIR] [--init] /abs/path/to/checkout

It adopts the checkout, runs its tests in the sandbox, finds the code the failures name
(`fs.search`), reads it (`fs.read`: the bytes and their SHA-256), and tries the fixes a
model would propose, one at a time: a checkpoint, a patch bound to the digest it read
(dry run first: the diff and the plan digest, then exactly that plan), the tests again,
the failures read from the output's artifact when it is too big to inline, and a
restore of the checkpoint when the fix did not help. The "model" here is a fixed list of
candidate edits, so the loop runs without one; put your model's proposals in its place.

`--init` first writes a small demo project into the checkout (through guarded creates:
each file must not exist yet): `calc.py`, whose `add` subtracts, and its tests. The
checkout must lie under one of the daemon's adopt roots and belong to a normal user (a
root-owned checkout is refused). Exits 0 when a fix made the tests pass.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from substrate.protocol.client import Client, RpcError, socket_path

PROFILE = "default"
TESTS = ["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider"]
#: Lines of pytest's output worth showing a model: failed tests and their errors.
FAILURE = r"^(FAILED |E   |.*Error)"

DEMO = {
    "calc.py": 'def add(a: int, b: int) -> int:\n    """The sum of a and b."""\n    return a - b\n',
    "test_calc.py": (
        "from calc import add\n\n\n"
        "def test_add() -> None:\n    assert add(2, 3) == 5\n\n\n"
        "def test_add_negative() -> None:\n    assert add(-2, -3) == -5\n\n\n"
        "def test_add_zero() -> None:\n    assert add(0, 7) == 7\n"
    ),
}
#: What a model might propose for "make the tests pass", in order: a wrong guess first.
CANDIDATES = [
    [{"old": "return a - b", "new": "return abs(a - b)"}],
    [{"old": "return a - b", "new": "return a + b"}],
]


def say(message: str) -> None:
    print(message, flush=True)


def run_tests(c: Client, ws: str) -> tuple[bool, list[str]]:
    """Run the tests in the sandbox; (passed, failure lines).

    `changes: "discard"`: whatever the run writes (caches, bytecode) stays in the sandbox's
    working layer and is dropped; the checkout changes only through our guarded writes.
    """
    result = c.call("proc.run", workspace=ws, profile=PROFILE, argv=TESTS, changes="discard")
    return result["exit_code"] == 0, failure_lines(c, result["stdout"])


def failure_lines(c: Client, out: dict[str, Any]) -> list[str]:
    """The failure lines of an output ref: from its artifact (`artifact.grep`, bounded,
    nothing else read) when the output was too big to inline, else from the inline text."""
    if "artifact" in out:
        found = c.call("artifact.grep", artifact=out["artifact"], pattern=FAILURE, max_matches=20)
        say(f"  read {len(found['matches'])} failure line(s) from artifact {out['artifact']}")
        return [m["text"] for m in found["matches"]]
    text = str(out.get("inline", ""))
    return [line for line in text.splitlines() if re.match(FAILURE, line)][:20]


def init_demo(c: Client, ws: str) -> None:
    for path, content in DEMO.items():
        c.call("fs.write", workspace=ws, path=path, content=content, base_sha256=None)
        say(f"created {path}")


def attempt(c: Client, ws: str, path: str, edits: list[dict[str, str]]) -> bool:
    """One candidate fix: checkpoint, read, patch bound to what was read, test; restore
    the checkpoint when the tests still fail. True when they pass."""
    checkpoint = c.call("workspace.checkpoint", workspace=ws)["checkpoint"]
    seen = c.call("fs.read", workspace=ws, path=path)
    try:
        plan = c.call(
            "fs.patch",
            workspace=ws,
            path=path,
            base_sha256=seen["sha256"],
            edits=edits,
            dry_run=True,
        )
        say(f"  plan {plan['plan_digest'][:12]}:")
        for line in plan["diff"].splitlines():
            say(f"    {line}")
        c.call(
            "fs.patch",
            workspace=ws,
            path=path,
            base_sha256=seen["sha256"],
            edits=edits,
            plan_digest=plan["plan_digest"],
        )
    except RpcError as exc:
        # stale_base: someone changed the file since we read it (read again and retry);
        # patch_conflict: the edit does not fit the text as it is.
        say(f"  not applied: {exc.refusal}")
        return False
    passed, failures = run_tests(c, ws)
    if passed:
        say("  tests pass: keeping the fix")
        return True
    for line in failures:
        say(f"  | {line}")
    undone = c.call("workspace.restore", workspace=ws, checkpoint=checkpoint)
    say(
        f"  tests still fail: restored {undone['counts']['restored']} file(s) "
        f"from checkpoint {checkpoint}"
    )
    return False


def loop(c: Client, ws: str) -> bool:
    passed, failures = run_tests(c, ws)
    if passed:
        say("tests pass already")
        return True
    say(f"tests fail ({len(failures)} line(s)):")
    for line in failures:
        say(f"  | {line}")
    # Find the code the failures point at: the function under test.
    hits = c.call("fs.search", workspace=ws, pattern=r"^def add\(", glob="*.py")["matches"]
    if not hits:
        say("no definition found")
        return False
    path = hits[0]["path"]
    say(f"found {path}:{hits[0]['line']}: {hits[0]['text']}")
    for number, edits in enumerate(CANDIDATES, 1):
        say(f"attempt {number}:")
        if attempt(c, ws, path, edits):
            return True
    return False


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", help="absolute path of the checkout (under an adopt root)")
    parser.add_argument("--state-dir", help="the daemon's state dir (its agent socket)")
    parser.add_argument("--init", action="store_true", help="write the demo project first")
    args = parser.parse_args(argv)
    with Client(socket_path(args.state_dir), timeout=None) as c:
        ws = c.call("workspace.adopt", path=os.path.abspath(args.checkout))["workspace"]
        say(f"adopted {args.checkout} as {ws}")
        if args.init:
            init_demo(c, ws)
        fixed = loop(c, ws)
    say("fixed" if fixed else "not fixed")
    return 0 if fixed else 1


if __name__ == "__main__":
    sys.exit(main())
