"""What `daemon.status` reports of the journal export (`Shipper.status` after `refresh`):
an entry committed since the shipping task last looked counts as lag, and the state says
`shipping`, not `caught_up`. No PostgreSQL needed: the source's head is local."""

from __future__ import annotations

from pathlib import Path

from substrate.export import Cursors, Exporter, ExportSettings, JournalSource
from substrate.export.shipper import Shipper
from substrate.store import Journal, Store


async def test_an_entry_committed_since_the_last_look_is_lag(tmp_path: Path) -> None:
    path = tmp_path / "substrate.db"
    store = Store(path)
    journal = Journal(store)
    source = JournalSource(path, "node")
    settings = ExportSettings(dsn="host=/nonexistent", node="node", password=lambda: "")
    exporter = Exporter(settings, source, Cursors(store.transaction))
    try:
        for i in range(3):
            journal.append("test.event", {"i": i})
        shipper = Shipper(exporter)
        await shipper.refresh()
        exporter.last_seq = shipper.head  # as if all of it were shipped
        shipper.state = "caught_up"
        assert (shipper.status().state, shipper.status().lag_entries) == ("caught_up", 0)
        journal.append("test.event", {"i": 3})
        journal.append("test.event", {"i": 4})
        await shipper.refresh()
        now = shipper.status()
        assert (now.state, now.lag_entries, now.last_seq) == ("shipping", 2, 3)
    finally:
        exporter.close()
        source.close()
        store.close()
