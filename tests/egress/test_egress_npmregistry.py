"""`@npm-registry`: the registries npm's own configuration names, resolved at load."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from substrate.egress import npmregistry
from substrate.egress.npmregistry import hosts_from, npm_registry_hosts
from substrate.sandbox.profiles import load_profile

ROOT = Path(__file__).resolve().parents[2]


def test_hosts_from_keeps_the_registry_and_scoped_ones_http_only() -> None:
    config = {
        "registry": "https://Registry.Example/npm/",
        "@corp:registry": "http://npm.corp.example:8080/",
        "@local:registry": "file:///srv/npm",
        "@bad:registry": "not a url",
        "https-proxy": "http://proxy.example:3128",
        "cache": "/root/.npm",
        "@corp:always-auth": True,
    }
    assert hosts_from(config) == ["npm.corp.example", "registry.example"]
    assert hosts_from({}) == []


def _fake_npm(tmp_path: Path, output: str, code: int = 0) -> dict[str, str]:
    """A PATH whose `npm` prints `output` (the real node is not needed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    npm = bin_dir / "npm"
    npm.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}\nEOF\nexit {code}\n")
    npm.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}


def test_resolved_from_npm_itself(tmp_path: Path) -> None:
    npmregistry._resolve.cache_clear()
    config = {"registry": "https://mirror.example/", "@x:registry": "https://x.example/"}
    env = _fake_npm(tmp_path, json.dumps(config))
    assert npm_registry_hosts(env) == (["mirror.example", "x.example"], None)


@pytest.mark.parametrize(
    ("output", "code", "why"),
    [
        ("oops", 0, "unexpected output"),
        ("[]", 0, "unexpected output"),
        ("{}", 1, "could not be read"),
        ('{"registry": "file:///x"}', 0, "no http(s) registry"),
    ],
)
def test_a_failure_resolves_to_nothing_and_says_why(
    tmp_path: Path, output: str, code: int, why: str
) -> None:
    npmregistry._resolve.cache_clear()
    hosts, reason = npm_registry_hosts(_fake_npm(tmp_path, output, code))
    assert hosts == []
    assert reason is not None and why in reason


def test_no_npm_resolves_to_nothing(tmp_path: Path) -> None:
    npmregistry._resolve.cache_clear()
    assert npm_registry_hosts({"PATH": str(tmp_path)}) == ([], "npm is not installed on this host")


def test_this_hosts_npm_names_its_registry() -> None:
    # scripts/setup installs node and npm (the TypeScript client's tests need them).
    assert shutil.which("npm") is not None
    npmregistry._resolve.cache_clear()
    hosts, why = npm_registry_hosts(os.environ)
    assert why is None and hosts, hosts


def test_the_token_is_accepted_and_replaced_at_load(tmp_path: Path) -> None:
    body = (ROOT / "profiles" / "setup.toml").read_text()
    body = body.replace(
        'egress_allow = ["@pip-index", "@npm-registry"]',
        'egress_allow = ["@npm-registry", "a.example"]',
    )
    (tmp_path / "p.toml").write_text(body)
    loaded = load_profile(
        tmp_path / "p.toml", ROOT / "seccomp", npm_registry=lambda: (["r.example"], None)
    )
    assert loaded.egress_allow == ["a.example", "r.example"]
    nothing = load_profile(
        tmp_path / "p.toml", ROOT / "seccomp", npm_registry=lambda: ([], "no npm")
    )
    assert nothing.egress_allow == ["a.example"]
