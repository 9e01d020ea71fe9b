"""Git for agents, beneath the git layer: object stores and refs, read and changed through held fds.

Pure of Docker and of the host's `git` (which would read a workspace's configuration,
fsmonitor, filters and hooks); dulwich parses objects, pack indexes and deltas from
bytes and file objects this package opens itself, beneath held directory fds, never by
path (docs/git.md).

    store.py     I/O   `ObjectStore`: a store's loose objects and packs, looked up
                       and read with bounds; the entry, delta and zlib helpers
    loose.py     I/O   a loose object copied as it is checked (hash, header, parse)
    packs.py     I/O   a pack and its index checked whole in bounded memory
    packing.py   I/O   many loose objects written as one pack, each checked
    objects.py   I/O   `import_objects`: what a store lacks, verified, copied, never
                       overwriting; `has_object`
    refnames.py  pure  `valid_ref_name`: git's check-ref-format rules, under refs/
    refs.py      I/O   `read_refs`, `update_ref` (compare-and-swap under git's lock
                       files, with a reflog line)
    history.py   I/O   `commit_subjects`: the subjects of a ref's new commits, bounded
"""

from substrate.git.history import commit_subjects
from substrate.git.objects import ImportReport, ObjectRefusal, has_object, import_objects
from substrate.git.refnames import valid_ref_name
from substrate.git.refs import RefOutcome, read_refs, update_ref

__all__ = [
    "ImportReport",
    "ObjectRefusal",
    "RefOutcome",
    "commit_subjects",
    "has_object",
    "import_objects",
    "read_refs",
    "update_ref",
    "valid_ref_name",
]
