"""A scripted model server: the Anthropic Messages API and the OpenAI Responses API, both
streamed as server-sent events, answering from a script instead of a model.

Standard library only (it runs inside a sandbox under the image's python3). The script
is a JSON list of steps; the n-th request that offers tools gets step n:
  {"text": "..."}                                  a text reply that ends the turn
  {"tool": NAME, "input": {...}}                   Anthropic: a tool_use block
  {"function": NAME, "arguments": {...}}           OpenAI: a function_call item
  {"custom": NAME, "input": "..."}                 OpenAI: a custom_tool_call item
  {"hang": true}                                   never answer (a model that hangs)
  {"garbage": true}                                a stream that is not SSE JSON
Past the script, or for a request that offers no tools (titles, summaries): a short
text reply. Each request's path, model and the tool results it carries are appended to
the log file as a JSON line (never the prompt).

    python3 scripted_model.py --port 0 --script steps.json --log requests.jsonl --port-file port

`--exit-after S`: exit S seconds after the script's last step was served (a server that
shares the CLI's sandbox must end for the turn's changes to conclude).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Script:
    def __init__(
        self, steps: list[dict[str, Any]], log_path: str | None, exit_after: float | None = None
    ) -> None:
        self.steps = steps
        self.log_path = log_path
        self.exit_after = exit_after
        self.lock = threading.Lock()
        self.served = 0

    def next_step(self, offers_tools: bool) -> dict[str, Any]:
        with self.lock:
            if not offers_tools or self.served >= len(self.steps):
                return {"text": "Done."}
            step = self.steps[self.served]
            self.served += 1
            if self.served == len(self.steps) and self.exit_after is not None:
                threading.Timer(self.exit_after, os._exit, args=(0,)).start()
            return step

    def log(self, record: dict[str, Any]) -> None:
        if self.log_path is None:
            return
        with self.lock, open(self.log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def _tool_results_anthropic(body: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for message in body.get("messages") or []:
        content = message.get("content")
        if isinstance(content, list):
            for block in content:
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    found.append(
                        {"id": block.get("tool_use_id"), "is_error": bool(block.get("is_error"))}
                    )
    return found


def _tool_results_openai(body: dict[str, Any]) -> list[dict[str, Any]]:
    items = body.get("input")
    if not isinstance(items, list):
        return []
    return [
        {"id": it.get("call_id"), "type": it.get("type")}
        for it in items
        if isinstance(it, dict)
        and it.get("type") in ("function_call_output", "custom_tool_call_output")
    ]


def _offers_tools_openai(body: dict[str, Any]) -> bool:
    if body.get("tools"):
        return True
    return any(
        isinstance(it, dict) and it.get("type") == "additional_tools"
        for it in body.get("input") or []
    )


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    script: Script

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = {}
        path = self.path.split("?")[0]
        if path.endswith("/messages"):
            offers = bool(body.get("tools"))
            results = _tool_results_anthropic(body)
            api = "anthropic"
        elif path.endswith("/responses"):
            offers = _offers_tools_openai(body)
            results = _tool_results_openai(body)
            api = "openai"
        else:
            self.send_response(404)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        step = self.script.next_step(offers)
        self.script.log(
            {"api": api, "path": path, "model": body.get("model"), "tools": offers,
             "tool_results": results, "step": step if offers else None}
        )  # fmt: skip
        if step.get("hang"):
            time.sleep(3600)
            return
        if not body.get("stream"):
            self._json(api, step, body)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("connection", "close")
        self.end_headers()
        if step.get("garbage"):
            self.wfile.write(b"data: {not json\n\n")
        elif api == "anthropic":
            self._anthropic_stream(step, body)
        else:
            self._openai_stream(step, body)
        self.wfile.flush()
        self.close_connection = True

    # -- Anthropic Messages ------------------------------------------------------------

    def _event(self, name: str, data: dict[str, Any]) -> None:
        self.wfile.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())

    def _anthropic_stream(self, step: dict[str, Any], body: dict[str, Any]) -> None:
        msg_id = f"msg_{time.monotonic_ns()}"
        self._event("message_start", {"type": "message_start", "message": {
            "id": msg_id, "type": "message", "role": "assistant", "model": body.get("model"),
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 12, "output_tokens": 1}}})  # fmt: skip
        if "tool" in step:
            block = {"type": "tool_use", "id": f"toolu_{time.monotonic_ns()}",
                     "name": step["tool"], "input": {}}  # fmt: skip
            self._event("content_block_start", {"type": "content_block_start", "index": 0,
                                                "content_block": block})  # fmt: skip
            self._event("content_block_delta", {"type": "content_block_delta", "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": json.dumps(step["input"])}})  # fmt: skip
            stop = "tool_use"
        else:
            self._event("content_block_start", {"type": "content_block_start", "index": 0,
                                                "content_block": {"type": "text", "text": ""}})  # fmt: skip
            self._event("content_block_delta", {"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": step.get("text", "Done.")}})  # fmt: skip
            stop = "end_turn"
        self._event("content_block_stop", {"type": "content_block_stop", "index": 0})
        self._event("message_delta", {"type": "message_delta",
            "delta": {"stop_reason": stop, "stop_sequence": None}, "usage": {"output_tokens": 7}})  # fmt: skip
        self._event("message_stop", {"type": "message_stop"})

    # -- OpenAI Responses --------------------------------------------------------------

    def _openai_stream(self, step: dict[str, Any], body: dict[str, Any]) -> None:
        resp_id = f"resp_{time.monotonic_ns()}"
        response = {"id": resp_id, "object": "response", "status": "in_progress", "output": []}

        def ev(data: dict[str, Any]) -> None:
            self._event(data["type"], data)

        ev({"type": "response.created", "response": response})
        if "function" in step:
            item = {"type": "function_call", "id": f"fc_{resp_id}", "call_id": f"call_{resp_id}",
                    "name": step["function"], "arguments": json.dumps(step["arguments"]),
                    "status": "completed"}  # fmt: skip
        elif "custom" in step:
            item = {"type": "custom_tool_call", "id": f"ctc_{resp_id}", "call_id": f"call_{resp_id}",
                    "name": step["custom"], "input": step["input"], "status": "completed"}  # fmt: skip
        else:
            text = step.get("text", "Done.")
            item = {"type": "message", "id": f"msg_{resp_id}", "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}  # fmt: skip
            ev({"type": "response.output_item.added", "output_index": 0,
                "item": {**item, "status": "in_progress", "content": []}})  # fmt: skip
            ev({"type": "response.output_text.delta", "item_id": item["id"], "output_index": 0,
                "content_index": 0, "delta": text})  # fmt: skip
        if item["type"] != "message":
            ev({"type": "response.output_item.added", "output_index": 0, "item": item})
        ev({"type": "response.output_item.done", "output_index": 0, "item": item})
        ev({"type": "response.completed", "response": {**response, "status": "completed",
            "output": [item], "usage": {"input_tokens": 12, "output_tokens": 7,
            "total_tokens": 19, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}}})  # fmt: skip

    def _json(self, api: str, step: dict[str, Any], body: dict[str, Any]) -> None:
        if api == "anthropic":
            out = {"id": "msg_json", "type": "message", "role": "assistant",
                   "model": body.get("model"),
                   "content": [{"type": "text", "text": step.get("text", "Done.")}],
                   "stop_reason": "end_turn", "stop_sequence": None,
                   "usage": {"input_tokens": 1, "output_tokens": 1}}  # fmt: skip
        else:
            out = {"id": "resp_json", "object": "response", "status": "completed", "output": []}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--script", required=True)
    parser.add_argument("--log")
    parser.add_argument("--port-file")
    parser.add_argument("--exit-after", type=float)
    args = parser.parse_args()
    with open(args.script, encoding="utf-8") as f:
        steps = json.load(f)
    Handler.script = Script(steps, args.log, args.exit_after)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    if args.port_file:
        with open(args.port_file + ".tmp", "w") as f:
            f.write(str(server.server_address[1]))
        os.replace(args.port_file + ".tmp", args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
