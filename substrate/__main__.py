"""`python -m substrate`: the `substrate` command line (`substrate.cli.main`)."""

from substrate.cli.main import main

raise SystemExit(main())
