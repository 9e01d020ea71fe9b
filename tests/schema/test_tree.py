"""docs/architecture.md's module tree: generated from docstrings, true to the modules."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from substrate.schema import tree
from tests.harness import PACKAGE_ROOT

ARCHITECTURE = PACKAGE_ROOT / "docs" / "architecture.md"


def test_architecture_tree_is_current() -> None:
    checked_in = ARCHITECTURE.read_text()
    assert checked_in == tree.render_architecture(checked_in), "run: python -m substrate.schema"


def _package(root: Path) -> Path:
    pkg = root / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""The package."""\n')
    (pkg / "a.py").write_text('"""First sentence of a. More detail here.\n\nBody."""\n')
    (pkg / "sub" / "__init__.py").write_text(
        '"""A sub-package: its map\nwrapped in two lines."""\n'
    )
    (pkg / "sub" / "b.py").write_text("'''B does one thing (docs/x.md §1).'''\nX = 1\n")
    return pkg


TABLE = {"a.py": "pure", "sub/": "", "sub/b.py": "edge"}


def test_tree_lines_are_docstrings_first_sentences_in_table_order(tmp_path: Path) -> None:
    assert tree.render_tree(_package(tmp_path), TABLE) == (
        "pkg/                         The package.\n"
        "  a.py              pure     First sentence of a.\n"
        "  sub/                       A sub-package: its map wrapped in two lines.\n"
        "    b.py            edge     B does one thing (docs/x.md §1).\n"
    )


def test_tree_reads_source_never_imports_it(tmp_path: Path) -> None:
    pkg = _package(tmp_path)
    (pkg / "a.py").write_text('"""Still described."""\nraise SystemExit("imported")\n')
    assert "Still described." in tree.render_tree(pkg, TABLE)


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ({"a.py": "pure", "sub/": ""}, "sub/b.py: a module the tree does not name"),
        ({**TABLE, "gone.py": "pure"}, "gone.py: named in the tree, no such module"),
        ({**TABLE, "a.py": "quick"}, "a.py: kind 'quick'"),
        ({"a.py": "", "sub/": "", "sub/b.py": "edge"}, "a.py: kind ''"),
        ({"sub/": "", "a.py": "pure", "sub/b.py": "edge"}, "sub/b.py: out of order"),
    ],
)
def test_table_and_modules_must_agree(tmp_path: Path, table: dict[str, str], says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        tree.render_tree(_package(tmp_path), table)


def test_a_module_needs_a_short_docstring(tmp_path: Path) -> None:
    pkg = _package(tmp_path)
    (pkg / "a.py").write_text("X = 1\n")
    with pytest.raises(ValueError, match=re.escape("pkg/a.py: no module docstring")):
        tree.render_tree(pkg, TABLE)
    (pkg / "a.py").write_text('"""' + "word " * 40 + '."""\n')
    with pytest.raises(ValueError, match=re.escape("pkg/a.py: the docstring's first sentence is")):
        tree.render_tree(pkg, TABLE)


def test_a_long_description_wraps_under_its_column(tmp_path: Path) -> None:
    pkg = _package(tmp_path)
    (pkg / "a.py").write_text('"""' + " ".join(["word"] * 25) + '."""\n')
    (line, more) = tree.render_tree(pkg, TABLE).splitlines()[1:3]
    assert len(line) <= tree.WIDTH
    assert more.startswith(" " * tree.DESCRIPTION_COLUMN + "word")


def test_the_table_names_every_module_of_substrate() -> None:
    assert set(tree.KIND_OF) == set(tree.modules(tree.PACKAGE))


def test_stale_tree_fails_the_check(tmp_path: Path) -> None:
    text = ARCHITECTURE.read_text().replace("The one refusal taxonomy.", "Stale words.")
    assert tree.render_architecture(text) != text


def test_schema_check_exits_1_on_a_stale_tree(tmp_path: Path) -> None:
    """`python -m substrate.schema --check` (run by .ci) fails on the tree alone."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("api.schema.json", "protocol.md"):
        (docs / name).write_text((PACKAGE_ROOT / "docs" / name).read_text())
    stale = ARCHITECTURE.read_text().replace("The one refusal taxonomy.", "Stale words.")
    (docs / "architecture.md").write_text(stale)
    client = PACKAGE_ROOT / "clients" / "typescript" / "src" / "generated.ts"
    argv = [sys.executable, "-m", "substrate.schema", str(docs / "api.schema.json"), "--check"]
    argv += ["--typescript", str(client)]
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_ROOT)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    assert (done.returncode, done.stdout) == (1, f"stale: {docs / 'architecture.md'}\n")
