"""The providers' stream parsers on streams the real CLIs printed (tests/agents/streams:
`claude` 2.1.332 and `codex` 0.171.0 against tests/agents/scripted_model.py), and on
the bad input of docs/agent-provider.md "Envelopes": malformed lines, a 10 MB line, a
session id with path characters, a CLI that exits mid-stream."""

from __future__ import annotations

from pathlib import Path

import pytest

from substrate.agents import PROVIDERS, Envelope, LineSplitter, TurnAudit
from substrate.agents.envelope import MAX_LINE_BYTES, workspace_path

STREAMS = Path(__file__).parent / "streams"


def parse(provider: str, data: bytes, exit_code: int | None = 0) -> list[Envelope]:
    parser = PROVIDERS[provider].parser()
    splitter = LineSplitter()
    out: list[Envelope] = []
    for piece in (data[i : i + 4096] for i in range(0, len(data), 4096)):
        for item in splitter.feed(piece):
            out += [item] if isinstance(item, Envelope) else parser.line(item)
    last = splitter.end()
    if last is not None:
        out += parser.line(last)
    return out + parser.finished(exit_code)


def test_claude_code_stream_becomes_envelopes() -> None:
    out = parse("claude-code", (STREAMS / "claude-read-edit-write-bash.jsonl").read_bytes())
    kinds = [e.kind for e in out]
    assert kinds[0] == "session" and out[0].session is not None
    calls = [e for e in out if e.kind == "tool_call"]
    assert [(c.tool, c.paths) for c in calls] == [
        ("Read", ("src/hello.py",)),
        ("Edit", ("src/hello.py",)),
        ("Write", ("notes.md",)),
        ("Bash", ()),
    ]
    results = [e for e in out if e.kind == "tool_result"]
    assert [r.call_id for r in results] == [c.call_id for c in calls]
    assert all(r.ok for r in results)
    assert [e.text for e in out if e.kind == "text"] == ["Edited hello."]
    (usage,) = [e for e in out if e.kind == "usage"]
    assert usage.input_tokens and usage.output_tokens
    assert "error" not in kinds


def test_codex_stream_becomes_envelopes() -> None:
    out = parse("codex", (STREAMS / "codex-patch-and-command.jsonl").read_bytes())
    assert out[0].kind == "session"
    calls = [e for e in out if e.kind == "tool_call"]
    assert [(c.tool, c.paths) for c in calls] == [("apply_patch", ("src/y.py",)), ("shell", ())]
    assert [r.ok for r in out if r.kind == "tool_result"] == [True, True]
    assert [e.text for e in out if e.kind == "text"] == ["Made y."]
    assert [e.kind for e in out][-1] == "usage"


def test_the_audit_keeps_names_paths_and_counts_only() -> None:
    audit = TurnAudit()
    out = parse("claude-code", (STREAMS / "claude-read-edit-write-bash.jsonl").read_bytes())
    journaled = [named for e in out if (named := audit.add(e)) is not None]
    assert [name for name, _ in journaled] == ["Read", "Edit", "Write", "Bash"]
    assert (audit.tool_calls, audit.tool_failures, audit.paths) == (
        4,
        0,
        ["src/hello.py", "notes.md"],
    )
    assert audit.session == out[0].session


@pytest.mark.parametrize("provider", sorted(PROVIDERS))
def test_malformed_lines_are_errors_and_the_stream_goes_on(provider: str) -> None:
    good = (
        STREAMS
        / (
            "claude-read-edit-write-bash.jsonl"
            if provider == "claude-code"
            else "codex-patch-and-command.jsonl"
        )
    ).read_bytes()
    out = parse(provider, b"{not json\n[1, 2]\n" + good)
    assert [e.reason for e in out[:2]] == ["malformed_line", "malformed_line"]
    assert any(e.kind == "tool_call" for e in out)


@pytest.mark.parametrize("provider", sorted(PROVIDERS))
def test_a_10_mb_line_is_one_error_never_held(provider: str) -> None:
    huge = b'{"type": "assistant", "pad": "' + b"x" * (10 << 20) + b'"}\n'
    splitter = LineSplitter()
    items = list(splitter.feed(huge[: 3 << 20])) + list(splitter.feed(huge[3 << 20 :]))
    assert [i.reason for i in items if isinstance(i, Envelope)] == ["line_too_long"]
    assert len(splitter._held) <= MAX_LINE_BYTES
    out = parse(provider, huge + b'{"type": "result", "usage": {}}\n')
    assert out[0].reason == "line_too_long"


@pytest.mark.parametrize(
    "provider,line",
    [
        ("claude-code", b'{"type": "system", "subtype": "init", "session_id": "../../etc/passwd"}'),
        ("codex", b'{"type": "thread.started", "thread_id": "a/b"}'),
        ("codex", b'{"type": "thread.started", "thread_id": 7}'),
    ],
)
def test_a_session_id_with_path_characters_is_refused(provider: str, line: bytes) -> None:
    (out,) = PROVIDERS[provider].parser().line(line)
    assert (out.kind, out.reason, out.session) == ("error", "bad_session_id", None)


@pytest.mark.parametrize("provider", sorted(PROVIDERS))
def test_a_cli_that_exits_mid_stream_ends_with_an_error(provider: str) -> None:
    name = (
        "claude-read-edit-write-bash.jsonl"
        if provider == "claude-code"
        else "codex-patch-and-command.jsonl"
    )
    lines = (STREAMS / name).read_bytes().splitlines(keepends=True)
    cut = b"".join(lines[:3]) + lines[3][:10]  # and mid-line
    out = parse(provider, cut, exit_code=137)
    assert out[-1].reason == "exited_mid_stream"


def test_tool_paths_outside_the_workspace_are_not_named() -> None:
    assert workspace_path("/workspace/src/a.py") == "src/a.py"
    assert workspace_path("src/../b.py") == "b.py"
    assert workspace_path("/etc/passwd") is None
    assert workspace_path("/workspace/../etc") is None
    assert workspace_path("/workspacex/a") is None
    assert workspace_path(42) is None


def test_turn_commands_put_the_prompt_on_stdin_and_translate_the_spec() -> None:
    from substrate.agents import TurnSpec
    from substrate.errors import InvalidParams

    spec = TurnSpec(
        prompt="fix it", allowed_tools=("Bash(git diff:*)",), resume="0949adf7-911e-41bb"
    )
    claude = PROVIDERS["claude-code"].command(spec, {})
    assert claude.stdin == b"fix it" and "fix it" not in claude.argv
    assert claude.argv[-4:] == (
        "--allowedTools",
        "Bash(git diff:*)",
        "--resume",
        "0949adf7-911e-41bb",
    )
    codex = PROVIDERS["codex"].command(
        TurnSpec(prompt="fix it", resume="01a234f2-2618"),
        {"OPENAI_BASE_URL": "http://127.0.0.1:9/v1"},
    )
    assert codex.argv[-3:] == ("resume", "01a234f2-2618", "-") and codex.stdin == b"fix it"
    assert any('base_url="http://127.0.0.1:9/v1"' in a for a in codex.argv)
    with pytest.raises(InvalidParams) as refused:
        PROVIDERS["codex"].command(TurnSpec(prompt="x", allowed_tools=("Bash",)), {})
    assert refused.value.data["unknown_tools"] == ["Bash"]
