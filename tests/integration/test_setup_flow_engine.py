"""Substrate's own unit tests pass inside its sandbox after a set-up (docs/environments.md).

A clone of this repository (its HEAD: `git clone --no-hardlinks`, owned by uid 1000) is
adopted by a daemon in this process with the shipped `setup` and `default` profiles:

1. before any set-up, `default` runs tests/workspace/test_policy.py and tests/fs/test_paths.py with
   the image's `python3` and they cannot even load (no msgspec there);
2. `setup` makes a venv in the workspace's persistent home and installs what those two
   files import and the image lacks (msgspec, trio, google-re2, pytest, pytest-trio, at the versions
   pyproject.toml declares: not the whole dev extra), downloaded from the package index
   this machine's pip uses, through the daemon's egress proxy;
3. `default` (no network: `lo` only, no route) runs them with the venv's Python: every
   one passes, and nothing lands in the checkout (`-B`, no cache provider);
4. the workspace is released (its containers go, the home stays) and adopted again, and
   the same set-up run again finds everything in the home's venv: pip says
   "Requirement already satisfied" for each, and downloads nothing. (A *new* venv would
   download again on this machine: its inspecting proxy strips the index's caching
   headers, so pip's HTTP cache keeps nothing; docs/environments.md.)

Network reached: the package index, only through the proxy (the proxy's resolver
records every name it is asked: only the index's hosts are). Costs about a minute, most
of it pip (~5 MB downloaded once).
"""

from __future__ import annotations

import re
import shutil
import tomllib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from substrate.config import PROJECT_ROOT
from substrate.egress.pipindex import pip_index_hosts
from substrate.egress.proxy import Addresses
from substrate.protocol.client import AsyncClient, open_client
from tests.harness import snapshot_tree
from tests.harness.engine import remove_daemon_containers
from tests.harness.inprocess import in_process_config, serving
from tests.harness.workspaces import chown_tree, remove_tree, short_tempdir

pytestmark = pytest.mark.slow

#: What the two test files import beyond the standard library and the image's Python
#: (through the harness: the protocol server counts requests for the metrics page, and
#: the harness starts PostgreSQL for the export tests).
NEEDED = (
    "msgspec", "trio", "google-re2", "h11", "prometheus_client", "psycopg", "pytest", "pytest-trio",
)  # fmt: skip
TESTS = ["tests/workspace/test_policy.py", "tests/fs/test_paths.py"]
#: pytest with nothing written into the checkout: no bytecode, no .pytest_cache.
PYTEST = ["-B", "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS]


def requirements() -> list[str]:
    """The `NEEDED` requirements as pyproject.toml declares them (runtime or dev pins)."""
    project = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    picked = [r for r in declared if re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0] in NEEDED]
    assert len(picked) == len(NEEDED), picked
    return picked


@dataclass
class Flow:
    client: AsyncClient
    checkout: Path
    ws: str = ""
    resolved: set[str] = field(default_factory=set)

    async def adopt(self) -> None:
        self.ws = (await self.client.call("workspace.adopt", path=str(self.checkout)))["workspace"]

    async def run(self, profile: str, argv: list[str]) -> dict[str, Any]:
        result: dict[str, Any] = await self.client.call(
            "proc.run", workspace=self.ws, profile=profile, argv=argv
        )
        assert "egress_blocked" not in result
        return result

    async def setup(self, venv: str) -> str:
        """A venv at `venv` and the requirements in it, with `setup`; pip's output."""
        made = await self.run("setup", ["python3", "-m", "venv", "--system-site-packages", venv])
        assert made["exit_code"] == 0, text(made)
        pip = await self.run("setup", [f"{venv}/bin/pip", "install", *requirements()])
        assert pip["exit_code"] == 0, text(pip)
        return text(pip)


def text(result: dict[str, Any]) -> str:
    """stdout then stderr of a `proc.run` result (both inline at these sizes)."""
    out, err = result["stdout"], result["stderr"]
    assert "inline" in out and "inline" in err
    return str(out["inline"]) + str(err["inline"])


@pytest.fixture
def base(docker_client: Any) -> Iterator[Path]:
    # A short path: the state dir's sockets must fit in 108 bytes.
    made = short_tempdir("sbst-flow-")
    yield made
    remove_daemon_containers(docker_client, made / "state")
    remove_tree(made)


@pytest.fixture
async def flow(
    sandbox_image: str, base: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Flow]:
    monkeypatch.setenv("DOCKER_HOST", "unix:///var/run/docker.sock")
    profiles = base / "profiles"
    profiles.mkdir()
    for name in ("default", "setup"):
        shutil.copy(PROJECT_ROOT / "profiles" / f"{name}.toml", profiles / f"{name}.toml")
    checkout = base / "roots" / "substrate"
    checkout.parent.mkdir()
    with trio.fail_after(120):
        await trio.run_process(
            ["git", "clone", "--quiet", "--no-hardlinks", str(PROJECT_ROOT), str(checkout)]
        )
    chown_tree(checkout)
    state = base / "state"
    state.mkdir(mode=0o700)
    config = in_process_config(state, checkout.parent, profiles)
    async with serving(config) as daemon, open_client(state / "substrate.sock") as client:
        made = Flow(client, checkout)
        system = daemon.egress.resolve

        async def recording(host: str, port: int) -> Addresses:
            made.resolved.add(host)
            return await system(host, port)

        daemon.egress.resolve = recording
        await made.adopt()
        yield made


async def test_substrates_own_tests_pass_in_its_sandbox_after_setup(flow: Flow) -> None:
    before = snapshot_tree(flow.checkout)
    bare = await flow.run("default", ["python3", *PYTEST])
    assert bare["exit_code"] != 0
    assert "No module named 'msgspec'" in text(bare)

    first = await flow.setup("/home/agent/venv")
    assert re.search(r"^\s*Downloading msgspec-", first, re.M), first
    assert re.search(r"^Successfully installed .*\bmsgspec-", first, re.M), first

    probe = await flow.client.call("facts.probe", workspace=flow.ws, profile="default")
    facts = {f["name"]: f["value"] for f in probe["facts"]}
    assert facts["net_links"] == ["lo"] and facts["net_routes"] == []
    assert "egress_listeners" not in facts
    tested = await flow.run("default", ["/home/agent/venv/bin/python", *PYTEST])
    out = text(tested)
    assert tested["exit_code"] == 0, out
    summary = out.strip().splitlines()[-1]
    # Every test passed: no failure, error, skip or warning on the summary line.
    passed = re.fullmatch(r"(\d+) passed in [\d.]+s", summary)
    assert passed is not None and int(passed.group(1)) >= 100, summary
    assert snapshot_tree(flow.checkout) == before  # the venv is in the home, not here

    # The same set-up again from the warm home, in new containers: nothing to fetch.
    released = await flow.client.call("workspace.release", workspace=flow.ws)
    assert released["home"] == "kept"
    await flow.adopt()
    second = await flow.setup("/home/agent/venv")
    assert "Downloading" not in second and "Successfully installed" not in second, second
    for name in NEEDED:
        assert re.search(
            rf"^Requirement already satisfied: {re.escape(name)}[<>=!~ \[]", second, re.M
        ), second

    hosts, why = pip_index_hosts()
    assert why is None
    assert flow.resolved and flow.resolved <= set(hosts), (flow.resolved, hosts)
    entries = (await flow.client.call("journal.read", since=0, limit=10000))["entries"]
    assert [e for e in entries if e["kind"] == "egress.denied"] == []
    info = await flow.client.call("workspace.info", workspace=flow.ws)
    assert info["home"]["files"] > 1000  # the venv with its packages
