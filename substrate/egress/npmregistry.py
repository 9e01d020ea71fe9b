"""The `@npm-registry` allow-list token: the registries this machine's npm uses.

Like `@pip-index` (`substrate.egress.pipindex`): a profile writes `egress_allow =
["@npm-registry"]` instead of naming a registry, and when profiles load the token becomes
the host names npm's own configuration names, read from npm itself, so no host is written
in substrate's code or docs.

How: one subprocess, `npm config list --json` (an argv list, cwd `/` so that no project's
`.npmrc` is read, a 30 s limit, the daemon's npm-relevant environment: `HOME`, `PATH`,
`npm_config_*`/`NPM_CONFIG_*`), which prints npm's effective configuration, its built-in
default registry included. `hosts_from` then keeps (pure) the `registry` and every scoped
`@scope:registry`, http(s) only, host names only.

Costs about 0.3 s (node's start), once per process and environment (cached). A failure
(no npm on this host, a timeout, unreadable output) resolves the token to nothing and says
why: the profile then has no way out to npm, which is safe, and the log says so.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import urllib.parse
from collections.abc import Mapping
from typing import Any

from substrate.egress.allow import normalise_host

#: The token and what it stands for.
NPM_REGISTRY = "@npm-registry"
#: Longest wait for the npm subprocess.
NPM_TIMEOUT_S = 30.0
#: Environment variables that change what npm reads (the cache key), beside npm_config_*.
_NPM_ENV = ("HOME", "PATH", "XDG_CONFIG_HOME", "PREFIX")


def hosts_from(config: Mapping[str, Any]) -> list[str]:
    """The registry hosts in npm's configuration `config` (`npm config list --json`):
    `registry` and every `@scope:registry`. Sorted, distinct; http(s) only. Pure."""
    urls = [
        value
        for key, value in config.items()
        if isinstance(value, str) and (key == "registry" or _scoped_registry(key))
    ]
    return sorted({h for h in (_http_host(u) for u in urls) if h})


def _scoped_registry(key: str) -> bool:
    scope, _, name = key.partition(":")
    return scope.startswith("@") and len(scope) > 1 and name == "registry"


def _http_host(url: str) -> str | None:
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        return None
    return normalise_host(parts.hostname)


def npm_registry_hosts(env: Mapping[str, str] | None = None) -> tuple[list[str], str | None]:
    """(hosts, why empty) of `@npm-registry` on this host for the environment `env` (the
    daemon's by default). Never raises; cached per distinct npm-relevant environment."""
    env = os.environ if env is None else env
    relevant = tuple(
        sorted(
            (k, v) for k, v in env.items() if k in _NPM_ENV or k.lower().startswith("npm_config_")
        )
    )
    return _resolve(relevant)


@functools.lru_cache(maxsize=8)
def _resolve(relevant: tuple[tuple[str, str], ...]) -> tuple[list[str], str | None]:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", **dict(relevant)}
    env["NO_UPDATE_NOTIFIER"] = "1"
    env["npm_config_update_notifier"] = "false"
    npm = shutil.which("npm", path=env["PATH"])
    if npm is None:
        return [], "npm is not installed on this host"
    try:
        done = subprocess.run(
            [npm, "config", "list", "--json"],
            cwd="/",
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=NPM_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], f"npm's configuration could not be read: {type(exc).__name__}"
    if done.returncode != 0:
        tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
        return [], f"npm's configuration could not be read: {' '.join(tail)[:200]}"
    try:
        config: Any = json.loads(done.stdout)
    except ValueError:
        return [], "npm's configuration could not be read: unexpected output"
    if not isinstance(config, dict):
        return [], "npm's configuration could not be read: unexpected output"
    hosts = hosts_from(config)
    return hosts, None if hosts else "npm names no http(s) registry"
