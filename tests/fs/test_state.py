"""substrate.fs.state: the state dir's entries keep the names they have on disk.

A daemon started by this code finds the files an earlier one left (its database, homes,
secrets, pre-images), so a name here is never changed.
"""

from __future__ import annotations

from pathlib import Path

from substrate.fs.state import ENTRIES, StatePaths

#: Every entry and its name on disk.
NAMES = {
    "agent_socket": "substrate.sock",
    "operator_socket": "operator.sock",
    "database": "substrate.db",
    "secrets": "secrets",
    "homes": "homes",
    "preimages": "preimages",
    "uploads": "uploads",
    "gate": "gate",
    "artifacts": "artifacts",
    "sandbox_files": "sandbox-files",
    "supervisor": "supervisor",
    "layers": "layers",
    "gitlayers": "gitlayers",
}


def _entries() -> list[str]:
    return sorted(k for k, v in vars(StatePaths).items() if isinstance(v, property))


def test_every_entry_is_named_and_keeps_its_name() -> None:
    assert _entries() == sorted(NAMES)
    state = StatePaths(Path("/var/lib/substrate"))
    for entry, name in NAMES.items():
        assert getattr(state, entry) == Path("/var/lib/substrate", name)


def test_entries_are_the_names_relative_to_the_state_dir() -> None:
    for entry, name in NAMES.items():
        relative = getattr(ENTRIES, entry)
        assert str(relative) == name and relative.name == name
