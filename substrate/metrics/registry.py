"""The metric families of one daemon, in a private registry (docs/fleet.md).

Theory of operation. `Metrics` holds every family in its own `CollectorRegistry` (never
prometheus_client's global one, so nothing a library registers shows up and two
registries never collide). Hot paths call its methods, which increment a counter or
observe a histogram: a dict lookup for the label values and an add under a lock, about
a microsecond. Gauges that would cost more to keep current (how many sandboxes live,
the artifact store's bytes, the journal export's lag) are callables given with `gauge`
and called only when a scrape renders the page (`render`), in the scraper's thread.

Label values are bounded sets: profile names (the operator's files), `via` (supervisor,
engine, none), the outcomes below, and refusal names (the taxonomy in substrate.errors).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["COMMAND_OUTCOMES", "METRICS", "Metrics", "command_outcome"]

#: Every value `substrate_commands_total`'s `outcome` label takes.
COMMAND_OUTCOMES = ("ok", "failed", "signal", "timeout", "oom", "cancelled", "unknown")

#: Buckets of `substrate_command_seconds`: a warm `true` (milliseconds) to a long build.
COMMAND_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)
#: Buckets of `substrate_layer_apply_seconds`: an empty change set to a large tree.
APPLY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


def command_outcome(
    *,
    exit_code: int | None,
    signal: str | None,
    timed_out: bool,
    oom_killed: bool,
    cancelled: bool,
) -> str:
    """The `outcome` label of a finished command (one of `COMMAND_OUTCOMES`). Pure."""
    if timed_out:
        return "timeout"
    if oom_killed:
        return "oom"
    if cancelled:
        return "cancelled"
    if signal is not None:
        return "signal"
    if exit_code is None:
        return "unknown"
    return "ok" if exit_code == 0 else "failed"


class _Gauges(Collector):
    """The scrape-time gauges: name → (help, callable); a callable returning None, or
    raising, leaves its gauge out of that scrape (a scrape never fails for one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: dict[str, tuple[str, Callable[[], float | None]]] = {}

    def set(self, name: str, help_text: str, read: Callable[[], float | None]) -> None:
        with self._lock:
            self._sources[name] = (help_text, read)

    def remove(self, name: str) -> None:
        with self._lock:
            self._sources.pop(name, None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            sources = dict(self._sources)
        for name, (help_text, read) in sorted(sources.items()):
            try:
                value = read()
            except Exception:
                continue
            if value is not None:
                yield GaugeMetricFamily(name, help_text, value=value)


class Metrics:
    """Every family of one daemon. Thread-safe; each method is the hot path's whole cost."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.commands = Counter(
            "substrate_commands",
            "Commands finished, by profile, how they started (supervisor, engine) and outcome",
            ["profile", "via", "outcome"],
            registry=r,
        )
        self.command_seconds = Histogram(
            "substrate_command_seconds",
            "Wall time of finished commands, from the exec's start to its exit, seconds",
            ["profile"],
            buckets=COMMAND_BUCKETS,
            registry=r,
        )
        self.refusals = Counter(
            "substrate_refusals", "Requests refused, by refusal name", ["refusal"], registry=r
        )
        self.changes = Counter(
            "substrate_changes",
            "Files of working-layer change sets, by outcome"
            " (applied, unchanged, blocked, pending, conflict)",
            ["outcome"],
            registry=r,
        )
        self.egress_denied = Counter(
            "substrate_egress_denied",
            "Egress proxy connections refused egress_denied (host, port or address)",
            registry=r,
        )
        self.layer_apply_seconds = Histogram(
            "substrate_layer_apply_seconds",
            "Time to scan and apply (or keep) one working layer's change set, seconds",
            buckets=APPLY_BUCKETS,
            registry=r,
        )
        self.supervisor_replacements = Counter(
            "substrate_supervisor_replacements",
            "Supervisors started in place of one lost, tampered with or stopped",
            registry=r,
        )
        self.journal_export_errors = Counter(
            "substrate_journal_export_errors",
            "Failed attempts of the journal export (PostgreSQL away, refusing, conflicting)",
            registry=r,
        )
        self._gauges = _Gauges()
        r.register(self._gauges)

    # -- the hot paths -----------------------------------------------------------------------

    def command_finished(self, profile: str, via: str, outcome: str, seconds: float) -> None:
        self.commands.labels(profile, via, outcome).inc()
        self.command_seconds.labels(profile).observe(seconds)

    def refused(self, refusal: str) -> None:
        self.refusals.labels(refusal).inc()

    def change_outcomes(self, seconds: float, counts: dict[str, int]) -> None:
        """One change set concluded in `seconds`: how many files had each outcome."""
        self.layer_apply_seconds.observe(seconds)
        for outcome, n in counts.items():
            if n:
                self.changes.labels(outcome).inc(n)

    # -- scrape-time gauges --------------------------------------------------------------------

    def gauge(self, name: str, help_text: str, read: Callable[[], float | None]) -> None:
        """Report `read()` as gauge `name` at each scrape (replacing one of that name).
        `read` runs in the scraper's thread: it must be thread-safe and cheap."""
        self._gauges.set(name, help_text, read)

    def remove_gauge(self, name: str) -> None:
        self._gauges.remove(name)

    def render(self) -> bytes:
        """The page: Prometheus text format 0.0.4. Costs a pass over every series and
        a call of each gauge's callable."""
        return generate_latest(self.registry)


#: The daemon's metrics: what the hot paths increment and `/metrics` renders.
METRICS = Metrics()
