"""`python -m substrate.schema [FILE]` regenerates docs/api.schema.json."""

import sys
from pathlib import Path

import substrate.api  # noqa: F401  (every layer declares its methods on import)
from substrate.schema import METHODS, render

target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/api.schema.json")
target.write_text(render())
print(f"wrote {target} ({len(METHODS)} methods)")
