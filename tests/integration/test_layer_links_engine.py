"""Symlinks and hard links made in a working-layer sandbox, against the real engine
(docs/working-layer.md, "Symlinks").

A daemon runs in-process on a uid-1000 checkout adopted under `write_deny = [".env"]`,
with the shipped `default` profile (`symlinks = "any"`), the same with `"inside"` and
with `"none"`, one with a passthrough `node_modules`, and the shipped rw `tiny`. Beside
the checkout is a directory `outside` (holding a `.env` and a `secret`) that links in
the checkout point to: nothing substrate does may follow them there.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from substrate.config import PROJECT_ROOT
from substrate.protocol.client import AsyncClient, RpcError, open_client
from tests.harness.inprocess import in_process_config, owned_project, profiles_dir, serving

SECRET = "outside secret\n"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Env:
    client: AsyncClient
    ws: str
    path: Path
    outside: Path

    async def sh(self, script: str, profile: str = "default", **params: Any) -> Any:
        return await self.client.call(
            "proc.run", workspace=self.ws, profile=profile, argv=["sh", "-c", script], **params
        )

    def outside_untouched(self) -> None:
        assert sorted(os.listdir(self.outside)) == [".env", "secret"]
        assert (self.outside / "secret").read_text() == SECRET
        assert (self.outside / ".env").read_text() == "KEY=1\n"


@pytest.fixture
async def env(
    sandbox_image: str, tiny_image: str, engine_state: Path, tmp_path: Path
) -> AsyncIterator[Env]:
    default = (PROJECT_ROOT / "profiles" / "default.toml").read_text()
    assert 'symlinks = "any"' in default  # the shipped default applies every link
    variants = {
        "inside": default.replace('symlinks = "any"', 'symlinks = "inside"'),
        "none": default.replace('symlinks = "any"', 'symlinks = "none"'),
        "pass": default.replace("passthrough = []", 'passthrough = ["node_modules"]'),
    }
    profiles = profiles_dir(tmp_path / "profiles", ["default", "tiny"], **variants)
    outside = tmp_path / "roots" / "outside"
    outside.mkdir(parents=True)
    (outside / "secret").write_text(SECRET)
    (outside / ".env").write_text("KEY=1\n")
    project = owned_project(
        tmp_path / "roots" / "project",
        {
            ".git/HEAD": "ref: refs/heads/main\n",
            "src/app.py": "print('hi')\n",
            "old.txt": "old\n",
        },
    )
    config = in_process_config(engine_state, project.parent, profiles)
    async with serving(config), open_client(engine_state / "substrate.sock") as client:
        ws = await client.call(
            "workspace.adopt", path=str(project), policy={"write_deny": [".env"]}
        )
        yield Env(client, ws["workspace"], project, outside)


def lexists(path: Path) -> bool:
    """Does anything (a dangling link too) stand at `path`?"""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    return True


def links_of(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {e["path"]: e for e in entries if e.get("kind") == "symlink"}


async def test_an_in_tree_venv_made_on_default_is_used_by_the_next_command(env: Env) -> None:
    made = await env.sh("python3 -m venv .venv")
    assert made["exit_code"] == 0, made
    changes = made["changes"]
    assert not changes.get("blocked", []) and not changes.get("conflicts", []), changes
    applied = links_of(changes.get("applied", []))
    assert applied[".venv/bin/python"]["target"] == "python3"
    assert applied[".venv/bin/python"]["escapes"] is False
    assert applied[".venv/bin/python3"]["target"] == "/usr/bin/python3"
    assert applied[".venv/bin/python3"]["escapes"] is True
    assert os.readlink(env.path / ".venv/bin/python") == "python3"
    assert os.lstat(env.path / ".venv/bin/python").st_uid == 1000
    used = await env.sh(".venv/bin/python -c 'import sys; print(sys.prefix)'")
    assert used["exit_code"] == 0, used
    assert used["stdout"]["inline"].strip() == "/workspace/.venv"
    pip = await env.sh(".venv/bin/python -m pip --version")
    assert pip["exit_code"] == 0, pip
    assert "/workspace/.venv" in pip["stdout"]["inline"]


async def test_npm_style_relative_links_are_applied_and_usable(env: Env) -> None:
    script = (
        "mkdir -p node_modules/x node_modules/.bin"
        " && printf '#!/bin/sh\\necho cli-ok\\n' > node_modules/x/cli.js"
        " && chmod +x node_modules/x/cli.js"
        " && ln -s ../x/cli.js node_modules/.bin/x"
    )
    made = await env.sh(script)
    assert made["exit_code"] == 0
    link = links_of(made["changes"].get("applied", []))["node_modules/.bin/x"]
    assert (link["op"], link["target"], link["escapes"]) == ("create", "../x/cli.js", False)
    host = env.path / "node_modules/.bin/x"
    assert os.readlink(host) == "../x/cli.js"
    assert host.read_text() == "#!/bin/sh\necho cli-ok\n"  # resolves on the host
    ran = await env.sh("node_modules/.bin/x")
    assert ran["exit_code"] == 0 and ran["stdout"]["inline"] == "cli-ok\n"
    # A replaced link, and a deleted one, land the same way.
    again = await env.sh("ln -sfn ../y node_modules/.bin/x && ln -s cli.js node_modules/x/c")
    assert links_of(again["changes"].get("applied", []))["node_modules/.bin/x"]["op"] == "replace"
    assert os.readlink(host) == "../y"
    gone = await env.sh("rm node_modules/.bin/x")
    assert [(e["path"], e["op"]) for e in gone["changes"].get("applied", [])] == [
        ("node_modules/.bin/x", "delete")
    ]
    assert not lexists(host)


async def test_inside_blocks_an_absolute_link_and_none_blocks_all(env: Env) -> None:
    inside = await env.sh("ln -s /etc/passwd abs && ln -s src/app.py rel", profile="inside")
    changes = inside["changes"]
    assert [(e["path"], e["kind"], e["reason"]) for e in changes.get("blocked", [])] == [
        ("abs", "symlink", "symlink")
    ]
    assert list(links_of(changes.get("applied", []))) == ["rel"]
    assert os.readlink(env.path / "rel") == "src/app.py"
    assert not lexists(env.path / "abs")
    none = await env.sh("ln -s /etc/passwd abs2 && ln -s src/app.py rel2", profile="none")
    assert sorted((e["path"], e["reason"]) for e in none["changes"].get("blocked", [])) == [
        ("abs2", "symlink"),
        ("rel2", "symlink"),
    ]
    assert not none["changes"].get("applied", [])
    assert not lexists(env.path / "rel2")


async def test_an_agent_cannot_loosen_the_profiles_symlinks(env: Env) -> None:
    with pytest.raises(RpcError) as caught:
        await env.sh("ln -s /etc/passwd abs", profile="none", symlinks="any")
    assert caught.value.refusal == "invalid_params"
    assert not lexists(env.path / "abs")


async def test_a_link_named_env_is_denied_like_a_file(env: Env) -> None:
    result = await env.sh("ln -s /etc/passwd .env && ln -s ../outside .git/evil || true")
    blocked = {e["path"]: e for e in result["changes"].get("blocked", [])}
    assert (blocked[".env"]["reason"], blocked[".env"]["rule"]) == ("path_denied", ".env")
    assert not lexists(env.path / ".env")
    assert not lexists(env.path / ".git/evil")


async def test_hard_links_are_applied_as_separate_files(env: Env) -> None:
    result = await env.sh("echo same > h1 && ln h1 h2")
    assert sorted(e["path"] for e in result["changes"].get("applied", [])) == ["h1", "h2"]
    one, two = os.lstat(env.path / "h1"), os.lstat(env.path / "h2")
    assert one.st_ino != two.st_ino and one.st_nlink == two.st_nlink == 1
    assert (env.path / "h2").read_text() == "same\n"


async def test_a_fifo_and_a_huge_target_are_blocked_by_name(env: Env) -> None:
    long = "a" * 4000
    result = await env.sh(f"mkfifo pipe && ln -s {long} long")
    assert sorted((e["path"], e["reason"]) for e in result["changes"].get("blocked", [])) == [
        ("long", "target_too_long"),
        ("pipe", "fifo"),
    ]


async def _plant(env: Env) -> None:
    """Links in the checkout, made by a command: to /etc/passwd, to the outside
    directory, a loop, and old.txt (a file) replaced by a link to the outside secret."""
    out = env.outside
    script = (
        f"ln -s /etc/passwd passwd && ln -s {out} outdir && ln -s loop loop"
        f" && rm old.txt && ln -s {out}/secret old.txt && ln -s {out} node_modules"
    )
    result = await env.sh(script)
    assert result["exit_code"] == 0
    applied = links_of(result["changes"].get("applied", []))
    assert set(applied) == {"passwd", "outdir", "loop", "old.txt", "node_modules"}
    assert all(applied[p]["escapes"] for p in ("passwd", "outdir", "old.txt"))
    assert applied["loop"]["escapes"] is False


async def test_nothing_follows_the_links_once_they_are_in_the_checkout(env: Env) -> None:
    checkpoint = await env.client.call("workspace.checkpoint", workspace=env.ws)
    await _plant(env)
    call = env.client.call
    for method, params in [
        ("fs.read", {"path": "passwd"}),
        ("fs.read", {"path": "loop"}),
        ("fs.read", {"path": "outdir/secret"}),
        ("fs.stat", {"path": "outdir/secret"}),
        ("fs.list", {"path": "outdir"}),
        ("fs.walk", {"path": "outdir"}),
        ("fs.write", {"path": "outdir/new", "base_sha256": None, "content": "x"}),
        ("fs.write", {"path": "passwd", "base_sha256": sha(b"x"), "content": "x"}),
        ("fs.write", {"path": "loop", "base_sha256": None, "content": "x"}),
        ("fs.delete", {"path": "outdir/secret", "base_sha256": sha(SECRET.encode())}),
        ("fs.patch", {"path": "old.txt", "base_sha256": sha(b"old\n"), "edits": []}),
    ]:
        with pytest.raises(RpcError) as caught:
            await call(method, workspace=env.ws, **params)
        assert caught.value.refusal in ("symlink_refused", "already_exists"), (method, params)
    # A listing shows the links as links, never what they point to.
    listed = await call("fs.list", workspace=env.ws, path=".")
    kinds = {e["name"]: e["kind"] for e in listed["entries"]}
    assert {kinds[n] for n in ("passwd", "outdir", "loop", "old.txt")} == {"symlink"}
    walked = await call("fs.walk", workspace=env.ws)
    assert not [e for e in walked["paths"] if e["path"].startswith("outdir/")]
    found = await call("fs.search", workspace=env.ws, pattern="outside secret")
    assert not found["matches"]
    # An upload through a link is refused at begin.
    data = b"up\n"
    with pytest.raises(RpcError) as caught:
        await call(
            "fs.upload.begin",
            workspace=env.ws,
            path="outdir/up",
            base_sha256=None,
            size=len(data),
            sha256=sha(data),
        )
    assert caught.value.refusal == "symlink_refused"
    # A checkpoint made with the links present, and restored: nothing to put back.
    later = await call("workspace.checkpoint", workspace=env.ws)
    again = await call("workspace.restore", workspace=env.ws, checkpoint=later["checkpoint"])
    assert not again.get("restored") and not again.get("conflicts")
    # A restore puts nothing back through a link: old.txt is one now.
    restored = await call(
        "workspace.restore", workspace=env.ws, checkpoint=checkpoint["checkpoint"]
    )
    assert "old.txt" not in [f["path"].split(":", 1)[1] for f in restored["restored"]]
    assert os.readlink(env.path / "old.txt") == f"{env.outside}/secret"
    # The next layer command: its scan and the mounts never resolve through them.
    seen = await env.sh("cat outdir/secret; ls node_modules/; echo changed > passwd2; rm loop")
    assert SECRET.strip() not in seen["stdout"]["inline"]
    assert [(e["path"], e["op"]) for e in seen["changes"].get("applied", [])] == [
        ("loop", "delete"),
        ("passwd2", "create"),
    ]
    # A sandbox made now, with the links in the checkout: its mounts (the overlay, the
    # read-only git parts found by a walk) never resolve through them.
    fresh = await env.sh("ls -l; cat outdir/secret old.txt 2>&1; true", profile="inside")
    assert fresh["exit_code"] == 0
    assert "outdir ->" in fresh["stdout"]["inline"]
    assert SECRET.strip() not in fresh["stdout"]["inline"]
    # An rw command and its reactive gate (a denied .env made and reverted): the gate
    # walks the checkout, never into `outdir`, whose .env is not the checkout's.
    gated = await env.sh("echo x > .env; true", profile="tiny")
    assert gated["exit_code"] == 0
    assert not lexists(env.path / ".env")
    env.outside_untouched()
    assert os.readlink(env.path / "passwd") == "/etc/passwd"


async def test_changes_get_lists_a_kept_link_with_its_target(env: Env) -> None:
    result = await env.sh("ln -s ../up up", changes="review")
    cs = result["changes"]["changeset"]
    review = links_of(result["changes"].get("review", []))
    assert review["up"]["target"] == "../up" and review["up"]["escapes"] is True
    got = await env.client.call("changes.get", changeset=cs)
    (change,) = got["changes"]
    assert (change["kind"], change["target"], change["escapes"]) == ("symlink", "../up", True)
    assert change["new_sha256"] == sha(b"../up")
    applied = await env.client.call("changes.apply", changeset=cs)
    assert links_of(applied["applied"])["up"]["target"] == "../up"
    assert os.readlink(env.path / "up") == "../up"
    read = await env.client.call("journal.read", workspace=env.ws)
    (entry,) = [e for e in read["entries"] if e["kind"] == "changes.apply_link"]
    assert entry["data"]["escapes"] is True and entry["data"]["target_bytes"] == 5
    assert "../up" not in str(entry["data"])  # the target itself is never journaled


async def test_a_passthrough_dir_that_is_a_link_is_never_bound(env: Env, tmp_path: Path) -> None:
    project = owned_project(tmp_path / "roots" / "plain", {"src/app.py": "print(1)\n"})
    ws = (await env.client.call("workspace.adopt", path=str(project)))["workspace"]
    plain = Env(env.client, ws, project, env.outside)
    made = await plain.sh(f"ln -s {env.outside} node_modules")
    assert list(links_of(made["changes"].get("applied", []))) == ["node_modules"]
    seen = await plain.sh("ls node_modules/ 2>&1; echo x > node_modules/new; true", profile="pass")
    assert "secret" not in seen["stdout"]["inline"]
    assert os.readlink(project / "node_modules") == str(env.outside)
    env.outside_untouched()
