"""A profile's `egress_inject` table, checked at load (pure; docs/egress.md).

`egress_inject = { "api.example.com" = { header = "x-api-key", secret = "name" } }` asks
the proxy to set that header to the operator secret's value on every HTTPS request to
that host. The table is the operator's (a profile file), and is checked here: each host
an exact, lower-case name that `egress_allow` allows on port 443 (no wildcard: the
sandbox's CA vouches for named hosts only), a header name that is a token and not one
the proxy owns (framing, hop-by-hop, `Host`), a secret name as `substrate secret set`
takes it, at most `MAX_HOSTS` hosts, and a `ca_bundle` for the sandbox's CA to join.
Whether each secret is set is checked when a sandbox is made (`secret_unknown`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from substrate.egress.allow import AllowList, parse_entry
from substrate.egress.npmregistry import TOKENS
from substrate.schema.profile import EgressInject
from substrate.secrets import NAME_RE as SECRET_NAME_RE

#: At most this many hosts in one profile's table.
MAX_HOSTS = 16
#: An HTTP header name (RFC 9110 §5.1: a token), bounded.
_HEADER_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")
#: Headers the proxy owns (framing, hop-by-hop, the target): never injected.
PROXY_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "upgrade",
        "te",
        "trailer",
        "expect",
        "proxy-authorization",
        "proxy-connection",
    }
)


def problem(
    table: Mapping[str, EgressInject], egress_allow: Iterable[str], *, ca_bundle: str
) -> tuple[str, str] | None:
    """The first problem of `table` as (key path, why), or None. Pure."""
    if not table:
        return None
    if len(table) > MAX_HOSTS:
        return "egress_inject", f"at most {MAX_HOSTS} hosts"
    if not ca_bundle:
        return "egress_inject", 'needs ca_bundle ("host" or a file): the sandbox\'s CA joins it'
    try:
        allowed = AllowList.of(e for e in egress_allow if e not in TOKENS)
    except ValueError:
        return None  # the allow-list's own check says why
    for host, rule in table.items():
        key = f"egress_inject.{host}"
        try:
            name = parse_entry(host)
        except ValueError as exc:
            return key, str(exc)
        if name.startswith("*.") or name != host:
            return key, "an exact host name, in lower case (no wildcard)"
        if not allowed.allows(name, 443):
            return key, "not in egress_allow"
        if not _HEADER_RE.fullmatch(rule.header) or rule.header.lower() in PROXY_HEADERS:
            return f"{key}.header", "not a header name the proxy lets a profile set"
        if not SECRET_NAME_RE.fullmatch(rule.secret):
            return f"{key}.secret", f"a secret name must match {SECRET_NAME_RE.pattern}"
    return None
