"""Chaining to an upstream (parent) proxy named by the daemon's own environment (pure).

Where a machine's way out is itself a proxy, the daemon's environment says so the usual
way: `HTTPS_PROXY`/`https_proxy` for tunnels, `HTTP_PROXY`/`http_proxy` for plain HTTP,
`ALL_PROXY`/`all_proxy` for either when those are unset, and `NO_PROXY`/`no_proxy` for
names reached directly (lower case wins when both are set, as curl reads them). Only
`http://` upstream proxies are supported (a plain TCP connection to them, then CONNECT or
an absolute-form request); credentials in the URL become a `Proxy-Authorization: Basic`
header and are never logged (`Upstream.__repr__` leaves them out).

With an upstream proxy, the egress proxy resolves nothing itself: the upstream does.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field

from substrate.egress.request import basic_authorization


@dataclass(frozen=True)
class Upstream:
    """One upstream proxy: where it listens, and the header value of its credentials."""

    host: str
    port: int
    authorization: str | None = field(default=None, repr=False)

    def __str__(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class UpstreamConfig:
    """Which upstream serves tunnels and plain requests, and which names bypass it.

    `unusable`: the environment names an upstream proxy this proxy cannot use (a scheme
    other than http://, a malformed URL): every connection that would have gone through
    it is refused (`upstream_failed`) rather than sent around it.
    """

    https: Upstream | None = None
    http: Upstream | None = None
    no_proxy: tuple[str, ...] = ()
    unusable: str | None = None

    def for_request(self, host: str, tunnel: bool) -> Upstream | None:
        """The upstream for a connection to `host` (None: connect directly)."""
        if bypassed(host, self.no_proxy):
            return None
        return self.https if tunnel else self.http

    def describe(self) -> str:
        """One line for the log (no credentials)."""
        if self.unusable:
            return f"unusable upstream proxy: {self.unusable}"
        if self.https is None and self.http is None:
            return "direct"
        return f"https via {self.https or 'direct'}, http via {self.http or 'direct'}"


def from_environ(env: Mapping[str, str]) -> UpstreamConfig:
    """The upstream configuration the environment `env` declares. Never raises: a value
    that cannot be used sets `unusable`. Pure."""

    def pick(name: str) -> str:
        return env.get(name.lower()) or env.get(name.upper()) or ""

    every = pick("all_proxy")
    https_url, http_url = pick("https_proxy") or every, pick("http_proxy") or every
    entries = (e.strip().lower() for e in pick("no_proxy").split(","))
    no_proxy = tuple(e if e == "*" else e.lstrip("*").lstrip(".") for e in entries if e)
    try:
        return UpstreamConfig(
            https=parse_proxy_url(https_url) if https_url else None,
            http=parse_proxy_url(http_url) if http_url else None,
            no_proxy=no_proxy,
        )
    except ValueError as exc:
        return UpstreamConfig(no_proxy=no_proxy, unusable=str(exc))


def parse_proxy_url(url: str) -> Upstream:
    """An `http://[user:password@]host[:port]` proxy URL (no scheme means http; no port
    means 80, the scheme's). Raises ValueError for another scheme, a malformed port or
    a URL without a host."""
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() != "http":
        raise ValueError(f"upstream proxy scheme {parts.scheme!r} is not supported (only http)")
    try:
        port = parts.port or 80
    except ValueError:
        raise ValueError("upstream proxy URL with a malformed port") from None
    if not parts.hostname:
        raise ValueError("upstream proxy URL without a host")
    auth = None
    if parts.username is not None:
        auth = basic_authorization(
            urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or "")
        )
    return Upstream(host=parts.hostname, port=port, authorization=auth)


def bypassed(host: str, no_proxy: tuple[str, ...]) -> bool:
    """Does a `NO_PROXY` entry cover `host`? `*` covers all; `example.org` (or
    `.example.org`) covers it and every name beneath it. Pure."""
    name = host.lower().rstrip(".")
    return any(e == "*" or name == e or name.endswith("." + e) for e in no_proxy)
