"""`substrate.egress.pipindex`: `@pip-index` from pip's own configuration.

The pure part with configuration items as pip reports them; the real part runs this
interpreter's pip (a subprocess, no network) with index URLs set in its environment.
"""

from __future__ import annotations

import sys
import uuid

import pytest

from substrate.egress import pipindex
from substrate.egress.pipindex import hosts_from, pip_index_hosts, pip_index_urls, urls_from

DEFAULT = ["https://index.example/simple", "https://files.example/"]


def test_without_a_configured_index_the_default_and_its_file_host_are_used() -> None:
    assert hosts_from([], DEFAULT) == ["files.example", "index.example"]


def test_a_configured_index_replaces_the_default_and_extras_add() -> None:
    items = [
        ("global.index-url", "https://mirror.example/simple"),
        ("global.extra-index-url", "http://extra.example/simple https://more.example/x"),
        ("global.cert", "/etc/ssl/certs/ca-certificates.crt"),
    ]
    assert hosts_from(items, DEFAULT) == ["extra.example", "mirror.example", "more.example"]
    assert urls_from(items, DEFAULT)[0] == "https://mirror.example/simple"


def test_every_source_of_an_index_url_is_allowed() -> None:
    items = [
        ("global.index-url", "https://a.example/simple"),
        ("install.index-url", "https://b.example/simple"),
        (":env:.index-url", "https://c.example/simple"),
    ]
    assert hosts_from(items, DEFAULT) == ["a.example", "b.example", "c.example"]


def test_only_http_indexes_need_egress() -> None:
    items = [
        ("global.extra-index-url", "file:///opt/mirror/simple /opt/local"),
        (":env:.find-links", "/opt/wheels"),
        ("global.index-url", "https://user:pw@Mirror.Example:8443/simple"),
    ]
    assert hosts_from(items, DEFAULT) == ["mirror.example"]
    assert hosts_from([("global.index-url", "file:///opt/simple")], DEFAULT) == []


def test_pip_itself_reads_the_index_urls_of_its_environment() -> None:
    env = {
        "PIP_INDEX_URL": "https://mirror.example/simple",
        "PIP_EXTRA_INDEX_URL": "http://extra.example/simple file:///opt/x",
        "PIP_NO_CACHE_DIR": uuid.uuid4().hex,  # a fresh cache key: pip really runs
    }
    hosts, why = pip_index_hosts(env)
    assert why is None
    assert "mirror.example" in hosts
    assert "extra.example" in hosts
    urls, _ = pip_index_urls(env)
    assert urls[0] == "https://mirror.example/simple"


def test_a_pip_that_cannot_run_resolves_to_nothing_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "executable", "/bin/false")
    hosts, why = pipindex.pip_index_hosts({"PIP_X": uuid.uuid4().hex})
    assert hosts == []
    assert why is not None and "could not be read" in why


def test_npm_registry_token_is_the_host_npm_names() -> None:
    from substrate.egress.npmregistry import hosts_from, npm_registry_hosts

    assert hosts_from("https://registry.example.org/\n") == (["registry.example.org"], None)
    assert hosts_from("file:///srv/npm\n")[0] == []
    # This machine's own npm, read through npm itself (the registries answer here).
    hosts, why = npm_registry_hosts()
    assert why is None and len(hosts) == 1
    # No npm on the PATH: the token allows nothing, and says why.
    assert npm_registry_hosts({"PATH": "/nonexistent"}) == ([], "no npm on this host's PATH")
