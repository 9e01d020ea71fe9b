"""substrate.cli.main."""
