from substrate.cli import main

raise SystemExit(main())
