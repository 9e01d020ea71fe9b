"""The subjects of the commits a ref's move brings: reachable from the new id, not the old.

Theory of operation: `git rev-list <new> --not <old>` in small. Commits are taken newest
first (by committer time) from a heap holding both sides; a commit reached from `old` is
marked uninteresting and passes the mark to its parents; one reached only from `new`
gives its subject. The walk stops when every commit left on the heap is uninteresting,
when `limit` subjects are found, or after `MAX_WALK_FACTOR * limit + MAX_WALK_EXTRA`
commits read — so a ref moved onto an unrelated history of a million commits costs a
bounded read. As in git without its clock-skew slop, a commit whose committer time lies
(older than its own descendant on the old side) may be listed though `old` reaches it.
"""

from __future__ import annotations

import heapq

from dulwich.objects import Commit, ShaFile

from substrate.git.store import COMMIT, ObjectStore, StoreDamaged, valid_oid

#: A commit is read up to this many bytes.
MAX_COMMIT_BYTES = 1 << 20
#: A subject is cut to this many characters.
MAX_SUBJECT = 200
#: Commits read at most: this many per subject asked for, plus this many.
MAX_WALK_FACTOR, MAX_WALK_EXTRA = 4, 1000


def commit_subjects(
    objects_fd: int, new_oid: str, old_oid: str | None, *, limit: int
) -> tuple[str, ...]:
    """The subjects (first paragraph of the message, on one line, at most `MAX_SUBJECT`
    characters) of the commits reachable from `new_oid` and not from `old_oid`, newest
    first, at most `limit` of them.

    A commit the store lacks or cannot read (a shallow clone's edge, a tag or tree id)
    ends the walk along it. Never raises for the store's content. Costs one object read
    per commit walked, at most `MAX_WALK_FACTOR * limit + MAX_WALK_EXTRA`.
    """
    if limit <= 0 or not valid_oid(new_oid):
        return ()
    with ObjectStore(objects_fd) as store:
        return _walk(store, new_oid, old_oid, limit)


def _walk(store: ObjectStore, new_oid: str, old_oid: str | None, limit: int) -> tuple[str, ...]:
    # Commits to visit, newest first: (-committer time, order pushed, id). `seen` says
    # of each commit met whether it is uninteresting (reached from old); `waiting`
    # counts the interesting ones on the heap (the walk ends when none is).
    heap: list[tuple[int, int, str]] = []
    seen: dict[str, bool] = {}
    queued: dict[str, Commit] = {}
    budget = MAX_WALK_FACTOR * limit + MAX_WALK_EXTRA
    waiting = 0

    def push(oid: str, uninteresting: bool) -> None:
        nonlocal budget, waiting
        if oid in seen:
            if uninteresting and not seen[oid]:
                seen[oid] = True  # reached from old too: not new after all
                if oid in queued:
                    waiting -= 1
            return
        if budget <= 0:
            return
        budget -= 1
        commit = _read_commit(store, oid)
        if commit is None:
            return
        seen[oid] = uninteresting
        queued[oid] = commit
        waiting += not uninteresting
        heapq.heappush(heap, (-commit.commit_time, budget, oid))

    push(new_oid, False)
    if old_oid is not None and valid_oid(old_oid):
        push(old_oid, True)
    subjects: list[str] = []
    while heap and waiting and len(subjects) < limit:
        _, _, oid = heapq.heappop(heap)
        commit = queued.pop(oid)
        uninteresting = seen[oid]
        if not uninteresting:
            waiting -= 1
            subjects.append(subject(commit.message))
        for parent in commit.parents:
            push(parent.decode("ascii"), uninteresting)
    return tuple(subjects)


def _read_commit(store: ObjectStore, oid: str) -> Commit | None:
    try:
        found = store.read(oid, MAX_COMMIT_BYTES)
    except StoreDamaged:
        return None
    if found is None or found[0] != COMMIT:
        return None
    try:
        obj = ShaFile.from_raw_string(COMMIT, found[1])
        assert isinstance(obj, Commit)
        _ = obj.parents  # parse now: a malformed commit ends the walk here
    except Exception:  # dulwich's ObjectFormatException, ValueError, ...
        return None
    return obj


def subject(message: bytes) -> str:
    """Git's `%s`: the message's first paragraph, its lines joined by spaces. Pure."""
    paragraph = message.lstrip(b"\n").split(b"\n\n", 1)[0]
    text = " ".join(paragraph.decode("utf-8", "replace").split())
    return text[:MAX_SUBJECT]
