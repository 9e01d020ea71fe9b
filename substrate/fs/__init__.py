"""The file-system floor: names beneath held directory fds, never through a symlink.

Names resolved beneath held directory fds, never through a symlink; the steps that
change what is beneath them; the names of the state dir's entries. Imports nothing of
substrate but `substrate.errors`; every domain above uses it (workspaces, sandboxes, the
working layer, artifacts, secrets, homes, the daemon).

    paths.py   kernel  `split_relpath` (pure); `open_dir`/`opened_dir` by `openat2`
                       (`RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`) or an `O_NOFOLLOW` walk;
                       `lstat_at`, `open_regular`, `refusal_for` (errno → refusal)
    fsops.py   I/O     the one place that creates, renames and removes beneath a dir fd:
                       `make_dirs`, `create_exclusive`, `fill`, `rename_into`,
                       `atomic_write`, `rename_new`, `make_durable`, `remove_tree`;
                       `read_fd`/`read_regular` (capped)
    state.py   pure    `StatePaths`: every entry of the state dir (sockets, database, the
                       owners' directories), named once; `ENTRIES`, their names
"""
