"""Which names are refs substrate reads or changes: git's check-ref-format rules, under refs/.

A name is `refs/` and one or more components joined by `/`. As `git check-ref-format`
rules (and `refs.c`'s `check_refname_component`): no component is empty, begins with
`.` or ends with `.lock`; the name has no `..`, no `@{`, no ASCII control character,
space, `~`, `^`, `:`, `?`, `*`, `[` or `\\`, and does not end with `.`. Beyond git: at
most `MAX_REF_BYTES` bytes of UTF-8 and `MAX_COMPONENT_BYTES` a component (each is a
file name in `refs/`), so every valid name is also a path substrate can open beneath
the git directory without resolving anything.
"""

from __future__ import annotations

import re

#: The longest ref name taken, in bytes (a path beneath the git directory).
MAX_REF_BYTES = 1024
#: The longest component, in bytes (a file name).
MAX_COMPONENT_BYTES = 255

_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{")


def valid_ref_name(name: str) -> bool:
    """Whether `name` is a ref under `refs/` that git would also take (module docstring).
    Pure; costs one pass over the name."""
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    if len(encoded) > MAX_REF_BYTES or not name.startswith("refs/"):
        return False
    if _FORBIDDEN.search(name) or name.endswith("."):
        return False
    for component in name.split("/"):
        if not component or component.startswith(".") or component.endswith(".lock"):
            return False
        if len(component.encode("utf-8")) > MAX_COMPONENT_BYTES:
            return False
    return True
