"""The `@npm-registry` allow-list token: the registry this machine's npm uses.

Like `@pip-index` (`egress.pipindex`): a profile writes `egress_allow =
["@npm-registry"]` and, when profiles load, the token becomes the host of the registry
npm's own configuration names — `npm config get registry`, which reads its `.npmrc`
files and `npm_config_*` environment the way every npm command does — so no registry
host is written in substrate's code or docs. npm serves package tarballs from the
registry's own host, so that one host is the way out.

How: one subprocess, `npm config get registry` (an argv list, cwd `/`, the daemon's
`PATH` and `HOME` and the npm variables only, a 30 s limit). Cached per distinct
environment. A failure (no npm on this host, a timeout, a registry that is not http(s))
resolves the token to nothing and says why: the profile then has no way out, which is
safe, and the log says so.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Mapping

from substrate.egress.pipindex import PIP_INDEX, http_host

#: The token.
NPM_REGISTRY = "@npm-registry"
#: Every token a profile's `egress_allow` may hold instead of a host.
TOKENS = (PIP_INDEX, NPM_REGISTRY)
#: Longest wait for npm.
NPM_TIMEOUT_S = 30.0
#: Variables that change what npm reads (besides `npm_config_*` / `NPM_CONFIG_*`).
_NPM_ENV = ("HOME", "XDG_CONFIG_HOME", "PREFIX")


def npm_registry_hosts(env: Mapping[str, str] | None = None) -> tuple[list[str], str | None]:
    """(hosts, why empty) of `@npm-registry` for the environment `env` (the daemon's by
    default). Never raises; cached."""
    env = os.environ if env is None else env
    relevant = tuple(
        sorted(
            (k, v) for k, v in env.items() if k in _NPM_ENV or k.lower().startswith("npm_config_")
        )
    )
    return _resolve(env.get("PATH", "/usr/bin:/bin"), relevant)


@functools.lru_cache(maxsize=8)
def _resolve(path: str, relevant: tuple[tuple[str, str], ...]) -> tuple[list[str], str | None]:
    npm = shutil.which("npm", path=path)
    if npm is None:
        return [], "no npm on this host's PATH"
    env = {"PATH": path, **dict(relevant), "npm_config_update_notifier": "false"}
    try:
        done = subprocess.run(
            [npm, "config", "get", "registry"],
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
        return [], "npm's configuration could not be read"
    return hosts_from(done.stdout.decode("utf-8", "replace"))


def hosts_from(output: str) -> tuple[list[str], str | None]:
    """The registry host of `npm config get registry`'s output. Pure."""
    host = http_host(output.strip())
    return ([host], None) if host else ([], "npm's registry is not an http(s) URL")
