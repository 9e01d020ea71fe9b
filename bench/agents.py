"""A scripted 10-tool-call turn of each agent CLI: in substrate vs the same CLI on the host.

    python3 bench/agents.py [--runs 3] [--provider claude-code|codex|both]

Both CLIs are the real ones (`@anthropic-ai/claude-code`, `@openai/codex`, the versions
the engine tests pin), against the scripted model server (tests/agents/scripted_model.py)
on a loopback: on the host, the CLI installed with npm into a cache directory and run in
a scratch checkout; in substrate, installed by the `setup` profile into the workspace's
home and run as an agent turn (`agent.start`, the turn's command waited for with
`proc.wait`), the server in the same sandbox. The script is the same ten tool calls
(Claude Code: five Write, five Bash; Codex: five patches, five shell commands) and a
final text. Prints the medians, their ratio and the time substrate adds per tool call.
Needs the engine, the images (`substrate image build`) and the npm registry.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchdaemon import REPO, BenchDaemon
from substrate.protocol.client import Client

SCRIPTED = REPO / "tests" / "agents" / "scripted_model.py"
PACKAGES = {"claude-code": "@anthropic-ai/claude-code@2.1.332", "codex": "@openai/codex@0.171.0"}
PROGRAM = {"claude-code": "claude", "codex": "codex"}
CACHE = Path(os.environ.get("SUBSTRATE_BENCH_CACHE", "/var/cache/substrate-bench"))
PORT = 18191


def steps(provider: str) -> list[dict[str, Any]]:
    """Ten tool calls and a final text, in the CLI's API's own shapes."""
    out: list[dict[str, Any]] = []
    for i in range(5):
        if provider == "claude-code":
            out.append(
                {
                    "tool": "Write",
                    "input": {"file_path": f"/workspace/src/f{i}.py", "content": f"X = {i}\n"},
                }
            )
            out.append({"tool": "Bash", "input": {"command": "true", "description": "noop"}})
        else:
            patch = f"*** Begin Patch\n*** Add File: src/f{i}.py\n+X = {i}\n*** End Patch\n"
            out.append(
                {
                    "custom": "exec",
                    "input": f"text(JSON.stringify(await tools.apply_patch({json.dumps(patch)})));",
                }
            )
            out.append(
                {
                    "custom": "exec",
                    "input": 'text(JSON.stringify(await tools.exec_command({cmd: "true"})));',
                }
            )
    return [*out, {"text": "Done."}]


def argv_for(provider: str, base_url: str) -> list[str]:
    if provider == "claude-code":
        return ["-p", "--output-format", "stream-json", "--verbose", "--permission-mode", "acceptEdits",
                "--allowedTools", "Bash(true)"]  # fmt: skip
    provider_cfg = (
        f'{{name="b", base_url="{base_url}/v1", env_key="OPENAI_API_KEY", wire_api="responses"}}'
    )
    return ["exec", "--json", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
            "-c", f"model_providers.b={provider_cfg}", "-c", "model_provider=b", "-"]  # fmt: skip


def host_cli(provider: str) -> Path:
    """The CLI installed with npm into the cache (once)."""
    prefix = CACHE / "npm"
    binary = prefix / "node_modules" / ".bin" / PROGRAM[provider]
    if not binary.exists():
        prefix.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix), PACKAGES[provider]],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def host_turn(provider: str, work: Path) -> float:
    """One turn on the host (server and CLI both here); wall seconds of the CLI."""
    cli = host_cli(provider)
    checkout, home = work / "checkout", work / "home"
    shutil.rmtree(work, ignore_errors=True)
    (checkout / "src").mkdir(parents=True)
    home.mkdir()
    script = work / "steps.json"
    script.write_text(json.dumps(steps(provider)))
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, str(SCRIPTED), "--port", str(port), "--script", str(script)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(0.3)
        base = f"http://127.0.0.1:{port}"
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8",
               "ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "sk-bench", "OPENAI_API_KEY": "sk-bench",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}  # fmt: skip
        started = time.perf_counter()
        done = subprocess.run(
            [str(cli), *argv_for(provider, base)], input=b"make ten files", cwd=checkout, env=env,
            capture_output=True, timeout=300, check=False,
        )  # fmt: skip
        elapsed = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"host {provider} failed: {done.stderr.decode()[-500:]}")
        return elapsed
    finally:
        server.kill()
        server.wait()


def profiles_dir(base: Path) -> Path:
    out = base / "profiles"
    out.mkdir()
    for name in ("default", "setup"):
        shutil.copy(REPO / "profiles" / f"{name}.toml", out / f"{name}.toml")
    swaps = {
        "claude-code": {
            'egress_inject = { "api.anthropic.com" = { header = "x-api-key", secret = "anthropic" } }': "egress_inject = {}",
            'ANTHROPIC_API_KEY = "set-by-the-egress-proxy"': f'ANTHROPIC_API_KEY = "sk-bench", ANTHROPIC_BASE_URL = "http://127.0.0.1:{PORT}"',
            'argv_allow = ["claude"]': 'argv_allow = ["claude", "python3"]',
            'egress_allow = ["api.anthropic.com"]': "egress_allow = []",
        },
        "codex": {
            'egress_inject = { "api.openai.com" = { header = "authorization", secret = "openai" } }': "egress_inject = {}",
            'OPENAI_API_KEY = "set-by-the-egress-proxy"': f'OPENAI_API_KEY = "sk-bench", OPENAI_BASE_URL = "http://127.0.0.1:{PORT}/v1"',
            'argv_allow = ["codex"]': 'argv_allow = ["codex", "python3"]',
            'egress_allow = ["api.openai.com"]': "egress_allow = []",
        },
    }  # fmt: skip
    for name, changes in swaps.items():
        text = (REPO / "profiles" / f"{name}.toml").read_text()
        changes = {
            **changes,
            'network = "egress"': 'network = "none"',
            'ca_bundle = "host"': 'ca_bundle = ""',
        }
        for old, new in changes.items():
            assert old in text, old
            text = text.replace(old, new)
        (out / f"{name}.toml").write_text(text)
    return out


def substrate_turns(provider: str, runs: int, base: Path) -> list[float]:
    d = BenchDaemon(base, ["--profiles", str(profiles_dir(base))])
    try:
        checkout = d.roots / "project"
        (checkout / "src").mkdir(parents=True)
        (checkout / "tools").mkdir()
        shutil.copy(SCRIPTED, checkout / "tools" / "scripted_model.py")
        (checkout / "tools" / "steps.json").write_text(json.dumps(steps(provider)))
        for root, dirs, files in os.walk(checkout):
            for name in [*dirs, *files, "."]:
                os.chown(os.path.join(root, name), 1000, 1000)
        c = Client(d.socket, timeout=900)
        ws = c.call("workspace.adopt", path=str(checkout))["workspace"]
        done = c.call(
            "proc.run",
            workspace=ws,
            profile="setup",
            argv=["npm", "install", "-g", PACKAGES[provider]],
            timeout_s=600,
        )
        if done["exit_code"] != 0:
            raise SystemExit(f"npm install failed: {done['stderr']}")
        out: list[float] = []
        for _ in range(runs):
            c.call(
                "proc.run",
                workspace=ws,
                profile=provider,
                argv=[
                    "python3",
                    "-c",
                    "import os; [os.remove(p) for p in ('/tmp/model.port',) if os.path.exists(p)]",
                ],
                changes="discard",
            )
            server = c.call("proc.start", workspace=ws, profile=provider, argv=[
                "python3", "tools/scripted_model.py", "--port", str(PORT), "--script", "tools/steps.json",
                "--port-file", "/tmp/model.port", "--exit-after", "1"])["proc"]  # fmt: skip
            while c.call(
                "proc.run",
                workspace=ws,
                profile=provider,
                changes="discard",
                argv=[
                    "python3",
                    "-c",
                    "import os,sys; sys.exit(0 if os.path.exists('/tmp/model.port') else 1)",
                ],
            )["exit_code"]:
                time.sleep(0.1)
            started = time.perf_counter()
            turn = c.call(
                "agent.start",
                workspace=ws,
                provider=provider,
                prompt="make ten files",
                changes="apply",
            )
            result = c.call("proc.wait", proc=turn["proc"])
            out.append(time.perf_counter() - started)
            if result["exit_code"] != 0:
                raise SystemExit(f"substrate {provider} failed: {result['stderr']}")
            c.call("proc.wait", proc=server)
            c.call("agent.wait", turn=turn["turn"])
        c.close()
        return out
    finally:
        d.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--provider", choices=["claude-code", "codex", "both"], default="both")
    args = parser.parse_args()
    providers = ["claude-code", "codex"] if args.provider == "both" else [args.provider]
    print("provider      host p50   substrate p50   ratio   added per tool call")
    for provider in providers:
        with tempfile.TemporaryDirectory(prefix="bench-agents-") as tmp:
            base = Path(tmp)
            host = [host_turn(provider, base / f"host-{i}") for i in range(args.runs)]
            (base / "daemon").mkdir()
            inside = substrate_turns(provider, args.runs, base / "daemon")
        h, s = statistics.median(host), statistics.median(inside)
        print(
            f"{provider:12s} {h * 1000:8.0f} ms {s * 1000:10.0f} ms   {s / h:5.2f}   {(s - h) * 100:8.0f} ms"
        )


if __name__ == "__main__":
    main()
