"""The `@pip-index` allow-list token: the package index this machine's pip uses.

A profile may write `egress_allow = ["@pip-index"]` instead of naming a registry: when
profiles load, the token becomes the host names of the indexes pip on this host would
use, read from pip itself, so no host is written in substrate's code or docs.

How: one subprocess, `python -c` (this interpreter, an argv list, cwd `/`, a 30 s
limit) that loads pip's own configuration the way `pip config list` shows it (its
files and its `PIP_*` environment variables, `:env:` entries) and pip's built-in default
index (`pip._internal.models.index.PyPI`: its host and the host its files are served
from), and prints them as JSON. `hosts_from` then keeps (pure):

- every `index-url` (any section, any source) or, when none is set, pip's default index
  and its file host;
- every `extra-index-url`;
- only `http://` and `https://` URLs (a `file://` index needs no egress), host names only.

Costs about 0.3 s, once per process and environment (cached). A failure (no pip for this
interpreter, a timeout) resolves the token to nothing and says why: the profile then has
no way out, which is safe, and the log says so.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

from substrate.egress.allow import normalise_host

log = logging.getLogger("substrate.egress")

#: The token and what it stands for.
PIP_INDEX = "@pip-index"
#: Longest wait for the pip subprocess.
PIP_TIMEOUT_S = 30.0
#: Environment variables that change what pip reads (the cache key).
_PIP_ENV = ("HOME", "XDG_CONFIG_HOME", "XDG_CONFIG_DIRS", "VIRTUAL_ENV", "PIP_CONFIG_FILE")

_SCRIPT = """\
import json
from pip._internal.configuration import Configuration
from pip._internal.models.index import PyPI
config = Configuration(isolated=False)
config.load()
print(json.dumps({
    "items": [[k, v] for k, v in config.items()],
    "default": [PyPI.simple_url, "https://" + PyPI.file_storage_domain + "/"],
}))
"""


def hosts_from(items: Iterable[tuple[str, str]], default: Iterable[str]) -> list[str]:
    """The index hosts pip would reach, from its configuration `items` (`section.key`,
    value: `global.index-url`, `:env:.extra-index-url`, ...) and its `default` index URLs
    (the index, then its file host). Sorted, distinct; http(s) only. Pure."""
    return sorted({h for h in (http_host(u) for u in urls_from(items, default)) if h})


def urls_from(items: Iterable[tuple[str, str]], default: Iterable[str]) -> list[str]:
    """The http(s) index URLs of `hosts_from`, in pip's order (index, then extra). Pure."""
    index: list[str] = []
    extra: list[str] = []
    for key, value in items:
        name = key.rpartition(".")[2]
        if name == "index-url":
            # Which source wins depends on the command pip runs (`install.` over
            # `global.`, the environment over files): every configured one is allowed.
            index += value.split()
        elif name == "extra-index-url":
            extra += value.split()
    return [u for u in (index or list(default)) + extra if http_host(u) is not None]


def http_host(url: str) -> str | None:
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        return None
    return normalise_host(parts.hostname)


def pip_index_hosts(env: Mapping[str, str] | None = None) -> tuple[list[str], str | None]:
    """(hosts, why empty) of `@pip-index` on this host for the environment `env` (the
    daemon's by default). Never raises; cached per distinct pip-relevant environment."""
    urls, why = pip_index_urls(env)
    return sorted({h for h in (http_host(u) for u in urls) if h}), why


def pip_index_urls(env: Mapping[str, str] | None = None) -> tuple[list[str], str | None]:
    """(index URLs, why empty): the http(s) URLs behind `pip_index_hosts`, pip's index
    first (the default index's simple URL when none is configured, then its file host).
    Never raises; cached."""
    env = os.environ if env is None else env
    relevant = tuple(
        sorted((k, v) for k, v in env.items() if k in _PIP_ENV or k.startswith("PIP_"))
    )
    return _resolve(relevant)


@functools.lru_cache(maxsize=8)
def _resolve(relevant: tuple[tuple[str, str], ...]) -> tuple[list[str], str | None]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **dict(relevant)}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    try:
        done = subprocess.run(
            [sys.executable, "-c", _SCRIPT],
            cwd="/",
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=PIP_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], f"pip's configuration could not be read: {type(exc).__name__}"
    if done.returncode != 0:
        tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
        return [], f"pip's configuration could not be read: {' '.join(tail)[:200]}"
    try:
        doc: Any = json.loads(done.stdout)
        items = [(str(k), str(v)) for k, v in doc["items"]]
        default = [str(u) for u in doc["default"]]
    except (ValueError, KeyError, TypeError):
        return [], "pip's configuration could not be read: unexpected output"
    urls = urls_from(items, default)
    return urls, None if urls else "pip uses no http(s) index"
