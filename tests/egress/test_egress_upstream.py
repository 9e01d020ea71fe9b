"""`substrate.egress.upstream` (pure): the upstream proxy of the daemon's environment."""

from __future__ import annotations

from substrate.egress.upstream import Upstream, bypassed, from_environ


def test_no_proxy_variables_mean_direct() -> None:
    config = from_environ({"PATH": "/bin"})
    assert config.for_request("a.example", True) is None
    assert config.for_request("a.example", False) is None
    assert config.describe() == "direct"


def test_https_and_http_proxies_serve_tunnels_and_plain_requests() -> None:
    config = from_environ(
        {"HTTPS_PROXY": "http://proxy.example:3128", "http_proxy": "proxy2.example:8080"}
    )
    assert config.for_request("a.example", True) == Upstream("proxy.example", 3128)
    assert config.for_request("a.example", False) == Upstream("proxy2.example", 8080)


def test_lower_case_wins_and_all_proxy_fills_in() -> None:
    config = from_environ(
        {
            "HTTPS_PROXY": "http://upper.example:1",
            "https_proxy": "http://lower.example:2",
            "ALL_PROXY": "http://all.example:3",
        }
    )
    assert config.https == Upstream("lower.example", 2)
    assert config.http == Upstream("all.example", 3)


def test_credentials_become_a_header_and_never_show() -> None:
    config = from_environ({"https_proxy": "http://us%40er:s3cret@proxy.example:3128"})
    assert config.https is not None
    assert config.https.authorization == "Basic dXNAZXI6czNjcmV0"
    assert "s3cret" not in repr(config) and "s3cret" not in config.describe()
    assert "dXNAZXI6czNjcmV0" not in repr(config)


def test_no_proxy_names_bypass_it() -> None:
    config = from_environ(
        {"https_proxy": "http://proxy.example:3128", "NO_PROXY": "internal.example, .corp.example,"}
    )
    assert config.for_request("internal.example", True) is None
    assert config.for_request("a.internal.example", True) is None
    assert config.for_request("x.corp.example", True) is None
    assert config.for_request("corp.example", True) is None
    assert config.for_request("notinternal.example", True) is not None
    assert bypassed("anything", ("*",))


def test_an_unusable_upstream_is_kept_as_a_reason_not_ignored() -> None:
    for url in (
        "socks5://proxy.example:1080",
        "https://proxy.example",
        "http://:3128",
        "http://h:99999",
    ):
        config = from_environ({"https_proxy": url})
        assert config.unusable, url
        assert "unusable" in config.describe()
