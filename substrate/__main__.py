from substrate.cli.main import main

raise SystemExit(main())
