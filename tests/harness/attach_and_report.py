"""Run `substrate attach` and write its exit status to a file (tmux does not always keep it).

Usage: python -m tests.harness.attach_and_report STATUS_FILE ATTACH_ARGS...
"""

from __future__ import annotations

import sys
from pathlib import Path

from substrate.pty.attach import main

if __name__ == "__main__":
    status = main(sys.argv[2:])
    Path(sys.argv[1]).write_text(f"{status}\n")
    sys.exit(status)
