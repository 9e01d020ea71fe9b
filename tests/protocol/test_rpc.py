"""substrate.protocol.rpc: line framing and JSON-RPC 2.0 decoding, sans-IO (no socket here)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from substrate.errors import PathInvalid, RequestTooLarge, StaleBase
from substrate.protocol import rpc
from substrate.schema.fs import PatchParams, StatParams
from substrate.schema.journal import JournalReadParams, StatusParams

SHA = "0" * 64


def reply(outcome: rpc.Call | rpc.Outcome) -> dict[str, Any]:
    assert isinstance(outcome, rpc.Outcome), outcome
    assert outcome.reply is not None and outcome.reply.endswith(b"\n")
    decoded: dict[str, Any] = msgspec.json.decode(outcome.reply)
    assert decoded["jsonrpc"] == "2.0"
    return decoded


def request(method: str, params: Any = None, **envelope: Any) -> bytes:
    body: dict[str, Any] = {"jsonrpc": "2.0", "method": method, **envelope}
    if params is not None:
        body["params"] = params
    return msgspec.json.encode(body)


# --- LineSplitter --------------------------------------------------------------------------


def test_many_lines_in_one_chunk() -> None:
    splitter = rpc.LineSplitter(100)
    assert splitter.feed(b"a\nbb\nccc\n") == [b"a", b"bb", b"ccc"]
    assert not splitter.pending


def test_a_line_across_chunks() -> None:
    splitter = rpc.LineSplitter(100)
    assert splitter.feed(b'{"a"') == []
    assert splitter.pending
    assert splitter.feed(b": 1") == []
    assert splitter.feed(b"}\n{") == [b'{"a": 1}']
    assert splitter.pending
    assert splitter.feed(b"}\n") == [b"{}"]
    assert not splitter.pending


def test_byte_at_a_time() -> None:
    splitter = rpc.LineSplitter(100)
    out: list[bytes] = []
    for byte in b"one\ntwo\n":
        out += splitter.feed(bytes([byte]))
    assert out == [b"one", b"two"]


def test_crlf_and_blank_lines() -> None:
    splitter = rpc.LineSplitter(100)
    assert splitter.feed(b"a\r\n\r\n\n  \nb\r") == [b"a"]
    assert splitter.feed(b"\n") == [b"b"]


def test_exact_limit_is_accepted() -> None:
    splitter = rpc.LineSplitter(10)
    assert splitter.feed(b"x" * 10 + b"\n") == [b"x" * 10]
    assert splitter.feed(b"y" * 6) == []
    assert splitter.feed(b"y" * 4) == []
    assert splitter.feed(b"\n") == [b"y" * 10]


def test_one_byte_over_the_limit_in_one_chunk() -> None:
    with pytest.raises(RequestTooLarge) as info:
        rpc.LineSplitter(10).feed(b"x" * 11 + b"\n")
    assert info.value.data == {"limit": 10}


def test_over_the_limit_across_chunks() -> None:
    splitter = rpc.LineSplitter(10)
    assert splitter.feed(b"x" * 6) == []
    with pytest.raises(RequestTooLarge):
        splitter.feed(b"x" * 5 + b"\n")


def test_refused_before_the_newline_arrives() -> None:
    """A line is refused as soon as it is too long, not buffered until it ends."""
    splitter = rpc.LineSplitter(10)
    splitter.feed(b"x" * 10)
    with pytest.raises(RequestTooLarge):
        splitter.feed(b"x")


def test_complete_lines_before_an_oversized_one_are_not_lost_in_the_limit() -> None:
    splitter = rpc.LineSplitter(10)
    assert splitter.feed(b"ok\n" + b"x" * 10) == [b"ok"]
    with pytest.raises(RequestTooLarge):
        splitter.feed(b"x\n")


def test_the_limit_counts_the_carriage_return() -> None:
    """The limit is on bytes received for the line; a CR is one of them."""
    splitter = rpc.LineSplitter(10)
    with pytest.raises(RequestTooLarge):
        splitter.feed(b"x" * 10 + b"\r\n")


def test_finish_returns_a_last_line_without_its_newline() -> None:
    splitter = rpc.LineSplitter(100)
    assert splitter.feed(b"one\ntwo") == [b"one"]
    assert splitter.finish() == [b"two"]
    assert not splitter.pending
    assert splitter.finish() == []
    splitter.feed(b"  \r")
    assert splitter.finish() == []


# --- decode_call ------------------------------------------------------------------------------


def test_valid_call() -> None:
    call = rpc.decode_call(request("fs.stat", {"workspace": "ws_1", "path": "a"}, id=5))
    assert isinstance(call, rpc.Call)
    assert call.id == 5 and not call.is_notification
    assert call.spec.name == "fs.stat"
    assert call.params == StatParams(workspace="ws_1", path="a")


def test_string_and_null_ids() -> None:
    call = rpc.decode_call(request("daemon.status", id="abc"))
    assert isinstance(call, rpc.Call) and call.id == "abc" and not call.is_notification
    call = rpc.decode_call(request("daemon.status", id=None))
    assert isinstance(call, rpc.Call) and call.id is None and not call.is_notification


def test_missing_params_means_empty_params() -> None:
    call = rpc.decode_call(request("daemon.status", id=1))
    assert isinstance(call, rpc.Call)
    assert call.spec.name == "daemon.status"
    assert call.params == StatusParams()
    call = rpc.decode_call(request("journal.read", id=2))
    assert isinstance(call, rpc.Call)
    assert call.params == JournalReadParams(since=0, limit=1000, workspace=None)
    # A method with a required field: absent params lack it, as `{}` does.
    error = reply(rpc.decode_call(request("fs.list", id=3)))
    assert error["id"] == 3
    assert error["error"]["code"] == rpc.INVALID_PARAMS
    assert error["error"]["data"] == {"refusal": "invalid_params", "path": "$.workspace"}


@pytest.mark.parametrize("method", sorted(rpc.METHODS))
def test_missing_params_decode_as_an_empty_object(method: str) -> None:
    assert rpc.decode_call(request(method, id=4)) == rpc.decode_call(request(method, {}, id=4))


@pytest.mark.parametrize(
    "line",
    [
        b"{",
        b"not json",
        b'{"jsonrpc": "2.0",}',
        b"\xff\xfe",
        b'{"jsonrpc": "2.0", "id": 1, "method": "daemon.status"} x',
    ],
)
def test_parse_error(line: bytes) -> None:
    error = reply(rpc.decode_call(line))
    assert error["id"] is None
    assert error["error"]["code"] == rpc.PARSE_ERROR


@pytest.mark.parametrize(
    ("line", "expected_id"),
    [
        (b"[]", None),
        (b"1", None),
        (b'"x"', None),
        (b'{"jsonrpc": "2.0", "id": 7}', 7),
        (b'{"jsonrpc": "1.0", "id": 8, "method": "daemon.status"}', 8),
        (b'{"id": 9, "method": "daemon.status"}', 9),
        (b'{"jsonrpc": "2.0", "id": "s", "method": 5}', "s"),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "daemon.status", "extra": 1}', 1),
        (b'{"jsonrpc": "2.0", "id": 2, "method": "daemon.status", "params": [1]}', 2),
        (b'{"jsonrpc": "2.0", "id": true, "method": "daemon.status"}', None),
        (b'{"jsonrpc": "2.0", "id": 1.5, "method": "daemon.status"}', None),
        (b'{"jsonrpc": "2.0", "id": {"a": 1}, "method": "daemon.status"}', None),
    ],
)
def test_invalid_request(line: bytes, expected_id: Any) -> None:
    error = reply(rpc.decode_call(line))
    assert error["error"]["code"] == rpc.INVALID_REQUEST
    assert error["id"] == expected_id


def test_unknown_method() -> None:
    error = reply(rpc.decode_call(request("fs.nope", {}, id=3)))
    assert error["id"] == 3
    assert error["error"]["code"] == rpc.METHOD_NOT_FOUND
    assert "fs.nope" in error["error"]["message"]


def test_unknown_method_suggests_the_nearest_names() -> None:
    error = reply(rpc.decode_call(request("workspace.adpot", {}, id=1)))["error"]
    assert error["data"]["suggestions"][0] == "workspace.adopt"
    assert len(error["data"]["suggestions"]) <= rpc.SUGGESTIONS
    assert "did you mean workspace.adopt" in error["message"]


@pytest.mark.parametrize(
    ("name", "first"),
    [("fs.reed", "fs.read"), ("proc.runn", "proc.run"), ("discover", "rpc.discover")],
)
def test_suggest(name: str, first: str) -> None:
    assert rpc.suggest(name)[0] == first


def test_suggest_nothing_close_or_too_long() -> None:
    assert rpc.suggest("qqqqqqq") == []
    long = "fs.read" + "x" * rpc.SUGGEST_MAX_NAME
    assert rpc.suggest(long) == []
    error = reply(rpc.decode_call(request(long, {}, id=1)))["error"]
    assert error["data"] == {"suggestions": []}
    assert len(error["message"]) < 2 * rpc.SUGGEST_MAX_NAME


def test_notification_of_a_known_method_is_a_call_without_reply_id() -> None:
    call = rpc.decode_call(request("fs.stat", {"workspace": "w", "path": "a"}))
    assert isinstance(call, rpc.Call)
    assert call.is_notification and call.id is None


def test_notification_errors_get_no_reply() -> None:
    assert rpc.decode_call(request("fs.nope", {})) == rpc.Outcome(None)
    assert rpc.decode_call(request("fs.stat", {"workspace": 1})) == rpc.Outcome(None)


@pytest.mark.parametrize(
    ("method", "params", "path"),
    [
        ("fs.stat", {"workspace": 1, "path": "a"}, "$.workspace"),
        ("fs.stat", {"workspace": "w"}, "$.path"),
        ("fs.stat", {"workspace": "w", "path": "a", "bogus": 1}, "$.bogus"),
        ("fs.read", {"workspace": "w", "path": "a", "offset": "5"}, "$.offset"),
        ("fs.read", {"workspace": "w", "path": "a", "offset": -1}, "$.offset"),
        ("fs.read", {"workspace": "w", "path": "a", "length": 1.5}, "$.length"),
        ("fs.list", {"workspace": "w", "limit": 0}, "$.limit"),
        ("fs.walk", {"workspace": "w", "include_git": 1}, "$.include_git"),
        ("fs.search", {"workspace": "w", "pattern": ""}, "$.pattern"),
        ("fs.write", {"workspace": "w", "path": "a", "base_sha256": "abc"}, "$.base_sha256"),
        ("fs.write", {"workspace": "w", "path": "a", "content": "x"}, "$.base_sha256"),
        (
            "fs.write",
            {"workspace": "w", "path": "a", "base_sha256": None, "mode": 0o10000},
            "$.mode",
        ),
        (
            "fs.patch",
            {"workspace": "w", "path": "a", "base_sha256": SHA, "edits": [{"old": 1, "new": ""}]},
            "$.edits[0].old",
        ),
        (
            "fs.patch",
            {
                "workspace": "w",
                "path": "a",
                "base_sha256": SHA,
                "edits": [{"old": "a", "new": "b"}, {"old": "c", "new": "d", "x": 1}],
            },
            "$.edits[1].x",
        ),
        (
            "fs.patch",
            {"workspace": "w", "path": "a", "base_sha256": SHA, "edits": [{"new": "b"}]},
            "$.edits[0].old",
        ),
        ("workspace.adopt", {"path": "/x", "root_id": "Bad_Id"}, "$.root_id"),
        ("workspace.adopt", {"path": "/x", "policy": {"write_deny": 3}}, "$.policy.write_deny"),
        ("workspace.adopt", {"path": "/x", "policy": {"nope": []}}, "$.policy.nope"),
    ],
)
def test_invalid_params_names_the_field(method: str, params: dict[str, Any], path: str) -> None:
    error = reply(rpc.decode_call(request(method, params, id=11)))
    assert error["id"] == 11
    assert error["error"]["code"] == rpc.INVALID_PARAMS
    assert error["error"]["data"] == {"refusal": "invalid_params", "path": path}


def test_params_are_converted_to_the_struct() -> None:
    params = {
        "workspace": "w",
        "path": "a",
        "base_sha256": SHA,
        "edits": [{"old": "a", "new": "b", "count": 2}],
        "dry_run": True,
    }
    call = rpc.decode_call(request("fs.patch", params, id=1))
    assert isinstance(call, rpc.Call)
    assert isinstance(call.params, PatchParams)
    assert call.params.edits is not None and call.params.edits[0].count == 2
    assert call.params.dry_run is True


# --- replies ------------------------------------------------------------------------------------


def test_reply_result() -> None:
    line = rpc.reply_result(4, {"ok": True})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert msgspec.json.decode(line) == {"jsonrpc": "2.0", "id": 4, "result": {"ok": True}}


def test_reply_result_encodes_structs() -> None:
    line = rpc.reply_result("x", StatParams(workspace="w", path="p"))
    assert msgspec.json.decode(line)["result"] == {"workspace": "w", "path": "p", "hash": False}


def test_reply_error_without_and_with_data() -> None:
    assert msgspec.json.decode(rpc.reply_error(None, -32700, "bad")) == {
        "jsonrpc": "2.0",
        "id": None,
        "error": {"code": -32700, "message": "bad"},
    }
    decoded = msgspec.json.decode(rpc.reply_error(1, -1, "m", {"k": "v"}))
    assert decoded["error"]["data"] == {"k": "v"}


def test_refusal_error_carries_the_name_and_data() -> None:
    decoded = msgspec.json.decode(rpc.refusal_error(2, StaleBase("stale", current_sha256=SHA)))
    assert decoded == {
        "jsonrpc": "2.0",
        "id": 2,
        "error": {
            "code": -32001,
            "message": "stale",
            "data": {"refusal": "stale_base", "current_sha256": SHA},
        },
    }
    decoded = msgspec.json.decode(rpc.refusal_error(3, PathInvalid("no")))
    assert decoded["error"]["data"] == {"refusal": "path_invalid"}


def test_server_notification_has_no_id() -> None:
    decoded = msgspec.json.decode(rpc.notification("proc.exit", {"code": 0}))
    assert decoded == {"jsonrpc": "2.0", "method": "proc.exit", "params": {"code": 0}}


# --- nesting depth -------------------------------------------------------------------------------


def nested(depth: int, kind: str = "[") -> bytes:
    """A JSON value of exactly `depth` nested arrays (or objects, each under key "a")."""
    if kind == "[":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * (depth - 1) + b"{}" + b"}" * (depth - 1)


def status_with(value: bytes, id: int = 1) -> bytes:
    """daemon.status whose params hold `value` under key "a": value depth + 2 in all."""
    return b'{"jsonrpc":"2.0","id":%d,"method":"daemon.status","params":{"a":%s}}' % (id, value)


def test_nesting_counts_brackets_outside_strings_only() -> None:
    assert not rpc.nesting_exceeds(nested(64), 64)
    assert rpc.nesting_exceeds(nested(65), 64)
    assert rpc.nesting_exceeds(nested(65, "{"), 64)
    assert not rpc.nesting_exceeds(b'["' + b"[" * 1000 + b'"]', 64)
    # An escaped quote does not end the string early.
    assert not rpc.nesting_exceeds(b'["\\"' + b"[" * 100 + b'"]', 64)
    assert not rpc.nesting_exceeds(b'["\\\\", ' + nested(62) + b"]", 64)
    # An unterminated string runs to the end of the line, as it would for a parser.
    assert not rpc.nesting_exceeds(b'["' + b"[" * 100, 64)
    assert rpc.nesting_exceeds(b"[" * 65 + b'"' + b'\\"' * 1000, 64)
    # Openers and closers of any kind count against each other; unclosed ones count.
    assert rpc.nesting_exceeds(b"[{" * 40, 64)
    assert not rpc.nesting_exceeds(b"[]{}" * 1000, 64)


@pytest.mark.parametrize(
    "line",
    [
        nested(1000),  # the 2 KB line that used to end the daemon
        nested(100_000),
        b"[" * 100_000,  # never closed
        status_with(nested(1000)),
        status_with(nested(1000, "{")),
        status_with(nested(63)),  # 65 levels with the envelope and params
        b'{"jsonrpc":"2.0","id":' + nested(1000) + b',"method":"daemon.status"}',
    ],
    ids=["arrays", "arrays-100k", "unclosed", "params", "params-objects", "one-over", "in-id"],
)
def test_too_deep_is_refused_by_name_without_parsing(line: bytes) -> None:
    error = reply(rpc.decode_call(line))
    assert error["id"] is None
    assert error["error"]["code"] == -32001
    assert error["error"]["data"] == {"refusal": "request_too_deep", "limit": rpc.MAX_DEPTH}


def test_depth_at_the_limit_is_parsed() -> None:
    # 62 + params + envelope = 64 levels: decoded, then refused for its unknown field.
    error = reply(rpc.decode_call(status_with(nested(62), id=4)))
    assert error["id"] == 4
    assert error["error"]["data"] == {"refusal": "invalid_params", "path": "$.a"}
    # Brackets in strings are text, whatever their number.
    error = reply(rpc.decode_call(status_with(b'"' + b"[" * 5000 + b'"', id=5)))
    assert error["error"]["data"] == {"refusal": "invalid_params", "path": "$.a"}


# --- integers out of range -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "params", "path"),
    [
        ("journal.read", {"since": 2**63}, "$.since"),
        ("journal.read", {"since": 10**40}, "$.since"),
        ("journal.read", {"limit": -(2**63) - 1}, "$.limit"),
        ("fs.read", {"workspace": "w", "path": "a", "offset": 2**64}, "$.offset"),
        (
            "fs.patch",
            {"workspace": "w", "path": "a", "base_sha256": SHA, "edits": [{"count": 2**63}]},
            "$.edits[0].count",
        ),
        ("daemon.status", {"x": [1, {"y": 2**70}]}, "$.x[1].y"),
    ],
)
def test_integer_outside_64_bits_is_invalid_params(
    method: str, params: dict[str, Any], path: str
) -> None:
    error = reply(rpc.decode_call(request(method, params, id=12)))
    assert error["id"] == 12
    assert error["error"]["code"] == rpc.INVALID_PARAMS
    assert error["error"]["data"] == {"refusal": "invalid_params", "path": path}
    # As a notification: no reply, like any invalid params.
    assert rpc.decode_call(request(method, params)) == rpc.Outcome(None)


def test_64_bit_integers_pass() -> None:
    call = rpc.decode_call(request("journal.read", {"since": 2**63 - 1}, id=1))
    assert isinstance(call, rpc.Call) and call.params.since == 2**63 - 1
    # Long digit runs inside strings are not integers.
    call = rpc.decode_call(request("journal.read", {"workspace": "9" * 40}, id=1))
    assert isinstance(call, rpc.Call) and call.params.workspace == "9" * 40


def test_out_of_range_int_walks_every_container() -> None:
    assert rpc.out_of_range_int({"a": [0, -(2**63), 2**63 - 1, True, 1.5e300]}) is None
    assert rpc.out_of_range_int([[[], {"k": [2**63]}]]) == "$[0][1].k[0]"


def test_decoding_outcomes_name_the_refusal_and_method_for_the_log() -> None:
    """What the server's debug line says of a request refused at decoding."""
    unknown = rpc.decode_call(request("fs.nope", {}, id=1))
    assert isinstance(unknown, rpc.Outcome)
    assert (unknown.refusal, unknown.method) == ("method_not_found", None)
    bad = rpc.decode_call(request("fs.stat", {"workspace": 1}, id=2))
    assert isinstance(bad, rpc.Outcome)
    assert (bad.refusal, bad.method) == ("invalid_params", "fs.stat")
    garbage = rpc.decode_call(b"{nope")
    assert isinstance(garbage, rpc.Outcome) and garbage.refusal == "parse_error"
