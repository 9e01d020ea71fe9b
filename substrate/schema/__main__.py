"""`python -m substrate.schema [SCHEMA] [--protocol FILE] [--check]`.

Regenerates docs/api.schema.json (or SCHEMA) and the generated regions of
docs/protocol.md (method reference, refusals, profile and config keys; by default the
`protocol.md` next to SCHEMA). With `--check` nothing is written: the exit status is 1
when either file is not current.
"""

import argparse
import sys
from pathlib import Path

from substrate.schema import METHODS, render
from substrate.schema.reference import render_protocol

parser = argparse.ArgumentParser(prog="python -m substrate.schema", description=__doc__)
parser.add_argument(
    "schema",
    nargs="?",
    default="docs/api.schema.json",
    type=Path,
    help="the JSON Schema file to write (default docs/api.schema.json)",
)
parser.add_argument("--protocol", type=Path, help="default: protocol.md beside SCHEMA")
parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
args = parser.parse_args()
protocol: Path = args.protocol or args.schema.parent / "protocol.md"

try:
    wanted = {
        args.schema: render(),
        protocol: render_protocol(protocol.read_text()),
    }
except (OSError, ValueError) as exc:
    sys.exit(f"python -m substrate.schema: {exc}")

stale = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]
if args.check:
    for path in stale:
        print(f"stale: {path}")
    sys.exit(1 if stale else 0)
for path, text in wanted.items():
    if path in stale:
        path.write_text(text)
print(f"wrote {', '.join(map(str, stale)) or 'nothing (current)'} ({len(METHODS)} methods)")
