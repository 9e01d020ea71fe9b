"""substrate.workspace."""
