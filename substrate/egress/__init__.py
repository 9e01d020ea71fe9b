"""Egress: the allow-listing proxy that is an egress sandbox's only way out (docs/egress.md).

`allow` parses and matches host allow-lists (pure); `request` reads proxy requests from
bytes and writes the proxy's answers (sans-IO); `body` finds where a plain request's body
ends, so that nothing after it is relayed (sans-IO, h11); `upstream` reads the upstream proxy the
daemon's environment names (pure); `ledger` keeps what was refused to which command
(pure, bounded); `pipindex` resolves the `@pip-index` token from pip's own configuration, `npmregistry`
`@npm-registry` from npm's;
`destination` judges resolved addresses before any connection (a kernel route lookup);
`authority` is a sandbox's own CA and `inject` the h11 relay that sets a secret header on
an injecting host's requests (`inject_rules` checks a profile's table);
`proxy` is the Trio proxy the daemon runs. How a sandbox reaches it (a listener inside
the sandbox's network namespace) is `substrate.sandbox.proxy_link`'s.
"""

from substrate.egress.allow import PORTS, AllowList, parse_entry
from substrate.egress.ledger import SandboxLedger
from substrate.egress.npmregistry import NPM_REGISTRY, npm_registry_hosts
from substrate.egress.pipindex import PIP_INDEX, pip_index_hosts
from substrate.egress.proxy import Attachment, EgressProxy, Gate, Limits
from substrate.egress.upstream import UpstreamConfig, from_environ

__all__ = [
    "NPM_REGISTRY",
    "PIP_INDEX",
    "PORTS",
    "AllowList",
    "Attachment",
    "EgressProxy",
    "Gate",
    "Limits",
    "SandboxLedger",
    "UpstreamConfig",
    "from_environ",
    "npm_registry_hosts",
    "parse_entry",
    "pip_index_hosts",
]
