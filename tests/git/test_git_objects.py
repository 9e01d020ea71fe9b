"""`substrate.git.objects`: what a store lacks is verified, copied, never overwriting.

Repositories are real (made by the host's `git` in the test's own tmp dirs); the
destination is then checked by `git fsck --full` and `git cat-file`, as a person would.
"""

from __future__ import annotations

import itertools
import os
import shutil
import stat
from pathlib import Path

import pytest

from substrate.git import (
    ObjectRefusal,
    commit_subjects,
    has_object,
    import_objects,
    objects,
    packing,
    update_ref,
)
from tests.harness.gitrepos import Repo, blob_id, delta, dir_fd, hand_pack, history, loose_bytes

OWNER = (1000, 1000)
BIG = 1 << 30


def run_import(src: Repo | Path, dest: Repo, **bounds: int):  # type: ignore[no-untyped-def]
    source = src.objects if isinstance(src, Repo) else src
    with dir_fd(source) as s, dir_fd(dest.objects) as d:
        return import_objects(
            s,
            d,
            owner=OWNER,
            max_bytes=bounds.pop("max_bytes", BIG),
            max_objects=bounds.pop("max_objects", 100_000),
            **bounds,
        )


def assert_clean(repo: Repo) -> None:
    done = repo.fsck()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "missing" not in done.stdout + done.stderr
    assert "error" not in done.stdout + done.stderr


@pytest.fixture
def agent(tmp_path: Path) -> Repo:
    repo = Repo.init(tmp_path / "agent")
    history(repo, 6)
    return repo


@pytest.fixture
def host(tmp_path: Path) -> Repo:
    return Repo.init(tmp_path / "host")


def test_loose_objects_import_into_a_fresh_store_and_fsck_is_clean(agent: Repo, host: Repo) -> None:
    wanted = agent.object_ids()
    report = run_import(agent, host)
    assert report.refused == ()
    assert (report.imported, report.present) == (len(wanted), 0)
    assert report.bytes == sum(agent.loose_path(oid).stat().st_size for oid in wanted)
    assert host.object_ids() == wanted
    assert_clean(host)
    head = agent.rev("HEAD")
    assert host.git("cat-file", "-t", head).strip() == "commit"
    assert "commit 5" in host.git("cat-file", "-p", head)
    # Again: all there, nothing written.
    again = run_import(agent, host)
    assert (again.imported, again.present, again.bytes) == (0, len(wanted), 0)


def test_imported_files_are_the_owners_read_only_like_gits(agent: Repo, host: Repo) -> None:
    run_import(agent, host)
    head = agent.rev("HEAD")
    st = host.loose_path(head).stat()
    assert (st.st_uid, st.st_gid) == OWNER
    assert stat.S_IMODE(st.st_mode) == 0o444
    fan = host.loose_path(head).parent.stat()
    assert (fan.st_uid, fan.st_gid) == OWNER
    assert stat.S_IMODE(fan.st_mode) == 0o755
    assert not [p for p in host.objects.rglob("tmp_*")]


def test_an_agents_pack_made_by_git_gc_imports_with_its_deltas(
    tmp_path: Path, agent: Repo, host: Repo
) -> None:
    scratch = Repo(tmp_path / "scratch")
    shutil.copytree(agent.path, scratch.path, symlinks=True)
    scratch.git("gc", "-q", "--aggressive", "--prune=now")
    (pack,) = scratch.packs()
    assert not list(scratch.objects.glob("??/*"))
    chains = scratch.git("verify-pack", "-v", str(pack.with_suffix(".idx")))
    assert "chain length = 2" in chains  # a real delta chain to resolve
    report = run_import(scratch, host)
    assert report.refused == ()
    assert report.imported == len(agent.object_ids())
    (copied,) = host.packs()
    assert copied.read_bytes() == pack.read_bytes()
    st = copied.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (1000, 0o444)
    assert host.object_ids() == agent.object_ids()
    assert_clean(host)
    assert "commit 5" in host.git("log", "--format=%s", agent.rev("HEAD"))


def test_a_pack_whose_objects_the_store_has_counts_present_and_is_not_copied(
    tmp_path: Path, agent: Repo, host: Repo
) -> None:
    run_import(agent, host)
    scratch = Repo(tmp_path / "scratch")
    shutil.copytree(agent.path, scratch.path, symlinks=True)
    scratch.git("repack", "-adq")
    report = run_import(scratch, host)
    assert (report.imported, report.present, report.bytes) == (0, len(agent.object_ids()), 0)
    assert host.packs() == []


def test_a_pack_with_some_new_objects_is_copied_whole(
    tmp_path: Path, agent: Repo, host: Repo
) -> None:
    run_import(agent, host)
    before = len(agent.object_ids())
    scratch = Repo(tmp_path / "scratch")
    shutil.copytree(agent.path, scratch.path, symlinks=True)
    scratch.commit({"new.txt": "new\n"}, "one more")
    scratch.git("repack", "-adq")
    report = run_import(scratch, host)
    assert report.refused == ()
    assert report.present == before
    assert report.imported == len(scratch.object_ids()) - before
    assert_clean(host)


def test_an_existing_object_is_never_overwritten(agent: Repo, host: Repo) -> None:
    head = agent.rev("HEAD")
    placed = host.loose_path(head)
    placed.parent.mkdir()
    placed.write_bytes(b"the host's own bytes, whatever they are")
    report = run_import(agent, host)
    assert placed.read_bytes() == b"the host's own bytes, whatever they are"
    assert report.present == 1
    assert report.imported == len(agent.object_ids()) - 1


def test_a_name_taken_between_the_check_and_the_link_is_kept(
    agent: Repo, host: Repo, monkeypatch: pytest.MonkeyPatch
) -> None:
    head = agent.rev("HEAD")
    real = objects._link

    def host_writes_first(run: objects._Import) -> None:
        placed = host.loose_path(head)
        placed.parent.mkdir(exist_ok=True)
        placed.write_bytes(b"made by the host meanwhile")
        real(run)

    monkeypatch.setattr(objects, "_link", host_writes_first)
    report = run_import(agent, host)
    assert host.loose_path(head).read_bytes() == b"made by the host meanwhile"
    assert report.present == 1
    assert not list(host.objects.rglob("tmp_obj_*"))


def test_a_forged_loose_object_is_refused_hash_mismatch(tmp_path: Path, host: Repo) -> None:
    source = tmp_path / "forged"
    real_id, _ = loose_bytes(b"blob", b"what the name promises\n")
    _, other = loose_bytes(b"blob", b"something else entirely\n")
    (source / real_id[:2]).mkdir(parents=True)
    (source / real_id[:2] / real_id[2:]).write_bytes(other)
    report = run_import(source, host)
    assert report.refused == (ObjectRefusal(real_id, "hash_mismatch"),)
    assert report.imported == 0
    assert not host.loose_path(real_id).exists()
    assert not list(host.objects.rglob("tmp_obj_*"))


@pytest.mark.parametrize(
    ("kind", "content"),
    [
        (b"commit", b"not a commit at all"),
        (b"tree", b"100644 name-without-nul"),
        (b"tree", b"100644 .git\0" + bytes(20)),
        (b"tree", b"100644 .GIT\0" + bytes(20)),
    ],
)
def test_a_loose_object_that_does_not_parse_as_its_type_is_refused(
    tmp_path: Path, host: Repo, kind: bytes, content: bytes
) -> None:
    source = tmp_path / "odd"
    oid, data = loose_bytes(kind, content)
    (source / oid[:2]).mkdir(parents=True)
    (source / oid[:2] / oid[2:]).write_bytes(data)
    report = run_import(source, host)
    assert report.refused == (ObjectRefusal(oid, "unparsable"),)
    assert not host.loose_path(oid).exists()


def test_a_loose_object_with_bytes_after_its_zlib_stream_is_refused(
    tmp_path: Path, host: Repo
) -> None:
    source = tmp_path / "trailing"
    oid, data = loose_bytes(b"blob", b"content\n")
    (source / oid[:2]).mkdir(parents=True)
    (source / oid[:2] / oid[2:]).write_bytes(data + b"junk")
    report = run_import(source, host)
    assert report.refused == (ObjectRefusal(oid, "unparsable"),)


def test_a_pack_with_a_bad_checksum_is_refused(tmp_path: Path, agent: Repo, host: Repo) -> None:
    scratch = Repo(tmp_path / "scratch")
    shutil.copytree(agent.path, scratch.path, symlinks=True)
    scratch.git("repack", "-adq")
    (pack,) = scratch.packs()
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pack.chmod(0o644)
    pack.write_bytes(bytes(data))
    report = run_import(scratch, host)
    assert report.refused == (ObjectRefusal(f"pack/{pack.name}", "bad_pack_checksum"),)
    assert report.imported == 0
    assert os.listdir(host.objects / "pack") == []


def test_an_index_that_does_not_match_its_pack_is_refused(
    tmp_path: Path, agent: Repo, host: Repo
) -> None:
    scratch = Repo(tmp_path / "scratch")
    shutil.copytree(agent.path, scratch.path, symlinks=True)
    scratch.git("repack", "-adq")
    (pack,) = scratch.packs()
    idx = pack.with_suffix(".idx")
    data = bytearray(idx.read_bytes())
    data[8 + 1024 + 3] ^= 0x01  # the first object's id
    idx.chmod(0o644)
    idx.write_bytes(bytes(data))
    report = run_import(scratch, host)
    assert report.refused == (ObjectRefusal(f"pack/{pack.name}", "index_mismatch"),)
    assert os.listdir(host.objects / "pack") == []


def test_a_hand_made_pack_with_a_delta_chain_imports_and_fsck_is_clean(
    tmp_path: Path, host: Repo
) -> None:
    source = tmp_path / "hand"
    versions = [b"".join(b"version %d line %d\n" % (v, i) for i in range(v + 40)) for v in range(4)]
    entries: list[bytes | tuple[bytes, bytes, bytes]] = [versions[0]]
    for before, after in itertools.pairwise(versions):
        entries.append((blob_id(after), blob_id(before), delta(before, after)))
    hand_pack(source / "pack", entries)
    report = run_import(source, host)
    assert report.refused == ()
    assert report.imported == 4
    assert host.git("cat-file", "-p", blob_id(versions[3]).hex()).encode() == versions[3]
    assert_clean(host)


def test_a_delta_chain_deeper_than_the_bound_is_refused(tmp_path: Path, host: Repo) -> None:
    source = tmp_path / "deep"
    versions = [b"v%d\n" % v * 30 for v in range(4)]
    entries: list[bytes | tuple[bytes, bytes, bytes]] = [versions[0]]
    for before, after in itertools.pairwise(versions):
        entries.append((blob_id(after), blob_id(before), delta(before, after)))
    name = hand_pack(source / "pack", entries)
    report = run_import(source, host, max_delta_depth=2)
    assert report.refused == (ObjectRefusal(f"pack/{name}.pack", "delta_too_deep"),)
    assert os.listdir(host.objects / "pack") == []
    assert run_import(source, host, max_delta_depth=3).imported == 4


def test_a_delta_loop_is_refused(tmp_path: Path, host: Repo) -> None:
    source = tmp_path / "loop"
    a, b = b"the first text\n" * 10, b"the second text\n" * 10
    name = hand_pack(
        source / "pack",
        [(blob_id(a), blob_id(b), delta(b, a)), (blob_id(b), blob_id(a), delta(a, b))],
    )
    report = run_import(source, host)
    assert report.refused == (ObjectRefusal(f"pack/{name}.pack", "delta_loop"),)
    assert os.listdir(host.objects / "pack") == []


def test_a_thin_pack_is_refused_missing_base(tmp_path: Path, host: Repo) -> None:
    source = tmp_path / "thin"
    a, b = b"a base the pack does not hold\n" * 10, b"what the delta makes\n" * 10
    name = hand_pack(source / "pack", [(blob_id(b), blob_id(a), delta(a, b))])
    report = run_import(source, host)
    assert report.refused == (ObjectRefusal(f"pack/{name}.pack", "missing_base"),)


def test_symlinks_in_the_source_store_are_refused_never_followed(
    tmp_path: Path, host: Repo
) -> None:
    outside = tmp_path / "outside"
    oid, data = loose_bytes(b"blob", b"reached through a symlink\n")
    (outside / oid[:2]).mkdir(parents=True)
    (outside / oid[:2] / oid[2:]).write_bytes(data)
    source = tmp_path / "links"
    source.mkdir()
    (source / oid[:2]).symlink_to(outside / oid[:2])
    other, other_data = loose_bytes(b"blob", b"a file the link names\n")
    (outside / "target").write_bytes(other_data)
    (source / other[:2]).mkdir()
    (source / other[:2] / other[2:]).symlink_to(outside / "target")
    (source / "pack").mkdir()
    (source / "pack" / f"pack-{'a' * 40}.pack").symlink_to(outside / "target")
    (source / "pack" / f"pack-{'a' * 40}.idx").write_bytes(b"")
    report = run_import(source, host)
    assert set(report.refused) == {
        ObjectRefusal(oid[:2], "symlink"),
        ObjectRefusal(other, "symlink"),
        ObjectRefusal(f"pack/pack-{'a' * 40}.pack", "symlink"),
    }
    assert report.imported == 0
    assert not host.loose_path(oid).exists() and not host.loose_path(other).exists()


def test_a_fifo_in_the_source_store_is_refused_not_a_file(tmp_path: Path, host: Repo) -> None:
    source = tmp_path / "fifo"
    oid, _ = loose_bytes(b"blob", b"x\n")
    (source / oid[:2]).mkdir(parents=True)
    os.mkfifo(source / oid[:2] / oid[2:])
    report = run_import(source, host)
    assert report.refused == (ObjectRefusal(oid, "not_a_file"),)


def test_the_bounds_refuse_by_name(agent: Repo, host: Repo) -> None:
    count = len(agent.object_ids())
    few = run_import(agent, host, max_objects=3)
    reasons = [r.reason for r in few.refused]
    assert reasons.count("too_many") == 1  # and the rest is not examined
    # Of the three examined, those naming what is not there yet wait for a later import.
    assert few.imported + reasons.count("missing_reference") == 3
    assert_clean(host)
    small = run_import(agent, host, max_bytes=1)
    assert small.imported == 0
    assert {r.reason for r in small.refused} == {"too_large"}
    assert len(small.refused) == count - few.imported
    assert (run_import(agent, host).imported, small.present) == (count - few.imported, few.imported)


def test_a_commit_whose_tree_is_missing_is_refused_and_so_are_its_children(
    tmp_path: Path, agent: Repo, host: Repo
) -> None:
    scratch = Repo(tmp_path / "scratch")
    shutil.copytree(agent.path, scratch.path, symlinks=True)
    middle = scratch.rev("HEAD~2")
    tree = scratch.rev("HEAD~2^{tree}")
    scratch.loose_path(tree).unlink()
    report = run_import(scratch, host)
    refused = {r.name for r in report.refused if r.reason == "missing_reference"}
    after = {scratch.rev(f"HEAD~{i}") for i in range(3)}  # the middle one and its children
    assert refused == after
    assert middle in refused and not host.loose_path(middle).exists()
    assert_clean(host)
    with dir_fd(host.git_dir) as fd:
        moved = update_ref(
            fd,
            "refs/heads/agent/x",
            None,
            scratch.rev("HEAD"),
            committer=b"A <a@b>",
            message=b"m",
            owner=OWNER,
        )
    assert moved.outcome == "missing_object"


def test_a_pack_naming_an_object_nowhere_is_refused_and_taken_with_it(
    tmp_path: Path, agent: Repo, host: Repo
) -> None:
    scratch = Repo(tmp_path / "scratch")
    scratch.path.mkdir()
    (scratch.objects / "pack").mkdir(parents=True)
    head = agent.rev("HEAD")
    agent.git(
        "pack-objects", "-q", str(scratch.objects / "pack" / "pack"), stdin=f"{head}\n".encode()
    )
    (pack,) = scratch.packs()
    report = run_import(scratch, host)
    assert report.refused == (ObjectRefusal(f"pack/{pack.name}", "missing_reference"),)
    assert os.listdir(host.objects / "pack") == []
    # With the tree and the parent there too (loose, from the agent's store), it is whole.
    for oid in agent.object_ids() - {head}:
        target = scratch.loose_path(oid)
        target.parent.mkdir(exist_ok=True)
        shutil.copyfile(agent.loose_path(oid), target)
    report = run_import(scratch, host)
    assert report.refused == ()
    assert report.imported == len(agent.object_ids())
    assert_clean(host)


def test_a_partial_clone_takes_objects_naming_what_it_lacks_on_purpose(
    tmp_path: Path, agent: Repo, host: Repo
) -> None:
    head = agent.rev("HEAD")
    tree = agent.rev("HEAD^{tree}")
    source = tmp_path / "only-the-commit"
    shutil.copytree(agent.loose_path(head).parent, source / head[:2])
    (host.objects / "pack" / f"pack-{'b' * 40}.promisor").write_bytes(b"")
    report = run_import(source, host)
    assert report.refused == ()
    assert host.loose_path(head).exists() and not host.loose_path(tree).exists()


def test_has_object_finds_loose_and_packed(tmp_path: Path, agent: Repo) -> None:
    head = agent.rev("HEAD")
    with dir_fd(agent.objects) as fd:
        assert has_object(fd, head)
        assert not has_object(fd, "0" * 40)
        assert not has_object(fd, "not an id")
    agent.git("repack", "-adq")
    assert not agent.loose_path(head).exists()
    with dir_fd(agent.objects) as fd:
        assert has_object(fd, head)


@pytest.fixture
def many(tmp_path: Path) -> Repo:
    """A repository of more loose objects than `packing.UNPACK_LIMIT`."""
    repo = Repo.init(tmp_path / "many")
    repo.commit({f"d/{i:03d}.txt": f"file {i}\n" * 20 for i in range(150)}, "150 files")
    repo.commit({"d/000.txt": "changed\n"}, "one more")
    return repo


def test_many_loose_objects_are_written_as_one_pack_and_fsck_is_clean(
    many: Repo, host: Repo
) -> None:
    wanted = many.object_ids()
    assert len(wanted) >= packing.UNPACK_LIMIT
    report = run_import(many, host)
    assert report.refused == ()
    assert report.imported == len(wanted)
    (pack,) = host.packs()
    assert report.bytes == pack.stat().st_size + pack.with_suffix(".idx").stat().st_size
    assert not [p for p in host.objects.glob("??") if p.is_dir()]
    st = pack.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1000, 1000, 0o444)
    assert host.object_ids() == wanted
    assert_clean(host)
    assert host.git("log", "--format=%s", many.rev("HEAD")).split("\n")[:2] == [
        "one more",
        "150 files",
    ]
    assert not list(host.objects.rglob("tmp_*"))


def test_among_many_a_forged_and_a_disconnected_object_are_left_out(many: Repo, host: Repo) -> None:
    forged = many.rev("HEAD:d/001.txt")
    path = many.loose_path(forged)
    path.chmod(0o644)
    _, other = loose_bytes(b"blob", b"not what the name promises\n")
    path.write_bytes(other)
    gone = many.rev("HEAD^{tree}")  # the last commit's tree, missing: that commit is refused
    many.loose_path(gone).unlink()
    report = run_import(many, host)
    assert set(report.refused) >= {ObjectRefusal(forged, "hash_mismatch")}
    missing = {r.name for r in report.refused if r.reason == "missing_reference"}
    # The first commit's tree names the forged blob: it, and both commits, are left out.
    assert many.rev("HEAD") in missing and many.rev("HEAD~1") in missing
    assert {many.rev("HEAD~1:d"), many.rev("HEAD~1^{tree}")} <= missing
    assert len(host.packs()) == 1  # the rest, imported
    assert_clean(host)
    assert host.git("cat-file", "-t", many.rev("HEAD~1:d/002.txt")).strip() == "blob"
    assert not {many.rev("HEAD"), many.rev("HEAD~1"), forged} & host.object_ids()
    assert not list(host.objects.rglob("tmp_*"))


def test_nothing_is_opened_by_path(
    tmp_path: Path, many: Repo, host: Repo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dulwich and substrate.git open every file beneath a held fd: with `open` and
    dulwich's `GitFile` made to fail, and `os.open` to fail without a `dir_fd`, an import
    of loose objects and of a pack, a ref update and a commit walk all still work."""
    import builtins

    import dulwich.file
    import dulwich.pack

    scratch = Repo(tmp_path / "scratch")
    shutil.copytree(many.path, scratch.path, symlinks=True)
    scratch.git("repack", "-adq")
    other = Repo.init(tmp_path / "other")
    real_open = os.open

    def no_path(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"opened by path: {args}")

    def beneath_only(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if dir_fd is None:
            raise AssertionError(f"os.open without a dir fd: {path}")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    with (
        dir_fd(many.objects) as src,
        dir_fd(scratch.objects) as packed,
        dir_fd(host.objects) as dst,
        dir_fd(other.objects) as dst2,
        dir_fd(host.git_dir) as git,
    ):
        assert not has_object(dst, "0" * 40)  # (the kernel's openat2 probed once, by "/")
        monkeypatch.setattr(builtins, "open", no_path)
        monkeypatch.setattr(dulwich.file, "GitFile", no_path)
        monkeypatch.setattr(dulwich.pack, "GitFile", no_path)
        monkeypatch.setattr(os, "open", beneath_only)
        loose_report = import_objects(src, dst, owner=OWNER, max_bytes=BIG, max_objects=10_000)
        pack_report = import_objects(packed, dst2, owner=OWNER, max_bytes=BIG, max_objects=10_000)
        head = many.rev("HEAD")
        moved = update_ref(
            git,
            "refs/heads/agent/x",
            None,
            head,
            committer=b"A <a@b>",
            message=b"m",
            owner=OWNER,
        )
        found = commit_subjects(dst, head, None, limit=5)
        monkeypatch.undo()
    assert loose_report.refused == () and loose_report.imported == len(many.object_ids())
    assert pack_report.refused == () and pack_report.imported == len(many.object_ids())
    assert moved.outcome == "applied"
    assert found == ("one more", "150 files")


@pytest.mark.parametrize("packed", [False, True])
def test_a_large_blob_is_streamed_not_held(tmp_path: Path, host: Repo, packed: bool) -> None:
    """48 MiB that compress to almost nothing (the worst case for an inflate step):
    the import's Python allocations stay far below the blob's size."""
    import tracemalloc

    repo = Repo.init(tmp_path / "big")
    repo.commit({"big.bin": "substrate " * ((48 << 20) // 10)}, "big")
    if packed:
        repo.git("repack", "-adq")
    tracemalloc.start()
    try:
        report = run_import(repo, host)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.refused == () and report.imported == 3
    assert peak < 8 << 20
    assert_clean(host)


def test_overlay_whiteouts_in_the_source_are_no_objects_and_no_refusals(
    tmp_path: Path, agent: Repo, host: Repo
) -> None:
    """The source may be an overlay's upper directory: after a `git gc` in the sandbox,
    the loose objects it pruned are whiteouts (0/0 character devices) there."""
    upper = tmp_path / "upper"
    head = agent.rev("HEAD")
    pruned = agent.rev("HEAD~1")
    (upper / head[:2]).mkdir(parents=True)
    shutil.copyfile(agent.loose_path(head), upper / head[:2] / head[2:])
    (upper / pruned[:2]).mkdir(exist_ok=True)
    os.mknod(upper / pruned[:2] / pruned[2:], stat.S_IFCHR | 0o600, os.makedev(0, 0))
    (upper / "pack").mkdir()
    os.mknod(upper / "pack" / f"pack-{'c' * 40}.pack", stat.S_IFCHR | 0o600, os.makedev(0, 0))
    os.mknod(upper / "pack" / f"pack-{'c' * 40}.idx", stat.S_IFCHR | 0o600, os.makedev(0, 0))
    run_import(agent, host)  # the host has everything but what the upper dir brings
    report = run_import(upper, host)
    assert report.refused == ()
    assert (report.imported, report.present) == (0, 1)


def test_what_an_import_may_inflate_is_bounded(tmp_path: Path, agent: Repo, host: Repo) -> None:
    """A small zlib stream can make a large object, a small delta a larger one: the
    bytes made, not only those read, are bounded (`max_inflated_bytes`)."""
    report = run_import(agent, host, max_inflated_bytes=1000)
    assert report.refused and {r.reason for r in report.refused} <= {
        "too_large",
        "missing_reference",
    }
    assert "too_large" in {r.reason for r in report.refused}
    assert_clean(host)
    scratch = Repo(tmp_path / "scratch")
    shutil.copytree(agent.path, scratch.path, symlinks=True)
    scratch.git("repack", "-adq")
    (pack,) = scratch.packs()
    fresh = Repo.init(tmp_path / "fresh")
    packed = run_import(scratch, fresh, max_inflated_bytes=1000)
    assert packed.refused == (ObjectRefusal(f"pack/{pack.name}", "too_large"),)
    assert run_import(scratch, fresh).refused == ()
