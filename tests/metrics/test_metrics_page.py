"""substrate.metrics: the page parses as Prometheus text, moves with what the hot paths
count, answers only /metrics, and a scrape storm is capped (connections past the cap
are closed at accept; the page is rendered once per window, whoever asks)."""

from __future__ import annotations

import functools

import trio
from prometheus_client.parser import text_string_to_metric_families

from substrate.metrics import MAX_SCRAPERS, Metrics, serve_metrics


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def http_get(port: int, path: str = "/metrics", method: str = "GET") -> tuple[int, bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(f"{method} {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_the_page_holds_every_family_and_moves() -> None:
    m = Metrics()
    m.gauge("substrate_sandboxes", "Sandboxes", lambda: 3)
    m.gauge("substrate_journal_export_lag_entries", "Lag", lambda: 12)
    m.gauge("substrate_broken", "raises", lambda: 1 / 0)  # left out, never fails a scrape
    before = samples(m.render().decode())
    m.command_finished("box", "supervisor", "ok", 0.004)
    m.command_finished("box", "supervisor", "ok", 0.02)
    m.refused("path_denied")
    m.change_outcomes(0.003, {"applied": 2, "conflict": 1, "blocked": 0})
    m.egress_denied.inc()
    m.supervisor_replacements.inc()
    after = samples(m.render().decode())
    key = (
        "substrate_commands_total",
        (("outcome", "ok"), ("profile", "box"), ("via", "supervisor")),
    )
    assert before.get(key, 0) == 0 and after[key] == 2
    assert after[("substrate_command_seconds_count", (("profile", "box"),))] == 2
    assert after[("substrate_command_seconds_bucket", (("le", "0.005"), ("profile", "box")))] == 1
    assert after[("substrate_refusals_total", (("refusal", "path_denied"),))] == 1
    assert after[("substrate_changes_total", (("outcome", "applied"),))] == 2
    assert after[("substrate_changes_total", (("outcome", "conflict"),))] == 1
    assert ("substrate_changes_total", (("outcome", "blocked"),)) not in after
    assert after[("substrate_egress_denied_total", ())] == 1
    assert after[("substrate_supervisor_replacements_total", ())] == 1
    assert after[("substrate_layer_apply_seconds_count", ())] == 1
    assert after[("substrate_sandboxes", ())] == 3
    assert after[("substrate_journal_export_lag_entries", ())] == 12
    assert not any(name == "substrate_broken" for name, _ in after)


async def test_served_over_http_only_at_metrics() -> None:
    m = Metrics()
    m.refused("too_large")
    async with trio.open_nursery() as nursery:
        port = await nursery.start(functools.partial(serve_metrics, "127.0.0.1:0", m))
        status, body = await http_get(port)
        assert status == 200
        assert (
            samples(body.decode())[("substrate_refusals_total", (("refusal", "too_large"),))] == 1
        )
        assert (await http_get(port, "/"))[0] == 404
        assert (await http_get(port, method="POST"))[0] == 405
        assert await http_get(port, method="HEAD") == (200, b"")
        nursery.cancel_scope.cancel()


async def test_a_scrape_storm_is_capped() -> None:
    renders = 0
    m = Metrics()

    def counted() -> float:
        nonlocal renders
        renders += 1
        return 1.0

    m.gauge("substrate_sandboxes", "Sandboxes", counted)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(functools.partial(serve_metrics, "127.0.0.1:0", m))
        # Connections that never send a request: past the cap, each is closed at once.
        idle = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(4 * MAX_SCRAPERS)]
        closed = 0
        for stream in idle[MAX_SCRAPERS:]:
            with trio.move_on_after(5.0):
                if await stream.receive_some(1) == b"":
                    closed += 1
        assert closed == 3 * MAX_SCRAPERS  # every one over the cap
        waiting = 0
        for stream in idle[:MAX_SCRAPERS]:
            with trio.move_on_after(0.1) as scope:
                await stream.receive_some(1)
            waiting += scope.cancelled_caught
        assert waiting == MAX_SCRAPERS  # served: their request is awaited
        for stream in idle:
            await stream.aclose()
        # Many scrapes at once, after the idle ones went: all answered, one render.
        await trio.sleep(0.05)
        answers: list[int] = []

        async def scrape() -> None:
            answers.append((await http_get(port))[0])

        async with trio.open_nursery() as scrapers:
            for _ in range(MAX_SCRAPERS):
                scrapers.start_soon(scrape)
        assert answers == [200] * MAX_SCRAPERS
        assert renders == 1  # a cached page inside one window (CACHE_S)
        nursery.cancel_scope.cancel()
