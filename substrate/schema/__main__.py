"""`python -m substrate.schema [SCHEMA] [--protocol FILE] [--architecture FILE] [--typescript FILE] [--check]`.

Regenerates docs/api.schema.json (or SCHEMA), the generated regions of docs/protocol.md
(method reference, refusals, profile and config keys), the module tree of
docs/architecture.md (`substrate.schema.tree`) and the TypeScript client's
`clients/typescript/src/generated.ts` (`substrate.schema.typescript`, from the
`rpc.discover` document); by default both pages are the ones next to SCHEMA and the
client is in the checkout holding SCHEMA's directory. With `--check` nothing is written:
the exit status is 1 when any file is not current.
"""

import argparse
import sys
from pathlib import Path

from substrate.schema import METHODS, openrpc, render
from substrate.schema.reference import render_protocol
from substrate.schema.tree import render_architecture
from substrate.schema.typescript import render_typescript

parser = argparse.ArgumentParser(prog="python -m substrate.schema", description=__doc__)
parser.add_argument(
    "schema",
    nargs="?",
    default="docs/api.schema.json",
    type=Path,
    help="the JSON Schema file to write (default docs/api.schema.json)",
)
parser.add_argument("--protocol", type=Path, help="default: protocol.md beside SCHEMA")
parser.add_argument("--architecture", type=Path, help="default: architecture.md beside SCHEMA")
parser.add_argument(
    "--typescript",
    type=Path,
    help="default: clients/typescript/src/generated.ts in the checkout holding SCHEMA's directory",
)
parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
args = parser.parse_args()
protocol: Path = args.protocol or args.schema.parent / "protocol.md"
architecture: Path = args.architecture or args.schema.parent / "architecture.md"
typescript: Path = args.typescript or (
    args.schema.parent.parent / "clients" / "typescript" / "src" / "generated.ts"
)

try:
    wanted = {
        args.schema: render(),
        protocol: render_protocol(protocol.read_text()),
        architecture: render_architecture(architecture.read_text()),
        typescript: render_typescript(openrpc.document()),
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
