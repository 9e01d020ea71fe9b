"""substrate.artifacts.store."""
