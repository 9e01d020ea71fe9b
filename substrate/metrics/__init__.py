"""Prometheus metrics (docs/fleet.md): counters the hot paths bump, a page at `/metrics`.

    registry.py   pure   `Metrics`: the families in a private registry, `METRICS` the
                         daemon's; scrape-time gauges (`Metrics.gauge`)
    http.py       edge   `serve_metrics`: `GET /metrics` over loopback TCP, bounded

The hot paths (commands, refusals, change sets, egress, supervisors) only increment a
counter or observe a histogram bucket; everything costlier (sandboxes, artifact bytes,
the journal export's lag) is read when a scrape asks, from callables the daemon names.
"""

from substrate.metrics.http import MAX_SCRAPERS, parse_metrics_listen, serve_metrics
from substrate.metrics.registry import METRICS, Metrics, command_outcome

__all__ = [
    "MAX_SCRAPERS",
    "METRICS",
    "Metrics",
    "command_outcome",
    "parse_metrics_listen",
    "serve_metrics",
]
